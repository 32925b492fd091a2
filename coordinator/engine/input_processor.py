"""A request in, a ``Sequence`` out: written once for the server and the offline engine.

Tokenizes text (or takes ids), checks what a worker can serve (``RequestLimits``), attaches
the detokenizer that builds the output text and the grammar that constrains it. Everything
here runs before a request enters any queue, so a refusal costs nothing and names the limit
(a ``RequestError`` with its protocol code).
"""

from __future__ import annotations

import dataclasses

from fusedserve.coordinator.engine.detokenizer import Detokenizer
from fusedserve.coordinator.engine.request_limits import RequestLimits
from fusedserve.coordinator.engine.sequence import Sequence
from fusedserve.coordinator.engine.token_rules import TokenRules
from fusedserve.coordinator.errors import RequestError
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.structured.grammar_compiler import GrammarCompiler, GrammarLimits
from fusedserve.coordinator.structured.structured_spec import StructuredError
from fusedserve.kernels.model_description.config import Qwen3Config


class InputProcessor:
    def __init__(self, tokenizer: TextTokenizer | None, limits: RequestLimits,
                 grammars: GrammarCompiler | None, eos_token_ids: tuple[int, ...] = (),
                 pooling: bool = False):
        """``pooling``: a pooling runner's, whose requests pool their prompt instead of sampling."""
        self.pooling = pooling
        self.tokenizer = tokenizer
        self.limits = limits
        self.grammars = grammars
        self.eos = eos_token_ids

    @classmethod
    def for_model(cls, config: Qwen3Config, tokenizer: TextTokenizer | None, limits: RequestLimits,
                  grammar_limits: GrammarLimits | None = None, pooling: bool = False) -> InputProcessor:
        return cls(tokenizer, limits, GrammarCompiler.for_model(tokenizer, config, grammar_limits),
                   config.eos_token_ids, pooling)

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (ids are taken as given; ``RequestLimits`` checks them)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise RequestError("no_tokenizer", "this model has no tokenizer.json: give prompts as token ids")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no text a tokenizer can take
            raise RequestError("bad_prompt", f"prompt is not valid Unicode text: {exc.reason} at "
                               f"character {exc.start}") from None
        return self.tokenizer.encode(prompt, special=self.pooling)

    def _rules(self, p: SamplingParams) -> TokenRules | None:
        """The request's allowed_token_ids, bad_words (tokenized as vLLM does: the word alone and
        after a space) and min_tokens, as mask rules."""
        bad = []
        if p.bad_words:
            if self.tokenizer is None:
                raise RequestError("no_tokenizer", "bad_words need the model's tokenizer")
            for word in p.bad_words:
                for text in (word.lstrip(), " " + word.lstrip()):
                    ids = self.tokenizer.encode(text)
                    if ids and ids not in bad:
                        bad.append(ids)
        ends = [*p.stop_token_ids, *([] if p.ignore_eos else self.eos)]
        return TokenRules.build(p.allowed_token_ids, p.min_tokens, ends, bad, self.limits.vocab_size)

    def process(self, seq_id: str, arrival: int, prompt: str | list[int], params: SamplingParams,
                compile_grammar: bool = True) -> Sequence:
        """The request as a sequence, or RequestError naming what it exceeds. ``compile_grammar``
        False: its constraint is compiled elsewhere (the server's ``CompileQueue``) and attached
        before it is queued."""
        ids = self.encode(prompt)
        if self.pooling:  # the prompt's pooled row is the result: no token is sampled for it
            if params.structured is not None or params.logprobs or params.prompt_logprobs is not None:
                raise RequestError("bad_param", "a pooling model samples nothing: structured outputs and "
                                   "logprobs do not apply")
            params = dataclasses.replace(params, max_tokens=1, min_tokens=0)
            self.limits.check(ids, params)
            return Sequence(seq_id, ids, params, arrival=arrival, pooling=True)
        self.limits.check(ids, params)
        detok = (Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
                 if self.tokenizer is not None else None)
        seq = Sequence(seq_id, ids, params, arrival=arrival, detok=detok, rules=self._rules(params))
        if params.structured is not None:
            if self.grammars is None:
                raise RequestError("no_tokenizer", "structured outputs need the model's tokenizer")
            if not compile_grammar:
                return seq
            try:
                seq.grammar = self.grammars.state(params.structured)
            except StructuredError as exc:
                raise RequestError("bad_structured_output", str(exc)) from None
        return seq
