"""Continuous batching over one worker's KV blocks, one launch shape, one token budget.

Each call to ``schedule`` fills a launch of at most ``max_num_batched_tokens`` tokens: a
decode row for every running sequence whose prompt is done, then prompt chunks in what is
left (unfinished prompts first, then new admissions, as blocks and rows allow). A prompt
longer than the budget is split across launches and shares each with the running decodes;
a chunk's prefix is whatever its sequence has computed (or found in the prefix cache).
When blocks run out mid-decode the newest request is preempted: its blocks are freed and it
is recomputed later from prompt + tokens so far. The scheduler is host-only bookkeeping;
an executor runs the launches.

A launch may be scheduled before the previous one's ids are read (async scheduling): what a
launch computes is counted when it is scheduled, a row whose newest token is still on the
device is fed that token there (``feed_rows``), and ``process`` reads the ids one launch
behind. A row that a stop string or EOS has already finished samples one token too many;
``process`` drops it, so it is never streamed. Finishing by length is known ahead, so such a
row is never scheduled.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque

import numpy as np

from coordinator.engine.block_manager import BlockManager, OutOfBlocks
from coordinator.engine.detokenizer import Detokenizer
from coordinator.engine.scheduled_batch import ScheduledBatch
from coordinator.engine.sequence import Sequence, TokenEvent
from coordinator.engine.step_outputs import StepOutputs
from coordinator.errors import RequestError
from coordinator.sampling_params import SamplingParams
from kernels.model.config import Qwen3Config
from shared_memory.contract import DEFAULT_MAX_NUM_BATCHED_TOKENS, RunnerConfig

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_model_len: int, max_batch: int,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 eos_token_ids: tuple[int, ...] = ()):
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps = 0
        self._arrivals = itertools.count()

    @classmethod
    def for_worker(cls, config: Qwen3Config, rc: RunnerConfig, max_model_len: int) -> Scheduler:
        """The scheduler of one worker running ``config`` with ``rc``: offline and served alike."""
        return cls(BlockManager(rc.num_blocks, rc.block_size, rc.enable_prefix_caching), max_model_len,
                   rc.max_batch, rc.max_num_batched_tokens, config.eos_token_ids)

    # ------------------------------------------------------------------ requests

    def add(self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
            detok: Detokenizer | None = None) -> Sequence:
        """Queue a new request (checked beforehand: ``RequestLimits``), numbered on arrival."""
        seq = Sequence(seq_id, list(prompt_ids), params, arrival=next(self._arrivals), detok=detok)
        self.waiting.append(seq)
        return seq

    def enqueue(self, seq: Sequence) -> None:
        """Queue a request numbered elsewhere (the coordinator numbers arrivals globally)."""
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

    def schedule(self) -> ScheduledBatch | None:
        """The next launch, or None when nothing can run now."""
        decoding = self._decode_rows()
        budget = self.max_num_batched_tokens - len(decoding)
        chunks: list[tuple[Sequence, int]] = []
        for seq in self.running:  # prompts already admitted, not computed to their end
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
            # Prompt logprobs need every token computed: no cached prefix. One lookup serves both
            # the sibling check and the allocation.
            hit = [] if seq.params.prompt_logprobs is not None else self.blocks.cached_prefix(seq.all_ids)
            if self._sibling_computing(seq, len(hit)):  # the same prompt is being computed: share it
                break
            try:  # room for one generated token too
                seq.num_computed = self.blocks.allocate(seq.seq_id, seq.all_ids, reserve=1, hit=hit)
            except OutOfBlocks:
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.feed_row = -1
            take = min(budget, seq.num_tokens - seq.num_computed)
            chunks.append((seq, take))
            budget -= take
        if not decoding and not chunks:
            return None
        batch = self._build(decoding, chunks)
        self._advance(batch)
        self.steps += 1
        return batch

    def _build(self, decoding: list[Sequence], chunks: list[tuple[Sequence, int]]) -> ScheduledBatch:
        ids, pos, slots, feed = [], [], [], []
        for seq in decoding:
            token, row = self._input(seq)
            ids.append(token)
            feed.append(row)
            pos.append(seq.num_computed)
            slots.append(self.blocks.slot(seq.seq_id, seq.num_computed))
        for seq, take in chunks:
            start, all_ids = seq.num_computed, seq.all_ids
            ids.extend(all_ids[start : start + take])
            pos.extend(range(start, start + take))
            slots.extend(self.blocks.slot(seq.seq_id, p) for p in range(start, start + take))
            feed.append(-1)
        seqs = decoding + [s for s, _ in chunks]
        query_lens = [1] * len(decoding) + [t for _, t in chunks]
        width = max(len(self.blocks.table(s.seq_id)) for s in seqs)
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        for r, s in enumerate(seqs):
            t = self.blocks.table(s.seq_id)
            tables[r, : len(t)] = t
        return ScheduledBatch(
            seqs=seqs, num_decode=len(decoding), query_lens=query_lens,
            token_ids=np.asarray(ids, dtype=np.int32), positions=np.asarray(pos, dtype=np.int32),
            slot_mapping=np.asarray(slots, dtype=np.int64),
            seq_lens=np.asarray([s.num_computed + n for s, n in zip(seqs, query_lens)], dtype=np.int32),
            block_tables=tables, feed_rows=np.asarray(feed, dtype=np.int32),
        )

    def _advance(self, batch: ScheduledBatch) -> None:
        """Count what the launch will compute and sample, before it runs: the next
        launch may be scheduled before this one's ids are read."""
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.query_lens)):
            seq.num_computed += n
            samples = seq.num_computed >= seq.length
            batch.samples.append(samples)
            batch.computed_to.append(seq.num_computed)
            batch.draw_steps.append(len(seq.output_ids) + seq.num_pending)
            if samples:
                seq.num_pending += 1
                seq.feed_row = row

    def _sibling_computing(self, seq: Sequence, hit_blocks: int) -> bool:
        """A running sequence is still computing the full prompt blocks ``seq`` would reuse
        (``n`` choices of one prompt, or the same prompt sent twice): ``seq`` waits for them to
        be committed and reads them from the prefix cache, instead of computing them again.
        ``hit_blocks``: how many of its blocks the cache already has."""
        if not self.blocks.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return False
        ids, bs = seq.all_ids, self.blocks.block_size
        full = (len(ids) - 1) // bs
        if not full or hit_blocks == full:
            return False
        return any(r.num_tokens > full * bs and r.all_ids[: full * bs] == ids[: full * bs]
                   and self.blocks.committed(r.seq_id) < full for r in self.running)

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

    def _decode_rows(self) -> list[Sequence]:
        """The prefilled running sequences that need another token, each with room for it;
        when blocks run out the newest running sequence is preempted (recomputed later)."""
        self.running.sort(key=lambda s: s.arrival)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            try:
                if seq.prefilled and not self._length_done(seq):
                    self.blocks.ensure(seq.seq_id, seq.length)
                i += 1
            except OutOfBlocks:
                self._preempt(self.running[-1])
        # A row under a grammar needs its previous token for its mask: it skips a launch rather
        # than run one ahead (the other rows stay one launch ahead).
        return [s for s in self.running if s.prefilled and not self._length_done(s)
                and not (s.grammar is not None and s.num_pending)]

    def _preempt(self, seq: Sequence) -> None:
        self._retire(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

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

    def process(self, batch: ScheduledBatch, out: StepOutputs) -> list[TokenEvent]:
        """Read each row's token from the launch's outputs and retire finished rows.

        A row of a request that finished meanwhile (its extra token) or left is skipped.
        A row that raises fails alone: its request leaves the batch with an error event
        and the other rows go on (one request must never stop a worker's loop).
        """
        events = []
        for row, seq in enumerate(batch.seqs):
            if seq.finish_reason is not None or not self._holds(seq):
                continue  # finished by an earlier token (this one is extra), aborted, or moved
            try:
                out.record_prompt_logprobs(row, seq)
                if not batch.samples[row]:  # a chunk short of the prompt's end: no token
                    upto = batch.computed_to[row]
                    if seq in self.running and self.blocks.needs_commit(seq.seq_id, upto):
                        self.blocks.commit(seq.seq_id, seq.all_ids, upto)
                    continue
                seq.num_pending -= 1
                events.append(self._append(seq, out.token(row, seq.seq_id), row, out))
            except Exception as exc:  # noqa: BLE001 - isolated to this request
                log.exception("request %s failed while reading its token", seq.seq_id)
                self._retire(seq)
                seq.finish_reason = "error"
                events.append(TokenEvent(seq, None, True, error=RequestError(
                    "sampling_error", f"sampling failed: {type(exc).__name__}: {exc}")))
        return events

    def _append(self, seq: Sequence, token: int, row: int, out: StepOutputs) -> TokenEvent:
        if seq.params.logprobs:
            lp, top = out.logprobs(row, seq.seq_id, seq.params.top_logprobs)
            seq.logprobs.append(lp)
            if seq.params.top_logprobs:
                seq.top_logprobs.append(top)
        seq.output_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
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
        if seq.grammar is not None and seq.grammar.done:
            return "stop"
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None
