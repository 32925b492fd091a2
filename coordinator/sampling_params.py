"""Sampling parameters: every field a request may carry, declared once, here.

Each field of ``SamplingParams`` carries a ``FieldSpec``: its type, its range and which front
ends take it (``ZMQ``: the wire protocol's ``generate`` frame; ``OPENAI``: passed as it is from
an OpenAI body, where ``MAPPED`` fields are instead translated by ``coordinator/openai/protocol.py``
from OpenAI's own names and defaults; ``GENERATION_CONFIG``: a model's ``generation_config.json``
may set its API default). The ZeroMQ type table, the OpenAI passthrough and the defaults read
from generation_config.json are built from these specs (``front_end_fields``), and every check
runs from them, so every front end
(ZeroMQ, HTTP, the offline engine) refuses the same values with the same words. Sampling itself
runs on the device (``kernels/sampler.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any

from fusedserve.coordinator.structured.structured_spec import StructuredSpec
from fusedserve.shared_memory.slots import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS


class SamplingError(ValueError):
    """Sampling parameters are out of range."""


MAX_TEMPERATURE = 100.0
# Stop strings a request may carry, and their length: matching costs O(new characters) per token
# whatever their number (coordinator/engine/stop_strings.py), but the automaton is built per set.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
MAX_BAD_WORDS = 64

ZMQ, OPENAI, MAPPED = "zmq", "openai", "mapped"  # front ends (see the module's docstring)
GENERATION_CONFIG = "generation_config"  # a model's generation_config.json may set its API default


def is_kind(value: object, kind: type) -> bool:
    """Whether ``value`` is of the JSON/msgpack ``kind``: a bool is no number, an int is a float."""
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


@dataclass(frozen=True)
class FieldSpec:
    """One request field: its kind (and a list's item kind), its range, and its front ends."""

    kind: type  # bool, int, float, list or dict
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # (lo, hi] rather than [lo, hi]
    hi_open: bool = False  # [lo, hi) rather than [lo, hi]
    items: type | None = None  # a list's item kind
    nullable: bool = False  # None is a value of its own (not "unset")
    front_ends: tuple[str, ...] = (ZMQ, OPENAI)

    def wrong_kind(self, value: object) -> str | None:
        """What is wrong with the value's type (the item's, in a list), or None: a front end refuses
        it as a malformed field before anything checks its range."""
        items_ok = self.items is None or is_kind(value, list) and all(is_kind(v, self.items) for v in value)
        if not items_ok:
            return f"must be a list of {_WORDS[self.items][1]}, got {_shown(value)}"
        if not is_kind(value, self.kind):
            return f"must be {_WORDS.get(self.kind, ('a ' + self.kind.__name__,))[0]}, got {_shown(value)}"
        return None

    def check(self, name: str, value: object) -> None:
        """SamplingError unless ``value`` is of this kind and in this range."""
        if value is None and self.nullable:
            return
        wrong = self.wrong_kind(value)
        if wrong is not None:
            raise SamplingError(f"{name} {wrong}")
        if self.kind is float:
            _check_float(name, value, self)
        elif self.kind is int and not self._in_range(value):
            raise SamplingError(f"{name} must be an integer {self._range_words()}, got {value!r}")

    def _in_range(self, v: float) -> bool:
        lo_ok = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        hi_ok = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return lo_ok and hi_ok

    def _range_words(self) -> str:
        if self.hi is None:
            return f">= {self.lo:g}"
        hi = "2^64" if self.hi == 1 << 64 else f"{self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {hi}{')' if self.hi_open else ']'}"


# A kind in words, alone and as a list's items.
_WORDS = {bool: ("a boolean", "booleans"), int: ("an integer", "integers"), float: ("a number", "numbers"),
          str: ("a string", "strings"), list: ("a list", "lists"), dict: ("a map", "maps")}


def _shown(value: object) -> str:
    """A refused value as an error names it: short values as they are, others by their type."""
    text = repr(value)
    return text if len(text) <= 40 else type(value).__name__


def _check_float(name: str, value: float, spec: FieldSpec) -> None:
    """A finite, normal (not subnormal) number in the spec's range."""
    v = float(value)
    if not math.isfinite(v):
        raise SamplingError(f"{name} must be finite, got {value!r}")
    if v != 0.0 and abs(v) < sys.float_info.min:
        raise SamplingError(f"{name} is subnormal ({value!r}); use 0 or a normal number")
    if not spec._in_range(v):
        raise SamplingError(f"{name} must be {spec._range_words()}, got {value!r}")


def spec(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A ``SamplingParams`` field with its ``FieldSpec`` (``kw``) as metadata."""
    return field(default=default, default_factory=factory, metadata={"spec": FieldSpec(**kw)})


def _check_stops(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise SamplingError(f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise SamplingError(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are allowed")


def check_stops(stop: list[str]) -> None:
    """The stop strings' limits, for a front end that reads them in a shape of its own (OpenAI's
    string-or-list) and names the field in its error."""
    _check_stops(stop)


_BIAS = FieldSpec(float, -100.0, 100.0)


def _check_logit_bias(bias: dict) -> dict[int, float]:
    """OpenAI's shape: token ids (JSON gives them as strings) to values in [-100, 100]."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise SamplingError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        if not is_kind(token, int):
            raise SamplingError(f"logit_bias keys must be token ids, got {key!r}")
        _BIAS.check(f"logit_bias[{token}]", value)
        out[token] = float(value)
    return out


def _check_bad_words(words: list[str]) -> None:
    if not all(w.strip() for w in words):
        raise SamplingError("bad_words must be a list of non-blank strings")
    if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_STOP_CHARS for w in words):
        raise SamplingError(f"bad_words may hold at most {MAX_BAD_WORDS} words of {MAX_STOP_CHARS} "
                            "characters")


_MAPPED = (ZMQ, MAPPED)  # OpenAI names it the same but with defaults of its own
_DEFAULTED = (ZMQ, MAPPED, GENERATION_CONFIG)  # ... and generation_config.json may set that default
_PASSED_DEFAULTED = (ZMQ, OPENAI, GENERATION_CONFIG)


@dataclass
class SamplingParams:
    max_tokens: int = spec(16, kind=int, lo=1, front_ends=_DEFAULTED)
    temperature: float = spec(0.0, kind=float, lo=0.0, hi=MAX_TEMPERATURE, front_ends=_DEFAULTED)
    top_k: int = spec(0, kind=int, lo=0, front_ends=_DEFAULTED)  # 0 = whole vocabulary
    top_p: float = spec(1.0, kind=float, lo=0.0, hi=1.0, lo_open=True, front_ends=_DEFAULTED)
    seed: int | None = spec(None, kind=int, lo=0, hi=1 << 64, hi_open=True, nullable=True,
                            front_ends=_MAPPED)
    stop_token_ids: list[int] = spec(factory=list, kind=list, items=int)
    stop: list[str] = spec(factory=list, kind=list, items=str, front_ends=_MAPPED)
    ignore_eos: bool = spec(False, kind=bool, front_ends=_MAPPED)
    # Full-vocabulary logprob of each sampled token; and the n most likely tokens' logprobs at each
    # step (implies logprobs). OpenAI spells them per endpoint (``logprobs`` is a count in completions).
    logprobs: bool = spec(False, kind=bool, front_ends=_MAPPED)
    top_logprobs: int = spec(0, kind=int, lo=0, hi=MAX_TOP_LOGPROBS, front_ends=_MAPPED)
    # Drop tokens less likely than min_p x the most likely one.
    min_p: float = spec(0.0, kind=float, lo=0.0, hi=1.0, front_ends=_DEFAULTED)
    # Each prompt token's logprob given the ones before it, and the n most likely tokens'
    # there (None: not asked). A request asking for them computes its whole prompt: no cache.
    prompt_logprobs: int | None = spec(None, kind=int, lo=0, hi=MAX_TOP_LOGPROBS, nullable=True,
                                       front_ends=_MAPPED)
    # Structured outputs: the output is held to this constraint by a token mask on the device. Its
    # wire forms are its own (``StructuredSpec.from_wire``; OpenAI's response_format and tools).
    structured: StructuredSpec | None = spec(None, kind=StructuredSpec, nullable=True, front_ends=())
    # OpenAI's penalties over the output tokens: logit -= frequency x count + presence x (count > 0).
    presence_penalty: float = spec(0.0, kind=float, lo=-2.0, hi=2.0, front_ends=_PASSED_DEFAULTED)
    frequency_penalty: float = spec(0.0, kind=float, lo=-2.0, hi=2.0, front_ends=_PASSED_DEFAULTED)
    # CTRL's (transformers'): a token seen in the prompt or the output has its logit divided by this
    # if positive, multiplied if negative.
    repetition_penalty: float = spec(1.0, kind=float, lo=0.0, hi=10.0, lo_open=True,
                                     front_ends=_PASSED_DEFAULTED)
    logit_bias: dict[int, float] = spec(factory=dict, kind=dict)  # token id -> added to its logit
    bad_words: list[str] = spec(factory=list, kind=list, items=str)  # never generated (vLLM's: whole words)
    allowed_token_ids: list[int] | None = spec(None, kind=list, items=int, nullable=True)  # only these
    min_tokens: int = spec(0, kind=int, lo=0)  # EOS and the stop ids are refused before this many tokens
    # The text ends after the stop string, not before it.
    include_stop_str_in_output: bool = spec(False, kind=bool)

    def __post_init__(self) -> None:
        for name, s in self.specs().items():
            s.check(name, getattr(self, name))
        if self.top_logprobs:
            self.logprobs = True
        if self.seed is None:
            self.seed = random.getrandbits(63)
        _check_stops(self.stop)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        _check_bad_words(self.bad_words)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise SamplingError("allowed_token_ids must be a non-empty list of token ids")
        if self.min_tokens > self.max_tokens:
            raise SamplingError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")

    @classmethod
    @functools.cache
    def specs(cls) -> dict[str, FieldSpec]:
        """Every field's spec, in declaration order (built once: every request's check reads it)."""
        return {f.name: f.metadata["spec"] for f in dataclasses.fields(cls)}

    @classmethod
    def front_end_fields(cls, front_end: str) -> dict[str, FieldSpec]:
        """The fields ``front_end`` (ZMQ, OPENAI: passed as they are; MAPPED: translated) takes."""
        return {name: s for name, s in cls.specs().items() if front_end in s.front_ends}

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
