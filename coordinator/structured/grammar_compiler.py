"""Requests' constraints -> llguidance matchers, compiled once per constraint and cached.

Every grammar compiles and runs inside explicit parser limits (``GrammarLimits``, the server's
``--grammar-*`` flags): a grammar that exceeds them is refused at admission where llguidance can
tell, by the compile or by a probe that consumes a few of the first allowed tokens on copies of
the matcher; one that exceeds them only later ends its request alone with ``grammar_error``.
The server compiles on threads with a timeout (``compile_queue.py``), never on its loop.

llguidance was chosen over xgrammar by measurement (``benchmarks/grammar_libs.py``): at a
152k-token vocabulary it builds a constraint in under a millisecond where xgrammar takes
20-36 ms, its mask per token is faster on natural JSON (xgrammar's is faster on short bounded
strings and on small vocabularies), and it depends on nothing (xgrammar pulls transformers and
triton).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.structured.grammar_state import GrammarState
from fusedserve.coordinator.structured.structured_spec import StructuredError, StructuredSpec
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.shared_memory.setting import setting

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger(__name__)

THINK_START, THINK_END = "<think>", "</think>"
# JSON as ``json.dumps`` writes it: no free whitespace, whose runs a sampled row could extend
# until max_tokens (a schema's own "x-guidance" options override this).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


PROBE_TOKENS = 4  # first tokens tried, each on its own copy of a new matcher, before admission


def _llguidance() -> ModuleType:
    """llguidance, imported with the first grammar: an engine that never sees one (a GPU image
    without the wheel, say) runs without it; a request for one there is refused."""
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - the masks
    except ImportError:
        raise StructuredError("structured outputs need the llguidance package, which this server "
                              "does not have") from None
    return llguidance


@dataclass(frozen=True)
class GrammarLimits:
    """llguidance's parser limits (``LLParserLimits``; its defaults), and how long a compile may take."""

    max_items_in_row: int = setting(2000, "alternatives one grammar production may have")
    initial_lexer_fuel: int = setting(
        1_000_000, "work allowed building a grammar's lexer (about 50k a millisecond)")
    step_lexer_fuel: int = setting(
        200_000, "lexer work allowed for one token's mask (about 14k a millisecond)")
    step_max_items: int = setting(
        50_000, "Earley items allowed for one token's mask (about 20k a millisecond)")
    max_lexer_states: int = setting(250_000, "lexer states a grammar may build (1-2 kB each)")
    max_grammar_size: int = setting(500_000, "symbols a grammar's productions may hold")
    compile_timeout_s: float = setting(
        10.0,
        "seconds a grammar may take to compile (off the loop) before its request is refused "
        "(grammar_timeout)")

    def parser_limits(self) -> llguidance.LLParserLimits:
        kw = {k: v for k, v in asdict(self).items() if k != "compile_timeout_s"}
        return _llguidance().LLParserLimits(**kw, verbose_errors=False)


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar of a constraint (raises StructuredError for a malformed one)."""
    llg = _llguidance()
    from llguidance.gbnf_to_lark import any_to_lark

    M = llg.LLMatcher
    try:
        if spec.kind == "json":
            schema = json.loads(spec.value) if isinstance(spec.value, str) else spec.value
            return M.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if spec.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if spec.kind == "regex":
            return M.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            return "start: " + " | ".join(json.dumps(c) for c in spec.value)
        # grammar: Lark (llguidance's), or GBNF/EBNF as llama.cpp and xgrammar write it
        return M.grammar_from_lark(any_to_lark(spec.value))
    except (ValueError, TypeError, RuntimeError) as exc:
        raise StructuredError(f"invalid {spec.kind} constraint: {exc}") from None


class GrammarCompiler:
    """One per tokenizer: the llguidance tokenizer (built once), and a pristine matcher per
    constraint (an LRU of ``cache_size``), copied for each request."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = 256, limits: GrammarLimits | None = None):
        self.tokenizer = tokenizer
        self.limits = limits or GrammarLimits()
        self._lock = threading.Lock()  # the cache: compiles run on several threads
        self.vocab_size = vocab_size
        eos = sorted({t for t in eos_token_ids if 0 <= t < vocab_size})
        self.ends = np.asarray(eos, dtype=np.int64)
        self._backend: tuple | None = None  # llguidance's tokenizer, executor and limits, on first use
        self.cache_size = cache_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.hits = self.misses = 0
        # Qwen3's thinking markers, where they are single tokens (else thinking is not gated).
        start, end = tokenizer.token_id(THINK_START), tokenizer.token_id(THINK_END)
        self.think_start = start if start is not None and start < vocab_size else None
        self.think_end = THINK_END.encode()
        self.has_end_token = end is not None

    @property
    def cached(self) -> int:
        """Compiled constraints held (the soak watches that it stays bounded)."""
        return len(self._cache)

    def _llg(self) -> tuple[llguidance.LLTokenizer, llguidance.LLExecutor, llguidance.LLParserLimits]:
        """llguidance's tokenizer (built once: ~0.1-1 s at a 152k vocabulary), its executor and
        the parser limits, made with the first grammar."""
        with self._lock:
            if self._backend is None:
                llg = _llguidance()
                eos = [int(t) for t in self.ends]
                self._backend = (llg.LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab_size,
                                                 eos_token=eos or None),
                                 llg.LLExecutor(), self.limits.parser_limits())
            return self._backend

    @property
    def lltok(self) -> llguidance.LLTokenizer:
        return self._llg()[0]

    @property
    def executor(self) -> llguidance.LLExecutor:
        return self._llg()[1]

    @classmethod
    def for_model(cls, tokenizer: TextTokenizer | None, config: Qwen3Config,
                  limits: GrammarLimits | None = None) -> GrammarCompiler | None:
        """The compiler of a served model (None without a tokenizer). A grammar may end the output
        at the model's EOS ids and at the chat and text end tokens."""
        if tokenizer is None:
            return None
        ends = [tokenizer.token_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
        return cls(tokenizer, config.vocab_size, [*config.eos_token_ids, *(t for t in ends if t is not None)],
                   limits=limits)

    def matcher(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        key = spec.key()
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self.hits += 1
                self._cache.move_to_end(key)
                return proto.deep_copy()
        self.misses += 1
        proto = self._compile(spec)
        with self._lock:
            self._cache[key] = proto
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return proto.deep_copy()

    def _compile(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        """A new matcher within the limits, probed: StructuredError if it cannot compile or the
        first tokens already exceed a limit."""
        grammar = grammar_text(spec)
        lltok, _, limits = self._llg()
        llg = _llguidance()
        err = llg.LLMatcher.validate_grammar(grammar, lltok, limits=limits)
        if err:
            raise StructuredError(f"invalid {spec.kind} constraint: {err}")
        proto = llg.LLMatcher(lltok, grammar, limits=limits)
        if proto.is_error():
            raise StructuredError(f"invalid {spec.kind} constraint: {proto.get_error()}")
        self._probe(proto, spec)
        return proto

    def _probe(self, proto: llguidance.LLMatcher, spec: StructuredSpec) -> None:
        """Take the first steps as generation will (mask, then consume, then mask), for a few of the
        first allowed tokens, each on its own copy: a grammar whose first steps already exceed the
        parser's limits is refused now, not after its request was admitted."""
        import llguidance.numpy as llnp

        mask = np.zeros((1, -(-self.vocab_size // 32)), dtype=np.int32)
        first = proto.deep_copy()
        llnp.fill_next_token_bitmask(first, mask, 0)
        self._check(first, spec)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab_size]
        allowed = np.flatnonzero(bits)
        for t in allowed[np.linspace(0, len(allowed) - 1, min(PROBE_TOKENS, len(allowed))).astype(int)]:
            copy = proto.deep_copy()
            llnp.fill_next_token_bitmask(copy, mask, 0)
            copy.consume_token(int(t))
            self._check(copy, spec)
            llnp.fill_next_token_bitmask(copy, mask, 0)
            self._check(copy, spec)

    @staticmethod
    def _check(matcher: llguidance.LLMatcher, spec: StructuredSpec) -> None:
        if matcher.is_error():
            why = matcher.get_error().splitlines()[0]
            raise StructuredError(f"the {spec.kind} constraint exceeds the parser's limits: {why}")

    def state(self, spec: StructuredSpec) -> GrammarState:
        """A fresh per-request state (raises StructuredError for a constraint that cannot compile)."""
        thinking = spec.thinking
        if thinking == "may" and self.think_start is None:
            thinking = "none"  # the model has no <think> token: nothing to wait for
        think_open = np.asarray([] if self.think_start is None else [self.think_start], dtype=np.int64)
        return GrammarState(self.matcher(spec), thinking, think_open, self.think_end,
                            self.tokenizer.token_bytes, self.ends, self.executor)
