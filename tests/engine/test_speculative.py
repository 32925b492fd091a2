"""Speculative decoding: n-gram proposals ride as decode rows of the one launch, the device keeps the
prefix its own draws agree with, and the output is the output without speculation, token for token,
greedy or seeded, alone or batched; the rejection rule keeps the target's distribution."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fusedserve.coordinator.cli_parser import build_parser
from fusedserve.coordinator.client import Client
from fusedserve.coordinator.engine.block_manager import BlockManager
from fusedserve.coordinator.engine.llm_engine import LLMEngine, load_model
from fusedserve.coordinator.engine.speculative.ngram_proposer import NgramProposer
from fusedserve.coordinator.engine.speculative.speculation_policy import MIN_GAIN, SpecState
from fusedserve.coordinator.model_files.default_model import TRAINED_DIR
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.structured.structured_spec import StructuredSpec
from fusedserve.kernels import sampler
from fusedserve.kernels.speculation import accept_prefix
from tests.support import running_server

# bf16 through the native kernels: each row's logits have the same bits whatever the batch, so a
# request's proposal rows compute exactly what its later decode rows would.
RC = dict(max_batch=16, block_size=4, num_blocks=256, cpu_gemm="native")
NGRAM = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
# Repetitive text (code, a list), where prompt lookup finds proposals, and prose, where it rarely does.
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
           "The list of names: alpha, beta, gamma, alpha, beta, gamma, alpha,",
           "Once upon a time"]


@pytest.fixture(scope="module")
def model():
    return load_model("default")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    """A 2-layer draft sharing the default model's vocabulary: its first two layers."""
    out = tmp_path_factory.mktemp("draft")
    src = load_file(str(TRAINED_DIR / "model.safetensors"))
    keep = {k: v for k, v in src.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((TRAINED_DIR / "config.json").read_text())
    config["num_hidden_layers"] = 2
    config.pop("layer_types", None)
    (out / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TRAINED_DIR / f, out / f)
    return out


def _generate(model, prompts, params, **settings):
    m, tok = model
    with LLMEngine(m, tokenizer=tok, **{**RC, **settings}) as eng:
        outs = eng.generate(prompts, params)
        spec = eng.core.scheduler.speculation
        blocks = eng.core.scheduler.blocks
        assert blocks.num_used == 0, "every block is free or held by the prefix cache only"
        return [(o.token_ids, o.text, o.finish_reason) for o in outs], spec


def _params(n: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=48, **kw) for _ in range(n)]


# ----------------------------------------------------------------------------------- proposer

def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(max_n=3, min_n=1)
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], 2) == [7, 8], "latest of the 3-gram"
    assert p.propose([5, 6, 7, 4, 6, 7], 3) == [4, 6, 7], "the 2-gram (6, 7) at 1, then what follows"
    assert p.propose([1, 2, 3, 4], 3) == [], "no suffix recurs"
    assert p.propose([4, 1, 2, 4], 5) == [1, 2, 4], "as many as there are"
    assert p.propose([1, 1], 0) == []
    assert NgramProposer(max_n=4, min_n=2).propose([3, 8, 1, 8], 2) == [], "a 1-gram is below min_n"


# ----------------------------------------------------------------------------- device verification

def test_accept_prefix_keeps_the_agreeing_prefix_and_blanks_the_rest():
    # Rows: 0 plain; request A rows 1-4 (proposals 11, 12, 13); request B rows 5-6 (proposal 21);
    # request C rows 7-9 (proposals 31, 32).
    token_ids = torch.tensor([5, 10, 11, 12, 13, 20, 21, 30, 31, 32], dtype=torch.int32)
    drawn = torch.tensor([6, 11, 12, 99, 77, 21, 55, 44, 31, 32], dtype=torch.int32)
    rows = torch.tensor([[1, 2, 3, 4], [5, 6, 5, 5], [7, 8, 9, 7]], dtype=torch.int64)
    ids, accepted = drawn.clone(), torch.zeros(3, dtype=torch.int32)
    accept_prefix(ids, token_ids, rows, accepted)
    # A: 11, 12 accepted, 13 rejected by the draw 99 -> 11, 12, 99. B: 21 accepted, then 55 (all
    # accepted: the last row's draw too). C: 31 rejected at once -> 44.
    assert accepted.tolist() == [3, 2, 1]
    assert ids.tolist() == [6, 11, 12, 99, -1, 21, 55, 44, -1, -1]


def test_the_rejection_rule_keeps_the_target_distribution():
    """Point-mass proposals checked by draws at (seed, step): over many seeds the first emitted token
    follows the target's processed distribution (chi-square), the acceptance rate is p(proposal), and
    the token after an accepted proposal is drawn again from its own row."""
    vocab, n, proposal, t, top_k = 8, 6000, 2, 0.9, 6
    logits = torch.tensor([2.0, 1.0, 1.5, 0.2, -1.0, 0.5, 0.0, -3.0])
    kept = logits >= torch.topk(logits, top_k).values[-1]  # tokens 4 and 7 are cut by top-k
    p = torch.where(kept, torch.softmax(logits / t, 0), 0).double()
    p = (p / p.sum()).numpy()
    rows = 2 * n  # per seed: the newest token's row (verifies the proposal) and the proposal's row
    lg = logits.repeat(rows, 1).contiguous()
    params = torch.tensor([[t, 1.0, 0.0, top_k]] * rows, dtype=torch.float32)
    seeds = torch.tensor([[s // 2, s % 2] for s in range(rows)], dtype=torch.int64)
    out = torch.zeros(rows, dtype=torch.int32)
    sampler.sample(lg, params, seeds, out, sampler.SamplingPlan.for_rows(params.numpy(), 64, vocab), 64)
    plain_first = out[0::2].clone()
    token_ids = torch.tensor([0, proposal] * n, dtype=torch.int32)
    spec_rows = torch.arange(rows, dtype=torch.int64).view(n, 2)
    accepted = torch.zeros(n, dtype=torch.int32)
    accept_prefix(out, token_ids, spec_rows, accepted)
    first = out[0::2]
    assert torch.equal(first, plain_first), "the first token is the draw without speculation"
    _chi_square_fits(first.numpy(), p)
    rate = float((accepted == 2).double().mean())
    sd = float(np.sqrt(p[proposal] * (1 - p[proposal]) / n))
    assert abs(rate - p[proposal]) < 4 * sd, f"acceptance {rate:.3f} vs p(proposal) {p[proposal]:.3f}"
    _chi_square_fits(out[1::2][accepted == 2].numpy(), p)
    assert (out[1::2][accepted == 1] == -1).all(), "a rejected proposal's row is never handed back"


def _chi_square_fits(draws: np.ndarray, p: np.ndarray) -> None:
    """Counts of ``draws`` against ``p``: none where p is 0, chi-square below its 0.1% critical value
    (5 degrees of freedom: six tokens kept)."""
    counts = np.bincount(draws, minlength=len(p))
    assert counts[p == 0].sum() == 0, "a token the sampler cuts was emitted"
    expected = p[p > 0] * len(draws)
    chi2 = float(((counts[p > 0] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, f"chi-square {chi2:.1f} over 5 degrees of freedom (p < 0.001)"


# ------------------------------------------------------------------------------ block manager

def test_trim_gives_back_the_blocks_past_the_tokens():
    bm = BlockManager(16, 4, True)
    bm.allocate("s", list(range(6)), reserve=1)
    bm.commit("s", list(range(6)), 4)  # block 0 named
    bm.ensure("s", 6 + 8)  # proposals: room for 14 tokens, 4 blocks
    assert len(bm.table("s")) == 4
    free = bm.num_free
    bm.trim("s", 9)  # 9 tokens kept: 3 blocks
    assert len(bm.table("s")) == 3 and bm.num_free == free + 1
    bm.trim("s", 1)  # never below the named blocks
    assert len(bm.table("s")) == 1 and bm.committed("s") == 1
    bm.free("s")
    assert bm.num_used == 0


def test_policy_pauses_a_request_whose_proposals_do_not_pay_and_probes_again():
    st = SpecState()
    step = 0
    while st.active(step):
        st.record(0, step)
        step += 1
    assert st.gain < MIN_GAIN * 2 + 1e-9 and not st.active(step)
    first = st.resume_at - step
    while not st.active(step):
        step += 1
    st.record(0, step)
    st.record(0, step)
    assert st.resume_at - step > first, "a second failed spell pauses longer"
    st.resume_at = 0
    for _ in range(5):
        st.record(3, step)
    assert st.active(step) and st.gain > 2


# ------------------------------------------------------------------------------- exactness

def test_greedy_output_equals_greedy_without_speculation(model):
    for prompts in (PROMPTS[:1], PROMPTS):  # batch 1, then a mixed batch
        want, _ = _generate(model, prompts, _params(len(prompts)))
        got, spec = _generate(model, prompts, _params(len(prompts)), **NGRAM)
        assert got == want
        assert spec.stats.accepted > 0 and spec.stats.proposed > spec.stats.accepted >= 0


def test_seeded_output_equals_output_without_speculation_whatever_the_batch(model):
    # Temperature 0.5: sampled, yet low enough that the repetitive prompts' continuations take
    # proposals (10-19 accepted for two seed sets; at 0.8 a seed set can see none accepted).
    params = [SamplingParams(max_tokens=40, temperature=0.5, top_p=0.95, seed=7 + i)
              for i in range(len(PROMPTS))]
    want, _ = _generate(model, PROMPTS, params)
    got, spec = _generate(model, PROMPTS, params, **NGRAM)
    assert got == want and spec.stats.accepted > 0
    alone, _ = _generate(model, PROMPTS[:1], params[:1], **NGRAM)
    assert alone[0] == got[0], "the same request and seed, alone or batched"


def test_stops_lengths_and_logprobs_are_exact_with_speculation(model):
    """A stop string or id met inside an accepted run ends the request there; max_tokens is never
    passed; each accepted token carries its own row's logprob. The stops are taken from the free
    output's late, repeated part, where proposals are accepted."""
    free, _ = _generate(model, PROMPTS[:2], _params(2))
    m, tok = model
    stop_text = tok.decode(free[0][0][20:24])
    kinds = [dict(stop=[stop_text]), dict(stop_token_ids=[free[1][0][21]]), dict(max_tokens=7),
             dict(logprobs=True, top_logprobs=2)]
    runs = []
    for settings in ({}, NGRAM):
        with LLMEngine(m, tokenizer=tok, **{**RC, **settings}) as eng:
            runs.append(eng.generate(PROMPTS, [SamplingParams(**{"max_tokens": 40, **k}) for k in kinds]))
    want, got = runs
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert [g.finish_reason for g in got] == ["stop", "stop", "length", "length"]
    assert len(got[0].token_ids) < 24 and len(got[1].token_ids) <= 22 and len(got[2].token_ids) == 7
    assert got[3].logprobs == pytest.approx(want[3].logprobs, abs=1e-5) and len(got[3].logprobs) == 40


def test_policy_gates_by_batch_and_skips_penalized_rows(model):
    prompts = PROMPTS * 2
    want, _ = _generate(model, prompts, _params(len(prompts)))
    got, spec = _generate(model, prompts, _params(len(prompts)), **NGRAM, speculative_max_batch=2)
    assert got == want
    few = spec.stats.proposed
    _, spec1 = _generate(model, PROMPTS[:2], _params(2), **NGRAM, speculative_max_batch=2)
    assert spec1.stats.proposed > few, "8 decoding requests speculate only once few are left"
    pen, spec2 = _generate(model, PROMPTS[:1], _params(1, repetition_penalty=1.3), **NGRAM)
    assert spec2.stats.proposed == 0
    assert pen == _generate(model, PROMPTS[:1], _params(1, repetition_penalty=1.3))[0]


def test_constrained_rows_speculate_with_the_grammar_applied_to_the_proposals(model):
    """Each proposal row is masked by the grammar after the proposals before it, and a proposal the
    grammar refuses is never made: constrained output is the output without speculation."""
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["alpha", "beta"]},
                                                        "minItems": 6, "maxItems": 6}},
              "required": ["tags"], "additionalProperties": False}
    literal = "alpha, beta, gamma, alpha, beta, gamma, alpha, beta, gamma, alpha, beta, gamma."
    specs = [StructuredSpec("regex", re.escape(literal)), StructuredSpec("json", schema),
             StructuredSpec("json", schema)]
    params = [SamplingParams(max_tokens=60, structured=specs[0]),
              SamplingParams(max_tokens=60, structured=specs[1]),
              SamplingParams(max_tokens=60, temperature=1.0, seed=3, structured=specs[2])]
    prompts = [PROMPTS[2], "The tags:", "The tags:"]
    want, _ = _generate(model, prompts, params)
    got, spec = _generate(model, prompts, params, **NGRAM)
    assert got == want
    assert got[0][1] == literal and got[0][2] == "stop"
    for g in got[1:]:
        assert len(json.loads(g[1])["tags"]) == 6
    assert spec.stats.accepted > 0


def _draft(draft_dir: Path, **kw) -> dict:
    return dict(speculative_method="draft", speculative_model=str(draft_dir), num_speculative_tokens=3, **kw)


def test_a_draft_model_on_the_device_keeps_greedy_and_seeded_output(model, draft_dir):
    """The draft runs inside the launch (its proposals never reach the host); a 2-layer truncation of
    the target agrees with it often, and the output is the output without speculation."""
    params = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, temperature=0.8, seed=4),
              SamplingParams(max_tokens=33), SamplingParams(max_tokens=40, stop=[" the"])]
    want, _ = _generate(model, PROMPTS, params)
    for prompts, ps in ((PROMPTS[:1], params[:1]), (PROMPTS, params)):
        got, spec = _generate(model, prompts, ps, **_draft(draft_dir))
        assert got == want[: len(prompts)]
        assert spec.method == "draft" and spec.stats.accepted > 0
    # Chunked prompts and a tight cache: the draft's K/V follow every chunk, preemption and rollback.
    got, spec = _generate(model, PROMPTS, params, max_num_batched_tokens=24, num_blocks=40,
                          **_draft(draft_dir))
    assert got == want and spec.stats.accepted > 0


def test_a_draft_must_share_the_vocabulary(model, hf_checkpoints):
    m, tok = model
    other = next(iter(hf_checkpoints.values()))
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(m, tokenizer=tok, **RC, **_draft(other))


def test_preemption_and_a_tight_cache_lose_nothing(model):
    want, _ = _generate(model, PROMPTS, _params(len(PROMPTS)), num_blocks=40)
    got, spec = _generate(model, PROMPTS, _params(len(PROMPTS)), num_blocks=40, **NGRAM)
    assert got == want and spec.stats.accepted > 0


def test_served_greedy_and_seeded_equal_offline_without_speculation(model, ray_session):
    params = [dict(max_tokens=32), dict(max_tokens=32, temperature=0.7, seed=5)]
    want = {}
    for i, prompt in enumerate(PROMPTS):
        p = params[i % 2]
        want[i] = _generate(model, [prompt], [SamplingParams(**p)])[0][0][0]
    with running_server(**RC, **NGRAM) as coord, Client(coord.address) as c:
        for i, prompt in enumerate(PROMPTS):
            assert c.generate(prompt, **params[i % 2])["token_ids"] == want[i]
        # Streamed: one frame per token, in order, each with its own index and logprob, although a
        # launch appends several tokens of a speculating request at once.
        frames = list(c.stream(PROMPTS[0], max_tokens=32, logprobs=True))
        tokens, done = frames[:-1], frames[-1]
        assert [f["index"] for f in tokens] == list(range(32))
        assert [f["token"] for f in tokens] == done["token_ids"] == want[0]
        assert len({f["logprob"] for f in tokens}) > 1
        stats = c.stats()["workers"][0]["speculative"]
    assert stats["method"] == "ngram" and stats["accepted"] > 0
    assert 0 < stats["acceptance_rate"] <= 1


def test_speculative_config_flag_reads_vllms_json_and_is_on_by_default_for_serve():
    parse = build_parser().parse_args
    assert parse(["serve"]).speculative_config == {"speculative_method": "ngram"}
    assert parse(["serve", "--speculative-config", "off"]).speculative_config == {"speculative_method": "off"}
    got = parse(["serve", "--speculative-config", '{"model": "d", "num_speculative_tokens": 3, '
                 '"disable_by_batch_size": 2}']).speculative_config
    assert got == {"speculative_method": "draft", "speculative_model": "d", "num_speculative_tokens": 3,
                   "speculative_max_batch": 2}
    for bad in ('{"method": "eagle"}', '{"num_speculative_tokens": 0}', '{"lookahead": 2}', "[1]", "{",
                '{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}'):
        with pytest.raises(SystemExit):
            parse(["serve", "--speculative-config", bad])
