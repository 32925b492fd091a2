"""Runs prefill/decode launches for one device through the argument contract.

The runner owns what lives on the device (weights, paged KV cache, decode
workspace, scratch pool) and executes ``LaunchDescriptor``s against the host arena
the coordinator wrote. It is used in-process by the offline engine and inside
each Ray worker actor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.model import Qwen3Model, SampleOutputs
from shared_memory.arena import HostArena
from shared_memory.runtime import DeviceScratchPool, LaunchRecord, LaunchRuntime
from shared_memory.slots import SlotTable, decode_table, prefill_table
from worker.graphs import DecodeGraphs


@dataclass(frozen=True)
class RunnerConfig:
    max_batch: int = 16
    block_size: int = 16
    num_blocks: int = 256
    top_k: int = 64  # device-side candidates per stochastic row
    max_prefill_tokens: int = 4096
    # "auto": capture decode graphs per batch bucket where the device has graphs (CUDA, NPU);
    # "padded": the same bucketed, padded decode run eagerly (any device); "off": exact shapes.
    graphs: str = "auto"

    def max_dims(self, model: Qwen3Model) -> dict[str, int]:
        return launch_max_dims(self, model.config.vocab_size, model.config.hidden_size,
                               model.max_model_len)


def launch_max_dims(rc: RunnerConfig, vocab: int, hidden: int, max_model_len: int) -> dict[str, int]:
    """The largest dims any launch may use; arena and pool are sized from these."""
    return {
        "B": rc.max_batch,
        "W": -(-max_model_len // rc.block_size),
        "T": max(rc.max_prefill_tokens, max_model_len),
        "NT": rc.max_batch,
        "NF": rc.max_batch,
        "K": rc.top_k,
        "V": vocab,
        "D": hidden,
    }


@dataclass
class LaunchDescriptor:
    """The per-step control message: small, msgpack-able; tensors stay in the arena."""

    table: str  # "prefill" | "decode"
    dims: dict[str, int]
    step: int
    ctx_len: int = 0
    cu_seqlens: list[int] = field(default_factory=list)

    def to_wire(self) -> dict:
        return {"table": self.table, "dims": self.dims, "step": self.step,
                "ctx_len": self.ctx_len, "cu_seqlens": self.cu_seqlens}

    @classmethod
    def from_wire(cls, d: dict) -> LaunchDescriptor:
        return cls(d["table"], dict(d["dims"]), d["step"], d.get("ctx_len", 0),
                   list(d.get("cu_seqlens", [])))


def slot_tables(model: Qwen3Model) -> list[SlotTable]:
    return [prefill_table(model.dtype), decode_table(model.dtype)]


class ModelRunner:
    def __init__(self, model: Qwen3Model, rc: RunnerConfig, arena: HostArena):
        self.model = model
        self.rc = rc
        self.tables = slot_tables(model)
        self.max_dims = rc.max_dims(model)
        # One spare block beyond the allocatable ones: graph padding rows write there.
        self.kv = model.new_kv_cache(rc.num_blocks + 1, rc.block_size)
        hidden = torch.empty(rc.max_batch, model.config.hidden_size, dtype=model.dtype,
                             device=model.device)
        self.ws = model.new_workspace(rc.max_batch, rc.block_size, rc.top_k, hidden=hidden)
        self.pool = DeviceScratchPool(self.tables, self.max_dims, model.device,
                                      adopt={"next_hidden": hidden})
        self.runtime = LaunchRuntime(self.tables, arena, self.pool)
        self.outputs = SampleOutputs(
            greedy_ids=self.pool.full("sampled_ids"),
            topk_values=self.pool.full("all_topk_values"),
            topk_ids=self.pool.full("all_topk_ids"),
            logits=self.pool.full("logits"),
        )
        self.graphs: DecodeGraphs | None = None
        has_graphs = model.device.type in ("cuda", "npu")
        if rc.graphs == "padded" or (rc.graphs == "auto" and has_graphs):
            self.graphs = DecodeGraphs(model, self.kv, self.ws, self.outputs, rc.max_batch,
                                       pad_slot=rc.num_blocks * rc.block_size,
                                       capture=rc.graphs == "auto")
        elif rc.graphs not in ("auto", "off"):
            raise ValueError(f"graphs must be auto, padded or off, got {rc.graphs!r}")
        self.pad_slot = rc.num_blocks * rc.block_size
        self.warmup()

    def warmup(self) -> None:
        """One throwaway decode on the pool (K/V into the spare slot): first-call costs
        (kernel selection, page faults in the workspace) happen before the first request."""
        dev = self.model.device
        one = torch.ones(1, dtype=torch.int32, device=dev)
        zero = torch.zeros(1, dtype=torch.int32, device=dev)
        self.model.decode_step(zero, zero, zero.view(1, 1), one,
                               torch.tensor([self.pad_slot], device=dev), self.kv, self.ws,
                               self.outputs, ctx_len=self.rc.block_size)

    def execute(self, desc: LaunchDescriptor) -> LaunchRecord:
        if desc.table == "decode":
            return self.runtime.launch("decode", desc.dims, lambda v, d: self._decode(v, d, desc))
        if desc.table == "prefill":
            return self.runtime.launch("prefill", desc.dims, lambda v, d: self._prefill(v, d, desc))
        raise ValueError(f"unknown launch table {desc.table!r}")

    def _decode(self, v: dict[str, torch.Tensor], dims: dict[str, int], desc: LaunchDescriptor) -> None:
        args = (v["token_ids"], v["positions"], v["block_tables"], v["seq_lens"], v["slot_mapping"])
        if self.graphs is not None:
            self.graphs.run(*args)
        else:
            self.model.decode_step(*args, self.kv, self.ws, self.outputs, ctx_len=desc.ctx_len,
                                   want_topk=dims["NT"] > 0)
        self._gather_rows(v, dims)

    def _prefill(self, v: dict[str, torch.Tensor], dims: dict[str, int], desc: LaunchDescriptor) -> None:
        self.model.prefill(
            v["prefill_token_ids"], v["prefill_positions"], desc.cu_seqlens,
            v["prefill_slot_mapping"], self.kv, self.ws, self.outputs, want_topk=dims["NT"] > 0,
        )
        self._gather_rows(v, dims)

    def _gather_rows(self, v: dict[str, torch.Tensor], dims: dict[str, int]) -> None:
        """Compact the rows that need candidates or logits, on the device."""
        b = dims["B"]
        if dims["NT"]:
            torch.index_select(v["all_topk_values"], 0, v["topk_rows"], out=v["topk_values"])
            torch.index_select(v["all_topk_ids"], 0, v["topk_rows"], out=v["topk_ids"])
        if dims["NF"]:
            torch.index_select(self.outputs.logits[:b], 0, v["full_rows"], out=v["logits_rows"])
