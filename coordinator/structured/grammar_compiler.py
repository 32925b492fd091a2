"""Requests' constraints -> llguidance matchers, compiled once per constraint and cached.

llguidance was chosen over xgrammar by measurement (``benchmarks/grammar_libs.py``): at a
152k-token vocabulary it builds a constraint in under a millisecond where xgrammar takes
20-36 ms (compiling runs on the coordinator's loop thread, a stall for every stream), its
mask per token is faster on natural JSON (xgrammar's is faster on short bounded strings and
on small vocabularies), and it depends on nothing (xgrammar pulls transformers and triton).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from coordinator.model_files.tokenizer import TextTokenizer
from coordinator.structured.grammar_state import GrammarState
from coordinator.structured.structured_spec import StructuredError, StructuredSpec
from kernels.model.config import Qwen3Config

log = logging.getLogger(__name__)

THINK_START, THINK_END = "<think>", "</think>"
# JSON as ``json.dumps`` writes it: no free whitespace, whose runs a sampled row could extend
# until max_tokens (a schema's own "x-guidance" options override this).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar of a constraint (raises StructuredError for a malformed one)."""
    M = llguidance.LLMatcher
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
                 cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        eos = sorted({t for t in eos_token_ids if 0 <= t < vocab_size})
        self.ends = np.asarray(eos, dtype=np.int64)
        self.lltok = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos or None)
        self.executor = llguidance.LLExecutor()
        self.cache_size = cache_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.hits = self.misses = 0
        # Qwen3's thinking markers, where they are single tokens (else thinking is not gated).
        start, end = tokenizer.token_id(THINK_START), tokenizer.token_id(THINK_END)
        self.think_start = start if start is not None and start < vocab_size else None
        self.think_end = THINK_END.encode()
        self.has_end_token = end is not None

    @classmethod
    def for_model(cls, tokenizer: TextTokenizer | None, config: Qwen3Config) -> GrammarCompiler | None:
        """The compiler of a served model (None without a tokenizer). A grammar may end the output
        at the model's EOS ids and at the chat and text end tokens."""
        if tokenizer is None:
            return None
        ends = [tokenizer.token_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
        return cls(tokenizer, config.vocab_size, [*config.eos_token_ids, *(t for t in ends if t is not None)])

    def matcher(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        key = spec.key()
        proto = self._cache.get(key)
        if proto is None:
            self.misses += 1
            grammar = grammar_text(spec)
            err = llguidance.LLMatcher.validate_grammar(grammar, self.lltok)
            if err:
                raise StructuredError(f"invalid {spec.kind} constraint: {err}")
            proto = llguidance.LLMatcher(self.lltok, grammar)
            if proto.is_error():
                raise StructuredError(f"invalid {spec.kind} constraint: {proto.get_error()}")
            self._cache[key] = proto
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self.hits += 1
            self._cache.move_to_end(key)
        return proto.deep_copy()

    def state(self, spec: StructuredSpec) -> GrammarState:
        """A fresh per-request state (raises StructuredError for a constraint that cannot compile)."""
        thinking = spec.thinking
        if thinking == "may" and self.think_start is None:
            thinking = "none"  # the model has no <think> token: nothing to wait for
        think_open = np.asarray([] if self.think_start is None else [self.think_start], dtype=np.int64)
        return GrammarState(self.matcher(spec), thinking, think_open, self.think_end,
                            self.tokenizer.token_bytes, self.ends, self.executor)
