"""Captured decode steps, one per batch-size bucket (CUDA graphs; NPU graphs on Ascend).

A graph replays fixed addresses and shapes, so a decode-only launch of B rows runs the
graph of the smallest bucket >= B: rows past B are padding (token 0, position 0, length 1)
that write their K/V into a reserved slot outside every allocatable block, and block
tables are padded to the widest table. The same padding runs eagerly on the CPU, which
is how its logic is tested here. Launches with prompt tokens run eagerly.
"""

from __future__ import annotations

import logging

import torch

from kernels.forward_batch import ForwardBatch
from kernels.kv_cache import PagedKVCache
from kernels.model.qwen3 import Qwen3Model
from kernels.model.workspace import Workspace

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to ``max_batch`` (vLLM's capture sizes)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


def _graph_api(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.CUDAGraph, torch.cuda.graph
    if device.type == "npu":  # pragma: no cover - needs Ascend hardware
        return torch.npu.NPUGraph, torch.npu.graph  # type: ignore[attr-defined]
    return None


class DecodeGraphs:
    """Bucketed, padded decode; captured as device graphs where the device has them."""

    def __init__(self, model: Qwen3Model, kv: PagedKVCache, ws: Workspace, logits: torch.Tensor,
                 max_batch: int, pad_slot: int, capture: bool = True):
        self.model, self.kv, self.ws, self.logits = model, kv, ws, logits
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
        self.graphs: dict[int, object] = {}
        api = _graph_api(dev) if capture else None
        if api is not None:
            self._capture(*api)

    def _eager(self, b: int) -> None:
        batch = ForwardBatch(self.token_ids[:b], self.positions[:b], self.slot_mapping[:b],
                             self.query_start_loc[: b + 1], self.seq_lens[:b], self.block_tables[:b],
                             num_decode=b)
        self.model.forward(batch, self.kv, self.ws, self.logits[:b])

    def _capture(self, graph_cls, graph_ctx) -> None:
        for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its pool
            self._eager(b)  # warm up kernels and workspaces outside capture
            g = graph_cls()
            with graph_ctx(g):
                self._eager(b)
            self.graphs[b] = g
        log.info("captured decode graphs for buckets %s", self.buckets)

    def bucket(self, b: int) -> int:
        for size in self.buckets:
            if size >= b:
                return size
        raise ValueError(f"batch {b} exceeds the largest bucket {self.buckets[-1]}")

    def run(self, batch: ForwardBatch) -> None:
        """A decode-only batch of B rows; rows [:B] of ``logits`` are valid afterwards."""
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
        graph = self.graphs.get(n)
        if graph is not None:
            graph.replay()
        else:
            self._eager(n)
