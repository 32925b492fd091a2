"""Structured outputs in the engine: the token mask is applied on the device, its bytes are
counted (h2d B x ceil(V/32) x 4, d2h still ids only), constrained rows never change their
unconstrained neighbours, and they work with async scheduling, preemption and thinking."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.structured.grammar_compiler import GrammarCompiler
from fusedserve.coordinator.structured.structured_spec import StructuredError, StructuredSpec
from fusedserve.kernels import sampler
from fusedserve.shared_memory.slots import step_table

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "size", "tags"], "additionalProperties": False}
PROMPTS = ["def parse(text):", "The module provides", "Return the list of", "import os\n",
           "class Queue:", "Raises ValueError if", "The default is", "for item in"]


@pytest.fixture(scope="module")
def engine():
    rc = dict(max_batch=16, num_blocks=256, block_size=8)
    with LLMEngine("default", dtype="float32", **rc) as eng:
        eng.runtime.keep_history = 10_000
        yield eng


def _json(seed: int, temperature: float = 1.0, max_tokens: int = 80) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured=StructuredSpec("json", SCHEMA))


def test_every_kind_holds_its_constraint(engine):
    specs = [StructuredSpec("json", SCHEMA), StructuredSpec("json_object"),
             StructuredSpec("regex", r"[0-9]{3}-[a-z]{2,4}"),
             StructuredSpec("choice", ["yes", "no", "maybe"]),
             StructuredSpec("grammar", 'start: "x=" NUM ";"\nNUM: /[0-9]{1,4}/'),
             StructuredSpec("grammar", 'root ::= "v" [0-9] [0-9]')]
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured=s)
              for i, s in enumerate(specs)]
    outs = engine.generate(PROMPTS[: len(specs)], params)
    assert all(o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert isinstance(json.loads(outs[1].text), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[2].text)
    assert outs[3].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"x=[0-9]{1,4};", outs[4].text)
    assert re.fullmatch(r"v[0-9]{2}", outs[5].text)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_constrained_rows_leave_their_neighbours_unchanged(async_scheduling):
    rc = dict(max_batch=16, num_blocks=256, block_size=8, async_scheduling=async_scheduling)
    with LLMEngine("default", dtype="float32", **rc) as eng:
        free = [SamplingParams(max_tokens=24, temperature=0.9, seed=100 + i, ignore_eos=True)
                for i in range(8)]
        alone = eng.generate(PROMPTS, free)
        mixed = eng.generate(PROMPTS + PROMPTS, free + [_json(i) for i in range(8)])
    assert [o.token_ids for o in mixed[:8]] == [o.token_ids for o in alone]
    for o in mixed[8:]:
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_mask_bytes_are_counted_and_ids_alone_come_back(engine):
    words = -(-engine.model.config.vocab_size // 32)
    engine.runtime.history.clear()
    held = SamplingParams(max_tokens=10, structured=StructuredSpec("choice", ["alpha beta gamma", "delta"]))
    params = [held] * 4 + [SamplingParams(max_tokens=10, ignore_eos=True)] * 4
    outs = engine.generate(PROMPTS, params)
    assert all(o.finish_reason == "stop" and o.text in ("alpha beta gamma", "delta") for o in outs[:4])
    masked = [r for r in engine.runtime.history if r.dims["G"]]
    assert masked, "no launch carried a token bitmask"
    inputs = step_table().host_inputs()
    for r in masked:
        assert r.dims["G"] == r.dims["B"] and r.dims["VW"] == words
        assert r.d2h_bytes == r.dims["B"] * 4  # ids only: the mask goes in, nothing more comes out
        assert r.h2d_bytes == sum(s.nbytes(r.dims) for s in inputs)  # the mask's bytes are counted
        assert step_table()["token_bitmask"].nbytes(r.dims) == r.dims["B"] * words * 4
    # Once the constrained rows are done, the launches carry no mask.
    assert any(r.dims["G"] == 0 and r.kind == "decode" for r in engine.runtime.history)


def test_greedy_constrained_equals_greedy_where_the_grammar_agrees(engine):
    """A grammar that allows whatever the model prefers changes nothing: the mask only removes."""
    free = engine.generate(["The default is"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    allowed = re.escape(free.text)
    held = engine.generate(["The default is"], SamplingParams(
        max_tokens=12, ignore_eos=True, structured=StructuredSpec("regex", allowed + ".*")))[0]
    assert held.token_ids[: len(free.token_ids)] == free.token_ids


def test_seeded_constrained_sampling_is_deterministic(engine):
    a = engine.generate(PROMPTS[:4], [_json(7 + i) for i in range(4)])
    b = engine.generate(PROMPTS[:4][::-1], [_json(7 + i) for i in range(4)][::-1])
    assert [o.token_ids for o in a] == [o.token_ids for o in b][::-1]


def test_preempted_constrained_rows_finish_valid():
    rc = dict(max_batch=8, num_blocks=24, block_size=4)
    with LLMEngine("default", dtype="float32", **rc) as eng:
        outs = eng.generate(PROMPTS, [_json(i, max_tokens=60) for i in range(8)])
        assert sum(o.num_preemptions for o in outs) > 0
    for o in outs:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMA)
        else:
            assert o.finish_reason == "length"


def test_identical_prompts_share_their_blocks(engine):
    prompt = " ".join(["The module provides functions for working with text."] * 4)
    blocks = engine.core.scheduler.blocks
    blocks.flush()
    before = blocks.stats.hit_tokens
    outs = engine.generate([prompt] * 3,
                           [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(3)])
    full = (len(outs[0].prompt_ids) - 1) // blocks.block_size * blocks.block_size
    assert blocks.stats.hit_tokens - before == 2 * full  # the 2nd and 3rd read the 1st's blocks


def test_invalid_constraints_are_refused(engine):
    for spec in (StructuredSpec("json", {"type": "object", "properties": {"a": {"type": "nonsense"}}}),
                 StructuredSpec("regex", "(unclosed"), StructuredSpec("grammar", "start: undefined_rule")):
        with pytest.raises(StructuredError):
            engine.input.grammars.state(spec)
    with pytest.raises(StructuredError):
        StructuredSpec("choice", [])
    with pytest.raises(StructuredError):
        StructuredSpec("xml", "x")


def test_compiled_grammars_are_cached(engine):
    g: GrammarCompiler = engine.input.grammars
    spec = StructuredSpec("json", {"type": "object", "properties": {"k": {"type": "integer"}}})
    g.state(spec)
    hits = g.hits
    g.state(StructuredSpec("json", json.dumps({"type": "object", "properties": {"k": {"type": "integer"}}})))
    g.state(spec)
    assert g.hits == hits + 1  # the JSON text form is a different key; the same dict hits


def test_thinking_gate_frees_tokens_until_the_end_marker(engine):
    """With thinking "open" the constraint starts after </think> (here several tokens long)."""
    state = engine.input.grammars.state(StructuredSpec("choice", ["yes", "no"], thinking="open"))
    tok = engine.tokenizer
    words = -(-engine.model.config.vocab_size // 32)
    mask = np.zeros((1, words), dtype=np.int32)
    bits = sampler.bit_table("cpu")
    vocab = engine.model.config.vocab_size
    for t in tok.encode("hmm </think>"):
        state.fill(mask, 0)  # thinking: anything but the end of the output
        free = sampler.allowed_tokens(torch.from_numpy(mask), vocab, bits)[0]
        ends = engine.input.grammars.ends
        assert int(free.sum()) == vocab - len(ends) and not free[ends].any()
        state.accept(t)
    state.fill(mask, 0)
    allowed = sampler.allowed_tokens(torch.from_numpy(mask), vocab, bits)[0]
    # Exactly the tokens that begin "yes" or "no": both choices stay open after the thought.
    want = {t for t in range(vocab)
            if (text := tok.decode([t])) and ("yes".startswith(text) or "no".startswith(text))}
    assert set(allowed.nonzero().flatten().tolist()) == want
    assert {tok.decode([t])[0] for t in want} == {"y", "n"}


def test_allowed_tokens_unpacks_bits_in_order():
    vocab = 70
    want = torch.rand(3, vocab) < 0.5
    words = -(-vocab // 32)
    packed = np.zeros((3, words), dtype=np.uint32)
    for r, v in want.nonzero().tolist():
        packed[r, v >> 5] |= np.uint32(1 << (v & 31))
    bits = sampler.bit_table("cpu")
    got = sampler.allowed_tokens(torch.from_numpy(packed.view(np.int32)), vocab, bits)
    assert torch.equal(got, want)


def test_native_bitmask_pass_equals_the_torch_one():
    from fusedserve.kernels.aten.backend import TorchLayerOps
    from fusedserve.kernels.native import build as native
    from fusedserve.kernels.native.backend import NativeLayerOps

    vocab = 1000  # not a multiple of 32: the last word's tail is past the vocabulary
    words = -(-vocab // 32)
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=gen)
    bitmask[1] = -1  # a row without a grammar
    bitmask[2, 3:9] = 0  # whole words refused
    logits = torch.randn(5, vocab, generator=gen)
    want = logits.clone()
    TorchLayerOps(1e-6, 8, 2, 1, 4, torch.device("cpu")).apply_token_bitmask(want, bitmask)
    allowed = sampler.allowed_tokens(bitmask, vocab, sampler.bit_table("cpu"))
    assert torch.equal(torch.isinf(want), ~allowed) and torch.equal(want[allowed], logits[allowed])
    if native.kernels() is None:
        pytest.skip("no native CPU kernels here")
    got = logits.clone()
    NativeLayerOps(native.kernels(), 1e-6, 2, 1).apply_token_bitmask(got, bitmask)
    assert torch.equal(got, want)


def test_constrained_logprobs_are_the_models(engine):
    """A constrained row's logprobs are the unmasked distribution's, as vLLM reports them."""
    spec = StructuredSpec("choice", ["alpha", "beta"])
    prompt = engine.input.encode("The default is")
    held = engine.generate([prompt], SamplingParams(max_tokens=4, logprobs=True, structured=spec))[0]
    assert held.text in ("alpha", "beta")
    ids = prompt + held.token_ids
    raw = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    assert held.logprobs == pytest.approx(raw[len(prompt):], abs=1e-4)
