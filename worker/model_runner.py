"""Runs prefill/decode launches for one device through the argument contract.

The runner owns what lives on the device (weights, paged KV cache, decode
workspace, scratch pool) and executes ``LaunchDescriptor``s against the host arena
bank the coordinator wrote. It is used in-process by the offline engine and inside
each Ray worker actor. Launches run in the order they arrive, so the ids one launch
samples are still in the pool's ``sampled_ids`` when the next one starts: rows whose
input the coordinator has not read yet are fed from there (``feed_rows``).
"""

from __future__ import annotations

import torch

from kernels import sampler
from kernels.model.qwen3 import Qwen3Model, SampleOutputs
from kernels.sampler import RowParams
from shared_memory.arena import HostArena
from shared_memory.contract import LaunchDescriptor, RunnerConfig, slot_tables
from shared_memory.runtime import DeviceScratchPool, LaunchRecord, LaunchRuntime
from worker.graphs import DecodeGraphs


def model_dims(model: Qwen3Model, rc: RunnerConfig) -> dict[str, int]:
    """``rc.max_dims`` for this model: what its arena and scratch pool are sized for."""
    c = model.config
    return rc.max_dims(c.vocab_size, c.hidden_size, model.max_model_len)


class ModelRunner:
    def __init__(self, model: Qwen3Model, rc: RunnerConfig, arenas: HostArena | list[HostArena]):
        self.model = model
        self.rc = rc
        self.tables = slot_tables(model.dtype)
        self.max_dims = model_dims(model, rc)
        # One spare block beyond the allocatable ones: graph padding rows write there.
        self.kv = model.new_kv_cache(rc.num_blocks + 1, rc.block_size)
        hidden = torch.empty(rc.max_batch, model.config.hidden_size, dtype=model.dtype,
                             device=model.device)
        self.ws = model.new_workspace(rc.max_batch, rc.block_size, rc.top_k, hidden=hidden)
        self.pool = DeviceScratchPool(self.tables, self.max_dims, model.device,
                                      adopt={"next_hidden": hidden})
        self.runtime = LaunchRuntime(self.tables, arenas, self.pool)
        dev = model.device  # the feed's scratch: no allocation per launch
        self._feed_idx = torch.zeros(rc.max_batch, dtype=torch.int32, device=dev)
        self._feed_ids = torch.zeros(rc.max_batch, dtype=torch.int32, device=dev)
        self._feed_mask = torch.zeros(rc.max_batch, dtype=torch.bool, device=dev)
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
                                       pad_slot=rc.pad_slot,
                                       capture=rc.graphs == "auto")
        elif rc.graphs not in ("auto", "off"):
            raise ValueError(f"graphs must be auto, padded or off, got {rc.graphs!r}")
        self.warmup()

    def warmup(self) -> None:
        """One throwaway decode on the pool (K/V into the spare slot): first-call costs
        (kernel selection, page faults in the workspace) happen before the first request."""
        dev = self.model.device
        one = torch.ones(1, dtype=torch.int32, device=dev)
        zero = torch.zeros(1, dtype=torch.int32, device=dev)
        self.model.decode_step(zero, zero, zero.view(1, 1), one,
                               torch.tensor([self.rc.pad_slot], device=dev), self.kv, self.ws,
                               self.outputs, ctx_len=self.rc.block_size)

    def execute(self, desc: LaunchDescriptor) -> LaunchRecord:
        steps = {"decode": self._decode, "prefill": self._prefill}
        if desc.table in steps:
            run = steps[desc.table]
            return self.runtime.launch(desc.table, desc.dims, lambda v, d: run(v, d, desc), desc.bank)
        raise ValueError(f"unknown launch table {desc.table!r}")

    def _feed(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """``ids[r] = previous launch's sampled_ids[rows[r]]`` where ``rows[r] >= 0``."""
        n = rows.shape[0]
        if n == 0:
            return
        idx, vals, mask = self._feed_idx[:n], self._feed_ids[:n], self._feed_mask[:n]
        torch.clamp(rows, min=0, out=idx)
        torch.index_select(self.outputs.greedy_ids, 0, idx, out=vals)
        torch.ge(rows, 0, out=mask)
        torch.where(mask, vals, ids[:n], out=ids[:n])

    def _decode(self, v: dict[str, torch.Tensor], dims: dict[str, int], desc: LaunchDescriptor) -> None:
        self._feed(v["token_ids"], v["feed_rows"])
        args = (v["token_ids"], v["positions"], v["block_tables"], v["seq_lens"], v["slot_mapping"])
        if self.graphs is not None:
            self.graphs.run(*args)
        else:
            self.model.decode_step(*args, self.kv, self.ws, self.outputs, ctx_len=desc.ctx_len,
                                   want_topk=dims["NT"] > 0)
        self._gather_rows(v, dims)

    def _prefill(self, v: dict[str, torch.Tensor], dims: dict[str, int], desc: LaunchDescriptor) -> None:
        self._feed(v["prefill_token_ids"], v["prefill_feed_rows"])  # decode rows come first
        self.model.prefill(
            v["prefill_token_ids"], v["prefill_positions"], desc.cu_seqlens,
            v["prefill_slot_mapping"], self.kv, self.ws, self.outputs, want_topk=dims["NT"] > 0,
            prefix_lens=desc.prefix_lens or None, prefix_slots=v["prefill_prefix_slots"],
            num_decode=desc.num_decode, block_tables=v["prefill_block_tables"],
            seq_lens=v["prefill_seq_lens"], ctx_len=desc.ctx_len,
        )
        self._gather_rows(v, dims)

    def _gather_rows(self, v: dict[str, torch.Tensor], dims: dict[str, int]) -> None:
        """Sample on the device, and compact the rows that need candidates or logits."""
        b = dims["B"]
        if self.rc.device_sampling:
            logits = self.outputs.logits[:b]
            sampler.sample(logits, RowParams(v["sampling_params"], v["sampling_seeds"]),
                                   v["sampled_ids"], argmax_done=True)
            sampler.logprobs(logits, v["logprob_rows"], v["sampled_ids"], dims["N"],
                                     v["sampled_logprobs"], v["top_logprob_ids"], v["top_logprob_values"])
        if dims["NT"]:
            torch.index_select(v["all_topk_values"], 0, v["topk_rows"], out=v["topk_values"])
            torch.index_select(v["all_topk_ids"], 0, v["topk_rows"], out=v["topk_ids"])
        if dims["NF"]:
            torch.index_select(self.outputs.logits[:b], 0, v["full_rows"], out=v["logits_rows"])
