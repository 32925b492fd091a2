"""Sampling parameters: what a request asks of the sampler, checked once, here.

Every front end (ZeroMQ, HTTP, the offline engine) builds a ``SamplingParams``, so they all
refuse the same values. Sampling itself runs on the device (``kernels/sampler.py``).
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field

from coordinator.structured.structured_spec import StructuredSpec
from shared_memory.slots import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS


class SamplingError(ValueError):
    """Sampling parameters are out of range."""


MAX_TEMPERATURE = 100.0
# Stop strings a request may carry, and their length: matching costs O(new characters) per token
# whatever their number (coordinator/engine/stop_strings.py), but the automaton is built per set.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
MAX_BAD_WORDS = 64


def _check_float(name: str, value: object, lo: float, hi: float, lo_open: bool) -> None:
    """A finite, normal (not subnormal) number in [lo, hi] (or (lo, hi] when ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise SamplingError(f"{name} must be finite, got {value!r}")
    if v != 0.0 and abs(v) < sys.float_info.min:
        raise SamplingError(f"{name} is subnormal ({value!r}); use 0 or a normal number")
    if v < lo or v > hi or (lo_open and v == lo):
        bounds = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise SamplingError(f"{name} must be in {bounds}, got {value!r}")


def _check_stops(stop: object) -> None:
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise SamplingError(f"stop must be a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise SamplingError(f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise SamplingError(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are allowed")


def _check_logit_bias(bias: object) -> dict[int, float]:
    """OpenAI's shape: token ids (JSON gives them as strings) to values in [-100, 100]."""
    if not isinstance(bias, dict):
        raise SamplingError(f"logit_bias must be a map of token ids to numbers, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise SamplingError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        except ValueError:
            token = key
        if isinstance(token, bool) or not isinstance(token, int):
            raise SamplingError(f"logit_bias keys must be token ids, got {key!r}")
        _check_float(f"logit_bias[{token}]", value, -100.0, 100.0, lo_open=False)
        out[token] = float(value)
    return out


def _check_bad_words(words: object) -> None:
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise SamplingError("bad_words must be a list of non-blank strings")
    if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_STOP_CHARS for w in words):
        raise SamplingError(f"bad_words may hold at most {MAX_BAD_WORDS} words of {MAX_STOP_CHARS} "
                            "characters")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # full-vocabulary logprob of each sampled token
    top_logprobs: int = 0  # and the n most likely tokens' logprobs at each step (implies logprobs)
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    # Each prompt token's logprob given the ones before it, and the n most likely tokens'
    # there (None: not asked). A request asking for them computes its whole prompt: no cache.
    prompt_logprobs: int | None = None
    # Structured outputs: the output is held to this constraint by a token mask on the device.
    structured: StructuredSpec | None = None
    # OpenAI's penalties over the output tokens: logit -= frequency x count + presence x (count > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # CTRL's (transformers'): a token seen in the prompt or the output has its logit divided by this
    # if positive, multiplied if negative.
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    bad_words: list[str] = field(default_factory=list)  # never generated (vLLM's: as whole words)
    allowed_token_ids: list[int] | None = None  # only these may be generated
    min_tokens: int = 0  # EOS and the stop ids are refused before this many tokens
    include_stop_str_in_output: bool = False  # the text ends after the stop string, not before it

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise SamplingError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE, lo_open=False)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0, lo_open=False)
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) \
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                f"got {self.top_logprobs!r}")
        if self.top_logprobs:
            self.logprobs = True
        if self.prompt_logprobs is not None and (
                isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
                or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise SamplingError(f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                f"got {self.prompt_logprobs!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 1 << 64):
            raise SamplingError(f"seed must be an integer in [0, 2^64), got {self.seed!r}")
        if self.seed is None:
            self.seed = random.getrandbits(63)
        _check_stops(self.stop)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0, lo_open=False)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0, lo_open=False)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        _check_bad_words(self.bad_words)
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in self.allowed_token_ids)):
            raise SamplingError("allowed_token_ids must be a non-empty list of token ids")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(f"min_tokens must be an integer in [0, max_tokens], got "
                                f"{self.min_tokens!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise SamplingError(f"structured must be a StructuredSpec, got {self.structured!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """A penalty needs per-sequence token counts kept on the device."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def speculable(self) -> bool:
        """Its decode rows may carry proposals: a penalty would need each proposal counted before
        the next row's logits are penalized, which one launch does not do."""
        return not self.penalized

    @property
    def full_prefill(self) -> bool:
        """Every prompt token must pass through the device (no cached prefix): its logprobs are
        asked, or its tokens count for a penalty."""
        return self.prompt_logprobs is not None or self.penalized

    def token_ids(self) -> list[int]:
        """The token ids the request names (checked against the vocabulary at admission)."""
        return [*self.stop_token_ids, *self.logit_bias, *(self.allowed_token_ids or [])]
