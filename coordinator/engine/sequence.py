"""A request as the scheduler sees it, and what one step did to it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fusedserve.coordinator.engine.block_manager import prefix_hashes
from fusedserve.coordinator.engine.detokenizer import Detokenizer
from fusedserve.coordinator.engine.lora_registry import ServedAdapter
from fusedserve.coordinator.engine.speculative.speculation_policy import SpecState
from fusedserve.coordinator.engine.token_rules import TokenRules
from fusedserve.coordinator.errors import RequestError
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.structured.grammar_state import GrammarState


@dataclass(eq=False)
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Asked with ``params.prompt_logprobs``: each prompt token's logprob given the ones before it
    # (None for the first), and the most likely tokens' there.
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    arrival: int = 0
    num_preemptions: int = 0
    detok: Detokenizer | None = None  # None: the model has no tokenizer, ids only
    # Leading tokens whose K/V this worker's launches compute, counted when a launch is
    # scheduled (it runs before any later launch reads them).
    num_computed: int = 0
    # Tokens sampled by launches still in flight, not read yet (0 or 1): with async
    # scheduling the next launch is scheduled before the previous one's ids are read.
    num_pending: int = 0
    feed_row: int = -1  # the row of the launch in flight that samples the pending token
    grammar: GrammarState | None = None  # structured outputs: advanced by each sampled token
    rules: TokenRules | None = None  # allowed_token_ids, bad_words, min_tokens: its mask's own part
    session: str | None = None  # its client's session, which the router may keep on one worker
    # Prompt tokens whose K/V came from the prefix cache when it was first admitted (usage's
    # cached_tokens); None before that.
    cached_tokens: int | None = None
    t_scheduled: float | None = None  # perf_counter when a launch first took it (its queue time ends)
    spec: SpecState | None = None  # speculative decoding: whether its proposals pay (made on first use)
    # A pooling runner's request: its prompt runs once and ``pooled`` (float32 [H], read from the
    # launch that finished the prompt) is its result instead of tokens.
    pooling: bool = False
    pooled: np.ndarray | None = field(default=None, repr=False)
    lora: ServedAdapter | None = None  # the LoRA adapter its rows apply (None: the base model)
    _hashes: tuple[int, int, list[bytes]] | None = field(default=None, repr=False)

    def prefix_hashes(self, block_size: int) -> list[bytes]:
        """Its full blocks' chained hashes, computed once per length: the router scores workers
        with them and the scheduler then looks its prefix up with the same."""
        n = self.length - self.num_pending
        if self._hashes is None or self._hashes[:2] != (n, block_size):
            self._hashes = (n, block_size, prefix_hashes(self.all_ids, block_size, self.cache_root))
        return self._hashes[2]

    @property
    def cache_root(self) -> bytes:
        """Its prefix hashes' first parent: its adapter's, or b"" (the base model)."""
        return b"" if self.lora is None else self.lora.cache_root

    @property
    def needs_last_token(self) -> bool:
        """Its next mask depends on its newest token: it never runs a launch ahead of reading it."""
        return self.grammar is not None or (self.rules is not None and self.rules.needs_last_token)

    @property
    def length(self) -> int:
        """Tokens as the device will know them: read ones plus the pending one."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def prefilled(self) -> bool:
        """Every token but the newest has its K/V: the next launch decodes one token."""
        return self.num_computed >= self.length - 1

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        """The newest token: the next decode step's input (no prompt + output copy)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def text(self) -> str:
        """The output text so far (cut before a stop string); the final text once finished."""
        return self.detok.text if self.detok is not None else ""


@dataclass
class TokenEvent:
    """What one launch did to a sequence: a token appended (with the text it completed),
    or, with ``error`` set, the request failed and was taken out of the batch."""

    seq: Sequence
    token: int | None
    finished: bool
    text: str = ""
    error: RequestError | None = None
    # The token's index in the output (a speculating request may append several in one launch,
    # so the output's length when the event is sent is not this token's).
    index: int = -1
