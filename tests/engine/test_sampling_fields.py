"""Every sampling field does what it says: penalties against transformers' processor and OpenAI's
formula on the same logits, and through the engine against transformers' greedy generation with the
same processing; logit_bias, allowed_token_ids, bad_words, min_tokens and include_stop_str_in_output
change the output as they say."""

from __future__ import annotations

import pytest
import torch

from fusedserve.coordinator.cli import DEMO_PROMPTS
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import TRAINED_DIR
from fusedserve.coordinator.sampling_params import SamplingError, SamplingParams
from fusedserve.kernels.penalties import PenaltyState, apply_logit_bias

V = 50


def _openai(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's formula: mu[j] -= c[j] * frequency + (c[j] > 0) * presence, over output tokens."""
    c = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.shape[-1]).float()
    return logits - c * frequency - (c > 0).float() * presence


def test_penalties_equal_transformers_and_the_openai_formula_on_the_same_logits():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    prompts = [[1, 2, 3, 2], [7, 7, 8], [4]]
    outputs = [[3, 5, 5, 9], [], [4, 4, 4, 11, 12]]
    params = torch.tensor([[0.0, 0.0, 1.3], [0.5, 0.0, 1.0], [0.4, 0.7, 0.8]])  # presence, frequency, rep
    state = PenaltyState(4, V, torch.device("cpu"))
    slots = torch.tensor([2, 0, 3])
    state.reset(slots)
    tokens, codes = [], []
    for slot, prompt, out in zip(slots.tolist(), prompts, outputs):
        tokens += prompt + out[:-1] if out else prompt
        codes += [slot * 2] * len(prompt) + [slot * 2 + 1] * max(0, len(out) - 1)
    state.count(torch.tensor(tokens), torch.tensor(codes))
    last = [(s, o[-1]) for s, o in zip(slots.tolist(), outputs) if o]  # the newest output, as sampled
    state.count_sampled(torch.tensor([s for s, _ in last]), torch.tensor([t for _, t in last]))
    got = logits.clone()
    state.apply(got, torch.tensor([0, 1, 2]), slots, params)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        presence, frequency, rep = params[i].tolist()
        seen = torch.tensor([prompt + out])
        want = RepetitionPenaltyLogitsProcessor(rep)(seen, logits[i : i + 1].clone())[0]
        want = _openai(want, out, presence, frequency)
        assert torch.allclose(got[i], want, atol=1e-6), i


def test_logit_bias_adds_to_its_tokens_only():
    logits = torch.zeros(2, V)
    apply_logit_bias(logits, torch.tensor([0, 1, 1]), torch.tensor([5, 5, 9]),
                     torch.tensor([2.0, -3.0, 100.0]))
    want = torch.zeros(2, V)
    want[0, 5], want[1, 5], want[1, 9] = 2.0, -3.0, 100.0
    assert torch.equal(logits, want)


@pytest.fixture(scope="module")
def engine():
    with LLMEngine("default", dtype="float32", max_batch=4, num_blocks=256, block_size=8) as eng:
        yield eng


def _hf_greedy(ids: list[int], n: int, processors: list) -> list[int]:
    from transformers import LogitsProcessorList, Qwen3ForCausalLM

    hf = _hf_greedy.model = getattr(_hf_greedy, "model", None) or Qwen3ForCausalLM.from_pretrained(
        TRAINED_DIR, torch_dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0, logits_processor=LogitsProcessorList(processors))
    return out[0, len(ids):].tolist()


class _OpenAIPenalties:
    """OpenAI's presence/frequency penalties over the generated tokens, as a transformers processor."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return _openai(scores, input_ids[0, self.prompt_len :].tolist(), self.presence, self.frequency)


@pytest.mark.parametrize("presence,frequency,repetition",
                         [(0, 0, 1.4), (1.5, 0, 1), (0, 1.2, 1), (0.8, 0.6, 1.2)])
def test_penalized_greedy_output_equals_transformers_with_the_same_processing(engine, presence, frequency,
                                                                                repetition):
    from transformers import RepetitionPenaltyLogitsProcessor

    prompts = DEMO_PROMPTS[:3]
    params = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency, repetition_penalty=repetition)
    plain = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    got = engine.generate(prompts, params)  # batched, with a plain row and a penalized one per launch
    changed = 0
    for prompt, out, base in zip(prompts, got, plain):
        ids = engine.input.encode(prompt)
        processors = [RepetitionPenaltyLogitsProcessor(repetition)] if repetition != 1 else []
        processors.append(_OpenAIPenalties(len(ids), presence, frequency))
        assert out.token_ids == _hf_greedy(ids, 24, processors), prompt
        changed += out.token_ids != base.token_ids
    assert changed, "the penalty changed some output"


def test_logit_bias_allowed_tokens_bad_words_min_tokens_and_stop_inclusion(engine):
    prompt = "The with statement"
    plain = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    first, third = plain.token_ids[0], plain.token_ids[2]
    forced = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={42: 100}))[0]
    assert forced.token_ids == [42] * 6
    banned = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True,
                                                      logit_bias={str(first): -100}))[0]
    assert banned.token_ids[0] != first
    allowed = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True,
                                                       allowed_token_ids=[first, third, 42]))[0]
    assert set(allowed.token_ids) <= {first, third, 42} and allowed.token_ids[0] == first
    early = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[third]))[0]
    assert early.token_ids == plain.token_ids[:3] and early.finish_reason == "stop"
    held = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[third], min_tokens=6))[0]
    assert len(held.token_ids) >= 6 and third not in held.token_ids[:6]
    word = engine.tokenizer.decode([third]).strip()
    assert word, "the third token is a word"
    no_word = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, bad_words=[word]))[0]
    assert word not in no_word.text and no_word.token_ids[:2] == plain.token_ids[:2]
    stop = plain.text[len(engine.tokenizer.decode(plain.token_ids[:4])):][:3]
    cut = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    kept = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True))[0]
    assert kept.text == cut.text + stop and plain.text.startswith(kept.text)


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                 dict(repetition_penalty=0), dict(logit_bias={1: 101}),
                                 dict(logit_bias={i: 1 for i in range(301)}), dict(logit_bias={"x": 1}),
                                 dict(bad_words=[" "]), dict(allowed_token_ids=[]),
                                 dict(min_tokens=20, max_tokens=10)])
def test_out_of_range_settings_are_refused(bad):
    with pytest.raises(SamplingError):
        SamplingParams(**bad)


def test_token_ids_outside_the_vocabulary_are_refused(engine):
    from fusedserve.coordinator.errors import RequestError

    for bad in (dict(logit_bias={10**6: 1.0}), dict(allowed_token_ids=[5, 10**6])):
        with pytest.raises(RequestError) as err:
            engine.generate(["x"], SamplingParams(**bad))
        assert err.value.code == "token_out_of_range"
