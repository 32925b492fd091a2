"""Captured decode steps, per batch-size bucket (CUDA graphs; NPU graphs on Ascend).

A graph replays fixed addresses and shapes, so a decode-only launch of B rows runs the
graph of the smallest bucket >= B: rows past B are padding (token 0, position 0, length 1)
that write their K/V into a reserved slot outside every allocatable block, and block
tables are padded to the widest table. The same padding runs eagerly on the CPU, which
is how its logic is tested here. Launches with prompt tokens run eagerly.

A decode step is one replay, the sampler included: each bucket has a graph that samples greedily
and one that runs every sampling stage (a row's draw does not depend on which stages its batch
runs, so the widest plan gives every row its own token). Launches that also want logprobs or
apply a grammar replay a third graph, the forward alone, and sample eagerly after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kernels.forward_batch import ForwardBatch
from kernels.kv_cache import PagedKVCache
from kernels.model.qwen3 import Qwen3Model
from kernels.model.workspace import Workspace
from kernels.sampler import SamplingPlan

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to ``max_batch`` (vLLM's capture sizes)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


# The sampling variants captured per bucket: None is the forward alone.
GREEDY = SamplingPlan()
EVERY_STAGE = SamplingPlan(candidates=True, full=True, wide_top_k=True, top_p=True, min_p=True)
VARIANTS = (None, GREEDY, EVERY_STAGE)

Sample = Callable[[int, SamplingPlan], None]  # sample(rows, plan): the first rows' logits -> ids


def variant(plan: SamplingPlan | None) -> SamplingPlan | None:
    """The captured variant that samples ``plan`` (None: the forward alone)."""
    if plan is None:
        return None
    return EVERY_STAGE if plan.random else GREEDY


def _graph_api(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.CUDAGraph, torch.cuda.graph
    if device.type == "npu":  # pragma: no cover - needs Ascend hardware
        return torch.npu.NPUGraph, torch.npu.graph  # type: ignore[attr-defined]
    return None


class DecodeGraphs:
    """Bucketed, padded decode; captured as device graphs where the device has them."""

    def __init__(self, model: Qwen3Model, kv: PagedKVCache, ws: Workspace, logits: torch.Tensor,
                 max_batch: int, pad_slot: int, sample: Sample, capture: bool = True):
        self.model, self.kv, self.ws, self.logits, self.sample = model, kv, ws, logits, sample
        self.buckets = batch_buckets(max_batch)
        self.max_width = -(-model.max_model_len // kv.block_size)
        self.pad_slot = pad_slot
        dev = model.device
        i32 = {"dtype": torch.int32, "device": dev}
        self.token_ids = torch.zeros(max_batch, **i32)
        self.positions = torch.zeros(max_batch, **i32)
        self.seq_lens = torch.ones(max_batch, **i32)
        self.query_start_loc = torch.arange(max_batch + 1, **i32)  # one token a row
        self.slot_mapping = torch.full((max_batch,), pad_slot, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(max_batch, self.max_width, **i32)
        self.graphs: dict[tuple[int, SamplingPlan | None], object] = {}
        api = _graph_api(dev) if capture else None
        if api is not None:
            self._capture(*api)

    def _eager(self, b: int, plan: SamplingPlan | None) -> None:
        batch = ForwardBatch(self.token_ids[:b], self.positions[:b], self.slot_mapping[:b],
                             self.query_start_loc[: b + 1], self.seq_lens[:b], self.block_tables[:b],
                             num_decode=b)
        self.model.forward(batch, self.kv, self.ws, self.logits[:b])
        if plan is not None:
            self.sample(b, plan)

    def _capture(self, graph_cls, graph_ctx) -> None:
        pool = None  # one memory pool for every graph: they never run at once
        for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory
            for plan in VARIANTS:
                self._eager(b, plan)  # warm up kernels and workspaces outside capture
                g = graph_cls()
                with graph_ctx(g, pool=pool):
                    self._eager(b, plan)
                pool = g.pool()
                self.graphs[b, plan] = g
        log.info("captured decode graphs for buckets %s, %d sampling variants each", self.buckets,
                 len(VARIANTS))

    def bucket(self, b: int) -> int:
        for size in self.buckets:
            if size >= b:
                return size
        raise ValueError(f"batch {b} exceeds the largest bucket {self.buckets[-1]}")

    def run(self, batch: ForwardBatch, plan: SamplingPlan | None) -> None:
        """A decode-only batch of B rows; rows [:B] of ``logits`` are valid afterwards, and with a
        ``plan`` the first B sampled ids too (padding rows sample into the rows past them)."""
        b = batch.num_rows
        n = self.bucket(b)
        w = batch.block_tables.shape[1]
        self.token_ids[:b].copy_(batch.token_ids)
        self.positions[:b].copy_(batch.positions)
        self.seq_lens[:b].copy_(batch.seq_lens)
        self.slot_mapping[:b].copy_(batch.slot_mapping)
        self.block_tables[:b, :w].copy_(batch.block_tables)
        self.block_tables[:b, w:].zero_()
        if n > b:  # padding rows: a harmless one-token sequence writing the reserved slot
            self.token_ids[b:n].zero_()
            self.positions[b:n].zero_()
            self.seq_lens[b:n].fill_(1)
            self.slot_mapping[b:n].fill_(self.pad_slot)
            self.block_tables[b:n].zero_()
        graph = self.graphs.get((n, variant(plan)))
        if graph is not None:
            graph.replay()
        else:
            self._eager(n, variant(plan))
