"""Captured decode steps, per batch-size bucket (CUDA graphs; NPU graphs on Ascend).

A graph replays fixed addresses and shapes, so a decode-only launch of B rows runs the
graph of the smallest bucket >= B over the scratch pool's own input tensors: rows past B are
padding (token 0, position 0, length 1) that write their K/V into a reserved slot outside
every allocatable block, and block tables are read at the widest width. The same padding runs
eagerly on the CPU, which is how its logic is tested here. Launches with prompt tokens run
eagerly.

A decode step is one replay, the sampler included: each bucket has a graph that samples greedily
and one that runs every sampling stage (a row's draw does not depend on which stages its batch
runs, so the widest plan gives every row its own token). Launches that also want logprobs or
apply a grammar replay a third graph, the forward alone, and sample eagerly after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from fusedserve.kernels.forward_batch import ForwardBatch
from fusedserve.kernels.kv_cache import PagedKVCache
from fusedserve.shared_memory.sampling_row import SamplingPlan
from fusedserve.worker.model.qwen3 import Qwen3Model
from fusedserve.worker.model.workspace import Workspace

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
    """Bucketed, padded decode over the scratch pool's own input tensors; captured as device
    graphs where the device has them.

    A launch's inputs are already where a graph reads them: the runtime copied them into the
    pool (rows [:B], a block table's [:B, :W] corner), so a replay needs no copy, only the padding
    rows [B:bucket) filled in (and nothing at all when B is a bucket)."""

    def __init__(self, model: Qwen3Model, kv: PagedKVCache, ws: Workspace, logits: torch.Tensor,
                 inputs: dict[str, torch.Tensor], pad_slot: int, sample: Sample, capture: bool = True):
        """``inputs``: the pool's full tensors of the forward's slots (token_ids, positions,
        slot_mapping, query_start_loc, seq_lens, block_tables)."""
        self.model, self.kv, self.ws, self.logits, self.sample = model, kv, ws, logits, sample
        self.inputs = inputs
        max_batch = inputs["seq_lens"].shape[0]
        self.buckets = batch_buckets(max_batch)
        self.pad_slot = pad_slot
        self.graphs: dict[tuple[int, SamplingPlan | None], object] = {}
        self._pad(0, max_batch)  # the warm-up and capture rows: each a harmless one-token sequence
        api = _graph_api(model.device) if capture else None
        if api is not None:
            self._capture(*api)

    def _batch(self, n: int) -> ForwardBatch:
        v = self.inputs
        return ForwardBatch(v["token_ids"][:n], v["positions"][:n], v["slot_mapping"][:n],
                            v["query_start_loc"][: n + 1], v["seq_lens"][:n], v["block_tables"][:n],
                            num_decode=n)

    def _eager(self, n: int, plan: SamplingPlan | None) -> None:
        self.model.forward(self._batch(n), self.kv, self.ws, self.logits[:n])
        if plan is not None:
            self.sample(n, plan)

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

    def _pad(self, b: int, n: int) -> None:
        """Rows [b, n) as padding: token 0 at position 0, one token of context, K/V into the
        reserved slot, block 0 (never read past the one token)."""
        v = self.inputs
        v["token_ids"][b:n].zero_()
        v["positions"][b:n].zero_()
        v["seq_lens"][b:n].fill_(1)
        v["slot_mapping"][b:n].fill_(self.pad_slot)
        v["block_tables"][b:n].zero_()
        qsl = v["query_start_loc"]
        torch.arange(b + 1, n + 1, dtype=qsl.dtype, device=qsl.device, out=qsl[b + 1 : n + 1])

    def run(self, b: int, plan: SamplingPlan | None) -> None:
        """The decode-only launch of ``b`` rows in the pool; rows [:b] of ``logits`` are valid
        afterwards, and with a ``plan`` the first b sampled ids too (padding rows sample into the
        rows past them). A block table's columns past the launch's width hold earlier launches'
        blocks, never read: each row reads only its own ``seq_lens``."""
        n = self.bucket(b)
        if n > b:
            self._pad(b, n)
        graph = self.graphs.get((n, variant(plan)))
        if graph is not None:
            graph.replay()
        else:
            self._eager(n, variant(plan))
