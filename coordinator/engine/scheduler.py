"""Continuous batching over one worker's KV blocks.

Each call to ``schedule`` returns the next launch: a prefill of newly admitted
requests (as many as blocks and the batch allow), else one decode step of every
running request. When blocks run out mid-decode the newest request is preempted:
its blocks are freed and it is recomputed later from prompt + tokens so far.
The scheduler is host-only bookkeeping; an executor runs the launches.

A launch may be scheduled before the previous one's ids are read (async scheduling):
what a launch computes is counted when it is scheduled, a row whose newest token is
still on the device is fed that token there (``feed_rows``), and ``process`` reads the
ids one launch behind. A row that a stop string or EOS has already finished samples one
token too many; ``process`` drops it, so it is never streamed. Finishing by length is
known ahead, so such a row is never scheduled.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from coordinator.engine.block_manager import BlockManager, OutOfBlocks
from coordinator.engine.detokenizer import Detokenizer
from coordinator.engine.sequence import Sequence, TokenEvent
from coordinator.engine.step_outputs import DecodeResult
from coordinator.errors import RequestError
from coordinator.sampling_params import (
    RowKind,
    SamplingError,
    SamplingParams,
    logprob,
    row_kind,
    sample,
    top_logprobs,
)
from kernels.model.config import Qwen3Config
from shared_memory.contract import RunnerConfig

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """One launch's host-side inputs; rows are ``seqs`` in order."""

    kind: str  # "prefill" | "decode"
    seqs: list[Sequence]
    token_ids: np.ndarray  # int32 [T] (prefill, packed) or [B] (decode)
    positions: np.ndarray  # int32, like token_ids
    slot_mapping: np.ndarray  # int64, like token_ids
    row_kinds: list[str]
    cu_seqlens: list[int] = field(default_factory=list)  # prefill: boundaries of the new tokens
    prefix_lens: list[int] = field(default_factory=list)  # prefill: leading tokens from the cache
    prefix_slots: np.ndarray | None = None  # int64 [sum(prefix_lens)]: their slots, packed
    num_decode: int = 0  # prefill with chunking: its first rows are decode rows
    chunk_lens: list[int] = field(default_factory=list)  # prefill: new tokens per row
    block_tables: np.ndarray | None = None  # int32 [B, W] (decode)
    seq_lens: np.ndarray | None = None  # int32 [B] (decode)
    ctx_len: int = 0  # decode: context gathered, a multiple of block_size
    # Decode rows: the row of the previous launch whose sampled id is this row's input
    # (its token is not read yet), or -1 where ``token_ids`` holds it.
    feed_rows: np.ndarray | None = None
    samples: list[bool] = field(default_factory=list)  # the row samples a token
    computed_to: list[int] = field(default_factory=list)  # the row's K/V reach after this launch
    draw_steps: list[int] = field(default_factory=list)  # the sampled token's index in the output

    @property
    def batch_size(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        vocab_size: int,
        max_model_len: int,
        max_batch: int,
        top_k_candidates: int,
        eos_token_ids: tuple[int, ...] = (),
        max_prefill_tokens: int = 4096,
        max_num_batched_tokens: int = 0,
        device_sampling: bool = False,
    ):
        self.blocks = blocks
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.k = top_k_candidates
        self.eos = set(eos_token_ids)
        self.max_prefill_tokens = max_prefill_tokens
        self.max_num_batched_tokens = max_num_batched_tokens  # 0: no chunked prefill
        self.device_sampling = device_sampling
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps = 0
        self._arrivals = itertools.count()

    @classmethod
    def for_worker(cls, config: Qwen3Config, rc: RunnerConfig, max_model_len: int) -> Scheduler:
        """The scheduler of one worker running ``config`` with ``rc``: offline and served alike."""
        return cls(BlockManager(rc.num_blocks, rc.block_size, rc.enable_prefix_caching),
                   config.vocab_size, max_model_len,
                   rc.max_batch, rc.top_k, config.eos_token_ids, rc.max_prefill_tokens,
                   rc.max_num_batched_tokens, rc.device_sampling)

    # ------------------------------------------------------------------ requests

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a prompt this worker's model cannot serve."""
        if not prompt_ids:
            raise RequestError("empty_prompt", "prompt has no tokens")
        for i, t in enumerate(prompt_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise RequestError(
                    "token_out_of_range",
                    f"prompt token {i} is {t!r}; token ids must be integers in "
                    f"[0, {self.vocab_size})",
                )
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                "prompt_too_long",
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                "(prompt plus at least one generated token)",
            )
        if self.blocks.blocks_for(min(len(prompt_ids) + params.max_tokens, self.max_model_len)) \
                > self.blocks.num_blocks:
            raise RequestError(
                "too_many_tokens",
                f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) needs more KV "
                f"blocks than the worker has ({self.blocks.num_blocks})",
            )

    def add(self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
            detok: Detokenizer | None = None) -> Sequence:
        self.validate(prompt_ids, params)
        seq = Sequence(seq_id, list(prompt_ids), params, arrival=next(self._arrivals), detok=detok)
        self.waiting.append(seq)
        return seq

    def enqueue(self, seq: Sequence) -> None:
        """Queue a request validated elsewhere (the coordinator numbers arrivals globally)."""
        self.waiting.append(seq)

    def resume(self, seq: Sequence) -> None:
        """Queue a sequence that already has tokens (moved here from a failed worker, whose
        launches in flight are lost: their tokens are sampled again, the same ones)."""
        seq.num_computed, seq.num_pending, seq.feed_row = 0, 0, -1
        self.waiting.appendleft(seq)

    def abort(self, seq_id: str) -> None:
        """Take a request out of this scheduler, freeing its blocks; unknown ids are a no-op."""
        for seq in list(self.waiting):
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
        for seq in list(self.running):
            if seq.seq_id == seq_id:
                self._retire(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ batching

    def schedule(self) -> StepBatch | None:
        if self.max_num_batched_tokens:
            batch = self._schedule_chunked()
        else:
            batch = self._schedule_prefill()
            if batch is None and self.running:
                batch = self._schedule_decode()
        if batch is not None:
            self._advance(batch)
            self.steps += 1
        return batch

    def _advance(self, batch: StepBatch) -> None:
        """Count what the launch will compute and sample, before it runs: the next
        launch may be scheduled before this one's ids are read."""
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.chunk_lens)):
            seq.num_computed += n
            samples = seq.num_computed >= seq.length
            batch.samples.append(samples)
            batch.computed_to.append(seq.num_computed)
            batch.draw_steps.append(len(seq.output_ids) + seq.num_pending)
            if samples:
                seq.num_pending += 1
                seq.feed_row = row

    def _input(self, seq: Sequence) -> tuple[int, int]:
        """A decode row's input token and feed row: the token itself once read, else the
        row of the launch in flight that samples it (the device keeps its ids)."""
        if seq.num_pending:
            return 0, seq.feed_row
        return seq.last_token, -1

    def _length_done(self, seq: Sequence) -> bool:
        """The tokens already sampled finish ``seq`` by length: it needs no more launches."""
        return (len(seq.output_ids) + seq.num_pending >= seq.params.max_tokens
                or seq.length >= self.max_model_len)

    def _schedule_prefill(self) -> StepBatch | None:
        admitted: list[tuple[Sequence, int]] = []  # (sequence, tokens already in the cache)
        tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted with its newest token still on the device
                break
            ids = seq.all_ids
            hit = self.blocks.cached_prefix(ids)  # hashed once: the budget check and the allocation
            if admitted and tokens + len(ids) - len(hit) * self.blocks.block_size > self.max_prefill_tokens:
                break
            try:  # room for one generated token too
                cached = self.blocks.allocate(seq.seq_id, ids, reserve=1, hit=hit)
            except OutOfBlocks:
                break
            self.waiting.popleft()
            admitted.append((seq, cached))
            tokens += len(ids) - cached
        if not admitted:
            return None
        ids, pos, slots, cu, prefix_slots = [], [], [], [0], []
        for seq, cached in admitted:
            n = seq.num_tokens
            ids.extend(seq.all_ids[cached:])
            pos.extend(range(cached, n))
            slots.extend(self.blocks.slot(seq.seq_id, p) for p in range(cached, n))
            prefix_slots.extend(self.blocks.slot(seq.seq_id, p) for p in range(cached))
            cu.append(cu[-1] + n - cached)
        for seq, cached in admitted:
            seq.num_computed = cached
            seq.feed_row = -1
        seqs = [s for s, _ in admitted]
        self.running.extend(seqs)
        return StepBatch(
            kind="prefill",
            seqs=seqs,
            token_ids=np.asarray(ids, dtype=np.int32),
            positions=np.asarray(pos, dtype=np.int32),
            slot_mapping=np.asarray(slots, dtype=np.int64),
            row_kinds=[row_kind(s.params, self.k, self.device_sampling) for s in seqs],
            cu_seqlens=cu,
            prefix_lens=[c for _, c in admitted],
            prefix_slots=np.asarray(prefix_slots, dtype=np.int64),
            chunk_lens=[s.num_tokens - c for s, c in admitted],
        )

    def _schedule_chunked(self) -> StepBatch | None:
        """One launch of at most ``max_num_batched_tokens`` tokens: a decode row for every
        prefilled sequence, then prompt chunks (unfinished prompts first, then admissions)
        in what the budget leaves; a chunk's prefix is whatever its sequence has computed."""
        decoding = self._decode_rows()
        budget = self.max_num_batched_tokens - len(decoding)
        chunks: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.prefilled:
                take = min(budget, seq.length - seq.num_computed)
                chunks.append((seq, take))
                budget -= take
        while budget > 0 and self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted with its newest token still on the device
                break
            try:
                seq.num_computed = self.blocks.allocate(seq.seq_id, seq.all_ids, reserve=1)
            except OutOfBlocks:
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.feed_row = -1
            take = min(budget, seq.num_tokens - seq.num_computed)
            chunks.append((seq, take))
            budget -= take
        if not chunks:
            return self._decode_batch(decoding) if decoding else None
        ids, pos, slots, cu, prefix_slots, feed = [], [], [], [0], [], []
        for seq in decoding:
            p = seq.num_computed
            token, row = self._input(seq)
            ids.append(token)
            feed.append(row)
            pos.append(p)
            slots.append(self.blocks.slot(seq.seq_id, p))
            cu.append(cu[-1] + 1)
        for seq, take in chunks:
            start, all_ids = seq.num_computed, seq.all_ids
            ids.extend(all_ids[start : start + take])
            pos.extend(range(start, start + take))
            slots.extend(self.blocks.slot(seq.seq_id, p) for p in range(start, start + take))
            prefix_slots.extend(self.blocks.slot(seq.seq_id, p) for p in range(start))
            cu.append(cu[-1] + take)
        seqs = decoding + [s for s, _ in chunks]
        tables, lens, ctx = self._tables(decoding)
        return StepBatch(
            kind="prefill", seqs=seqs,
            token_ids=np.asarray(ids, dtype=np.int32), positions=np.asarray(pos, dtype=np.int32),
            slot_mapping=np.asarray(slots, dtype=np.int64),
            row_kinds=[row_kind(s.params, self.k, self.device_sampling) for s in seqs], cu_seqlens=cu,
            prefix_lens=[0] * len(decoding) + [s.num_computed for s, _ in chunks],
            prefix_slots=np.asarray(prefix_slots, dtype=np.int64),
            num_decode=len(decoding), block_tables=tables, seq_lens=lens, ctx_len=ctx,
            chunk_lens=[1] * len(decoding) + [t for _, t in chunks],
            feed_rows=np.asarray(feed, dtype=np.int32),
        )

    def _schedule_decode(self) -> StepBatch | None:
        seqs = self._decode_rows()
        return self._decode_batch(seqs) if seqs else None

    def _decode_rows(self) -> list[Sequence]:
        """The prefilled running sequences that need another token, each with room for it;
        when blocks run out the newest running sequence is preempted (recomputed later)."""
        self.running.sort(key=lambda s: s.arrival)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            try:
                if not self._length_done(seq):
                    self.blocks.ensure(seq.seq_id, seq.length)
                i += 1
            except OutOfBlocks:
                self._preempt(self.running[-1])
        return [s for s in self.running if s.prefilled and not self._length_done(s)]

    def _tables(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray, int]:
        """Block tables [B, W], sequence lengths [B] and the context width for decode rows."""
        width = max((len(self.blocks.table(s.seq_id)) for s in seqs), default=0)
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        for r, s in enumerate(seqs):
            t = self.blocks.table(s.seq_id)
            tables[r, : len(t)] = t
        lens = np.asarray([s.length for s in seqs], dtype=np.int32)
        return tables, lens, width * self.blocks.block_size

    def _decode_batch(self, seqs: list[Sequence]) -> StepBatch:
        tables, _, ctx = self._tables(seqs)
        positions = np.asarray([s.num_computed for s in seqs], dtype=np.int32)
        inputs = [self._input(s) for s in seqs]
        return StepBatch(
            kind="decode",
            seqs=seqs,
            token_ids=np.asarray([t for t, _ in inputs], dtype=np.int32),
            positions=positions,
            slot_mapping=np.asarray(
                [self.blocks.slot(s.seq_id, s.num_computed) for s in seqs], dtype=np.int64
            ),
            row_kinds=[row_kind(s.params, self.k, self.device_sampling) for s in seqs],
            block_tables=tables,
            seq_lens=positions + 1,
            ctx_len=ctx,
            chunk_lens=[1] * len(seqs),
            feed_rows=np.asarray([r for _, r in inputs], dtype=np.int32),
        )

    def _preempt(self, seq: Sequence) -> None:
        self._retire(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------- results

    def _retire(self, seq: Sequence) -> None:
        """Take ``seq`` out (running, or waiting after a preemption) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _holds(self, seq: Sequence) -> bool:
        """Still this scheduler's: running, or preempted while its token was in flight."""
        return seq in self.running or (seq.num_pending > 0 and seq in self.waiting)

    # ------------------------------------------------------------------- results

    def process(self, batch: StepBatch, result: DecodeResult) -> list[TokenEvent]:
        """Read each row's token from the launch's result and retire finished rows.

        A row of a request that finished meanwhile (its extra token) or left is skipped.
        A row that raises fails alone: its request leaves the batch with an error event
        and the other rows go on (one request must never stop a worker's loop).
        """
        events = []
        for row, (seq, kind) in enumerate(zip(batch.seqs, batch.row_kinds)):
            if seq.finish_reason is not None or not self._holds(seq):
                continue  # finished by an earlier token (this one is extra), aborted, or moved
            if batch.samples[row]:
                seq.num_pending -= 1
            if not batch.samples[row]:  # a chunk short of the prompt's end: no token
                upto = batch.computed_to[row]
                if seq in self.running and self.blocks.needs_commit(seq.seq_id, upto):
                    self.blocks.commit(seq.seq_id, seq.all_ids, upto)
                continue
            try:
                events.append(self._process_row(seq, kind, row, result))
            except Exception as exc:  # noqa: BLE001 - isolated to this request
                log.exception("request %s failed while sampling", seq.seq_id)
                self._retire(seq)
                seq.finish_reason = "error"
                events.append(TokenEvent(seq, None, True, error=RequestError(
                    "sampling_error", f"sampling failed: {type(exc).__name__}: {exc}")))
        return events

    def _process_row(self, seq: Sequence, kind: str, row: int, result: DecodeResult) -> TokenEvent:
        step = len(seq.output_ids)
        if kind == RowKind.INVALID:
            raise SamplingError(f"sampling parameters {seq.params!r} cannot be sent to the device")
        if kind in (RowKind.GREEDY, RowKind.DEVICE):
            token = result.greedy_id(row, seq.seq_id)
        else:
            values, ids = result.candidates(row, seq.seq_id)
            token = sample(values, ids, seq.params, step)
        if seq.params.logprobs and kind == RowKind.DEVICE:
            lp, top = result.device_logprobs(row, seq.seq_id, seq.params.top_logprobs)
            seq.logprobs.append(lp)
            if seq.params.top_logprobs:
                seq.top_logprobs.append(top)
        elif seq.params.logprobs:
            row_logits = result.full_logits(row, seq.seq_id)
            seq.logprobs.append(logprob(row_logits, token))
            if seq.params.top_logprobs:
                seq.top_logprobs.append(top_logprobs(row_logits, seq.params.top_logprobs))
        seq.output_ids.append(token)
        # K/V now exist for every token but the one just sampled: name the full blocks.
        if seq in self.running and self.blocks.needs_commit(seq.seq_id, seq.num_tokens - 1):
            self.blocks.commit(seq.seq_id, seq.all_ids, seq.num_tokens - 1)
        if seq.detok is not None:
            seq.detok.push(token)
        seq.finish_reason = self._finish_reason(seq, token)
        finished = seq.finish_reason is not None
        if finished:
            self._retire(seq)
        text = ""
        if seq.detok is not None:
            if finished:
                seq.detok.finish()
            text = seq.detok.delta(final=finished)
        return TokenEvent(seq, token, finished, text)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.detok is not None and seq.detok.stopped:
            return "stop"
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None
