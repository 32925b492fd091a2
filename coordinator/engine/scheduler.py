"""Continuous batching over one worker's KV blocks, one launch shape, one token budget.

Each call to ``schedule`` fills a launch of at most ``max_num_batched_tokens`` tokens: a
decode row for every running sequence whose prompt is done, then prompt chunks in what is
left (unfinished prompts first, then new admissions, as blocks and rows allow). A prompt
longer than the budget is split across launches and shares each with the running decodes;
a chunk's prefix is whatever its sequence has computed (or found in the prefix cache).
When blocks run out mid-decode the newest request is preempted: its blocks are freed and it
is recomputed later from prompt + tokens so far. The scheduler is host-only bookkeeping of
rows and KV blocks: an executor runs the launches, and the ``OutputProcessor`` turns their ids
into tokens, text and finishes.

A launch may be scheduled before the previous one's ids are read (async scheduling): what a
launch computes is counted when it is scheduled, a row whose newest token is still on the
device is fed that token there (``feed_rows``), and ``process`` reads the ids one launch
behind. A row that a stop string or EOS has already finished samples one token too many;
``process`` drops it, so it is never streamed. Finishing by length is known ahead, so such a
row is never scheduled.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from fusedserve.coordinator.engine.block_manager import BlockManager, OutOfBlocks
from fusedserve.coordinator.engine.scheduled_batch import ScheduledBatch
from fusedserve.coordinator.engine.sequence import Sequence, TokenEvent
from fusedserve.coordinator.engine.speculative.speculation_policy import SpecState, Speculation
from fusedserve.coordinator.engine.state_snapshots import StateSnapshots
from fusedserve.coordinator.engine.token_histogram import TokenHistogram
from fusedserve.shared_memory.engine_config import EngineConfig


class Scheduler:
    def __init__(self, blocks: BlockManager, max_model_len: int, max_batch: int,
                 max_num_batched_tokens: int = 2048, speculation: Speculation | None = None,
                 snapshots: StateSnapshots | None = None, max_loras: int = 0):
        """``max_loras``: the LoRA adapters the running requests may use at once (a worker's slots)."""
        self.speculation = speculation
        self.max_loras = max_loras
        self.snapshots = snapshots  # a hybrid model's states at block boundaries (prefix caching)
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps = 0
        self.preemptions = 0  # requests preempted to free blocks (stats)
        self.tokens_scheduled = 0  # every token a launch carried: the work this worker was given
        self.launch_tokens = TokenHistogram()  # tokens per launch (vLLM's iteration_tokens_total)

    @classmethod
    def for_worker(cls, cfg: EngineConfig) -> Scheduler:
        """The scheduler of one worker with the resolved ``cfg``: offline and served alike."""
        c, s = cfg.cache, cfg.scheduler
        snapshots = StateSnapshots(c.state_snapshots, c.block_size) if c.state_snapshots else None
        return cls(BlockManager(cfg.num_blocks, c.block_size, c.enable_prefix_caching), cfg.max_model_len,
                   s.max_batch, s.max_num_batched_tokens, Speculation.from_config(cfg), snapshots,
                   cfg.lora.max_loras if cfg.lora.enable_lora else 0)

    # ------------------------------------------------------------------ requests

    def enqueue(self, seq: Sequence) -> None:
        """Queue a new request (built and checked by the ``InputProcessor``)."""
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
        speculating = self._speculating()
        decoding = self._decode_rows(speculating)
        budget = self.max_num_batched_tokens - len(decoding)
        chunks: list[tuple[Sequence, int]] = []
        for seq in self.running:  # prompts already admitted, not computed to their end
            if budget <= 0:
                break
            if not seq.prefilled:
                take = min(budget, seq.length - seq.num_computed)
                chunks.append((seq, take))
                budget -= take
        skipped: list[Sequence] = []  # waiting for an adapter slot: later ones may still start
        # The running requests' adapters: one more may start while they use fewer than the slots.
        adapters = {s.lora.key for s in self.running if s.lora is not None} if self.max_loras else set()
        while budget > 0 and self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted with its newest token still on the device
                break
            if seq.lora is not None and seq.lora.key not in adapters and len(adapters) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            # Prompt logprobs and penalties need every token through the device: no cached prefix.
            # One lookup serves both the sibling check and the allocation.
            hashes = seq.prefix_hashes(self.blocks.block_size)
            hit = [] if seq.params.full_prefill else self.blocks.cached_prefix(seq.all_ids, hashes)
            if self.snapshots is not None:  # a hybrid: only up to a block whose state was kept
                hit = hit[: self.snapshots.usable(hashes[: len(hit)])]
            if self._sibling_computing(seq, len(hit)):  # the same prompt is being computed: share it
                break
            try:  # room for one generated token too
                seq.num_computed = self.blocks.allocate(seq.seq_id, seq.all_ids, reserve=1, hit=hit,
                                                       root=seq.cache_root)
            except OutOfBlocks:
                break
            if self.snapshots is not None:
                self.snapshots.admitted(seq.seq_id, hashes, len(hit))
            if seq.cached_tokens is None:  # its first admission: its queue time ends
                seq.cached_tokens = seq.num_computed
                seq.t_scheduled = time.perf_counter()
            self.waiting.popleft()
            self.running.append(seq)
            if seq.lora is not None:
                adapters.add(seq.lora.key)
            seq.feed_row = -1
            take = min(budget, seq.num_tokens - seq.num_computed)
            chunks.append((seq, take))
            budget -= take
        self.waiting.extendleft(reversed(skipped))
        if not decoding and not chunks:
            return None
        drafts = self._propose(decoding, speculating, self.max_batch - len(decoding) - len(chunks), budget)
        batch = self._build(decoding, chunks, drafts)
        self._advance(batch)
        self.steps += 1
        return batch

    def _build(self, decoding: list[Sequence], chunks: list[tuple[Sequence, int]],
               drafts: dict[int, list[int]]) -> ScheduledBatch:
        """``drafts``: each speculating sequence's proposals, by ``id(seq)``."""
        ids, pos, slots, feed = [], [], [], []
        seqs: list[Sequence] = []  # one per row: a speculating sequence's proposals are rows of it
        groups, query_lens, after, steps = [], [], [], []
        for seq in decoding:
            token, row = self._input(seq)
            proposed = drafts.get(id(seq), [])
            if proposed:
                groups.append((len(seqs), 1 + len(proposed)))
            for j, t in enumerate([token, *proposed]):
                ids.append(t)
                feed.append(row if j == 0 else -1)
                pos.append(seq.num_computed + j)
                slots.append(self.blocks.slot(seq.seq_id, seq.num_computed + j))
                seqs.append(seq)
                query_lens.append(1)
                after.append(seq.num_computed + 1 + j)
                steps.append(len(seq.output_ids) + seq.num_pending + j)
        for seq, take in chunks:
            start, all_ids = seq.num_computed, seq.all_ids
            ids.extend(all_ids[start : start + take])
            pos.extend(range(start, start + take))
            slots.extend(self.blocks.slot(seq.seq_id, p) for p in range(start, start + take))
            feed.append(-1)
            seqs.append(seq)
            query_lens.append(take)
            after.append(seq.num_computed + take)  # each row's K/V reach
            steps.append(len(seq.output_ids) + seq.num_pending)
        num_decode = len(seqs) - len(chunks)
        width = max(len(self.blocks.table(s.seq_id)) for s in seqs)
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        for r, s in enumerate(seqs):
            t = self.blocks.table(s.seq_id)
            tables[r, : len(t)] = t
        self.tokens_scheduled += len(ids)
        self.launch_tokens.observe(len(ids))
        reach = {id(s): a for s, a in zip(seqs, after)}  # a speculating sequence's: its last row's
        return ScheduledBatch(
            seqs=tuple(seqs), num_decode=num_decode, query_lens=tuple(query_lens),
            token_ids=np.asarray(ids, dtype=np.int32), positions=np.asarray(pos, dtype=np.int32),
            slot_mapping=np.asarray(slots, dtype=np.int64), seq_lens=np.asarray(after, dtype=np.int32),
            block_tables=tables, feed_rows=np.asarray(feed, dtype=np.int32),
            samples=tuple(a >= s.length for s, a in zip(seqs, after)),
            computed_to=tuple(reach[id(s)] for s in seqs), draw_steps=tuple(steps), spec_groups=tuple(groups),
            device_proposals=self.speculation is not None and self.speculation.proposer.on_device,
        )

    @staticmethod
    def _advance(batch: ScheduledBatch) -> None:
        """Count what the launch will compute and sample, before it runs: the next
        launch may be scheduled before this one's ids are read. A speculating sequence counts
        every proposal as computed until its launch is read (``speculated`` rolls back)."""
        for row, seq in enumerate(batch.seqs):
            if batch.follows(row):
                continue
            seq.num_computed = batch.computed_to[row]
            if batch.samples[row]:
                seq.num_pending += 1
                seq.feed_row = row

    def _sibling_computing(self, seq: Sequence, hit_blocks: int) -> bool:
        """A running sequence is still computing the full prompt blocks ``seq`` would reuse
        (``n`` choices of one prompt, or the same prompt sent twice): ``seq`` waits for them to
        be committed and reads them from the prefix cache, instead of computing them again.
        ``hit_blocks``: how many of its blocks the cache already has."""
        if not self.blocks.enable_prefix_caching or seq.params.full_prefill:
            return False
        ids, bs = seq.all_ids, self.blocks.block_size
        full = (len(ids) - 1) // bs
        if not full or hit_blocks == full:
            return False
        return any(r.num_tokens > full * bs and r.cache_root == seq.cache_root  # another adapter's: no hit
                   and r.all_ids[: full * bs] == ids[: full * bs] and self.blocks.committed(r.seq_id) < full
                   for r in self.running)

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

    # ------------------------------------------------------------ speculation

    def _speculating(self) -> bool:
        """The batch gate: speculation runs while the worker holds few enough requests, running or
        waiting (vLLM's ``disable_by_batch_size``): a batch of arrivals never speculates while its
        first prompts are done and the rest are still prefilling."""
        sp = self.speculation
        return sp is not None and self.load <= sp.max_batch

    def _speculates(self, seq: Sequence) -> bool:
        """``seq`` proposes in this launch (so it waits for its newest token rather than run ahead)."""
        if not seq.params.speculable or (seq.rules is not None and seq.rules.needs_last_token):
            return False
        if seq.grammar is not None and (not seq.grammar.speculable or self.speculation.proposer.on_device):
            return False  # the masks of proposal rows need the proposals on the host
        if seq.spec is None:
            seq.spec = SpecState()
        return seq.spec.active(self.steps)

    def _propose(self, decoding: list[Sequence], speculating: bool, rows: int,
                 budget: int) -> dict[int, list[int]]:
        """Each speculating sequence's proposals within the free rows, token budget and blocks,
        never past its ``max_tokens`` or the context; by ``id(seq)``."""
        drafts: dict[int, list[int]] = {}
        if not speculating:
            return drafts
        sp = self.speculation
        for seq in decoding:
            if not self._speculates(seq):
                continue
            room = min(sp.k, rows, budget, seq.params.max_tokens - len(seq.output_ids) - 1,
                       self.max_model_len - seq.length)
            proposed = sp.proposer.propose(seq.all_ids, room) if room > 0 else []
            if proposed and seq.grammar is not None:  # a proposal the grammar refuses is never drawn
                proposed = proposed[: seq.grammar.allowed_prefix(proposed)]
            if proposed:
                try:
                    self.blocks.ensure(seq.seq_id, seq.length + len(proposed))
                except OutOfBlocks:  # proposals never preempt anyone
                    proposed = []
            if not proposed:
                seq.spec.record(0, self.steps)
                continue
            drafts[id(seq)] = proposed
            rows -= len(proposed)
            budget -= len(proposed)
            sp.stats.drafts += 1
            sp.stats.proposed += len(proposed)
        return drafts

    def speculated(self, batch: ScheduledBatch, accepted: dict[int, int]) -> None:
        """After a launch's tokens are appended: each speculating sequence still running keeps the
        K/V of the proposals it accepted (``accepted``: tokens gained, by first row); the blocks past
        its tokens go back to the block manager, and the rejected rows' slots are never read."""
        sp = self.speculation
        for first, _ in batch.spec_groups:
            seq = batch.seqs[first]
            gained = accepted.get(first, 0)
            if sp is not None and gained:
                sp.stats.accepted += gained - 1
                seq.spec.record(gained - 1, self.steps)
            if seq in self.running and seq.finish_reason is None:
                seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)
                self.blocks.trim(seq.seq_id, seq.num_tokens)

    def _decode_rows(self, speculating: bool = False) -> list[Sequence]:
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
        # A row whose mask needs its previous token (a grammar, a multi-token bad word), or that
        # proposes from its tokens, skips a launch rather than run one ahead (the other rows stay one
        # launch ahead).
        return [s for s in self.running if s.prefilled and not self._length_done(s)
                and not (s.num_pending and (s.needs_last_token or (speculating and self._speculates(s))))]

    def _preempt(self, seq: Sequence) -> None:
        self._retire(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _retire(self, seq: Sequence) -> None:
        """Take ``seq`` out (running, or waiting after a preemption) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            if self.snapshots is not None:
                self.snapshots.release(seq.seq_id, self.blocks.hashes(seq.seq_id))
            self.blocks.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _holds(self, seq: Sequence) -> bool:
        """Still this scheduler's: running, or preempted while its token was in flight."""
        return seq in self.running or (seq.num_pending > 0 and seq in self.waiting)

    # ------------------------------------------------------------------- results

    def settle(self, batch: ScheduledBatch) -> list[int]:
        """The rows of a finished launch whose results still count, before the output processor
        reads them: a sampled token is no longer pending, and a chunk short of its prompt's end
        names the full blocks it computed. Rows of requests that finished meanwhile (their extra
        token), left or moved are dropped."""
        rows = []
        for row, seq in enumerate(batch.seqs):
            if seq.finish_reason is not None or not self._holds(seq) or batch.follows(row):
                continue
            if batch.samples[row]:
                seq.num_pending -= 1
            else:
                upto = batch.computed_to[row]
                if seq in self.running and self.blocks.needs_commit(seq.seq_id, upto):
                    self.blocks.commit(seq.seq_id, seq.all_ids, upto)
            rows.append(row)
        return rows

    def update(self, events: list[TokenEvent]) -> None:
        """After the output processor: name the blocks each new token completed (K/V exist for
        every token but the one just sampled), and retire what finished or failed."""
        for ev in events:
            seq = ev.seq
            # K/V exist for every token but a sampled one (a pooled request's: for its whole prompt).
            done = seq.num_tokens - (seq.pooled is None)
            if (ev.token is not None or seq.pooled is not None) and seq in self.running \
                    and self.blocks.needs_commit(seq.seq_id, done):
                self.blocks.commit(seq.seq_id, seq.all_ids, done)
            if ev.finished:
                self._retire(seq)
