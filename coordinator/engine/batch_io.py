"""Coordinator side of the argument contract: write a step's inputs, read its outputs.

Inputs go straight into the worker's arena views (no intermediate buffers); the
outputs are read back as numpy views of the same shared memory, valid until the
next launch on that arena.
"""

from __future__ import annotations

import numpy as np
import torch

from coordinator.engine.scheduler import StepBatch
from coordinator.engine.step_outputs import DecodeResult
from coordinator.sampling_params import RowKind
from shared_memory.arena import HostArena
from shared_memory.contract import LaunchDescriptor


def _put(arena: HostArena, name: str, values: np.ndarray) -> None:
    arena.view(name, values.shape).copy_(torch.from_numpy(np.ascontiguousarray(values)))


def write_batch(arena: HostArena, batch: StepBatch, step: int, k: int, vocab: int,
                hidden: int) -> LaunchDescriptor:
    topk_rows = np.asarray([i for i, r in enumerate(batch.row_kinds) if r == RowKind.TOPK],
                           dtype=np.int64)
    full_rows = np.asarray([i for i, r in enumerate(batch.row_kinds) if r == RowKind.FULL],
                           dtype=np.int64)
    dims = {"B": batch.batch_size, "NT": len(topk_rows), "NF": len(full_rows),
            "K": k, "V": vocab, "D": hidden}
    _put(arena, "topk_rows", topk_rows)
    _put(arena, "full_rows", full_rows)
    _write_sampling(arena, batch, dims)
    if batch.kind == "prefill":
        prefix = batch.prefix_slots if batch.prefix_slots is not None else np.zeros(0, dtype=np.int64)
        dims["T"], dims["TP"] = len(batch.token_ids), len(prefix)
        _put(arena, "prefill_token_ids", batch.token_ids)
        _put(arena, "prefill_positions", batch.positions)
        _put(arena, "prefill_slot_mapping", batch.slot_mapping)
        _put(arena, "prefill_prefix_slots", prefix)
        dims["BD"], dims["W"] = batch.num_decode, 0
        if batch.num_decode:
            assert batch.block_tables is not None and batch.seq_lens is not None
            dims["W"] = batch.block_tables.shape[1]
            _put(arena, "prefill_block_tables", batch.block_tables)
            _put(arena, "prefill_seq_lens", batch.seq_lens)
            _put(arena, "prefill_feed_rows", _feed(batch, batch.num_decode))
        prefix_lens = list(batch.prefix_lens) or [0] * batch.batch_size
        return LaunchDescriptor("prefill", dims, step, ctx_len=batch.ctx_len,
                                cu_seqlens=list(batch.cu_seqlens), prefix_lens=prefix_lens,
                                num_decode=batch.num_decode)
    assert batch.block_tables is not None and batch.seq_lens is not None
    dims["W"] = batch.block_tables.shape[1]
    _put(arena, "token_ids", batch.token_ids)
    _put(arena, "feed_rows", _feed(batch, batch.batch_size))
    _put(arena, "positions", batch.positions)
    _put(arena, "seq_lens", batch.seq_lens)
    _put(arena, "slot_mapping", batch.slot_mapping)
    _put(arena, "block_tables", batch.block_tables)
    return LaunchDescriptor("decode", dims, step, ctx_len=batch.ctx_len)


def _feed(batch: StepBatch, rows: int) -> np.ndarray:
    if batch.feed_rows is None:
        return np.full(rows, -1, dtype=np.int32)
    return batch.feed_rows


def _write_sampling(arena: HostArena, batch: StepBatch, dims: dict[str, int]) -> None:
    """Device sampling's per-row settings, and which rows want logprobs (and how many)."""
    b = batch.batch_size
    f32 = np.zeros((b, 4), dtype=np.float32)
    seeds = np.zeros((b, 2), dtype=np.int64)
    rows, n = [], 0
    for i, (seq, kind) in enumerate(zip(batch.seqs, batch.row_kinds)):
        if kind != RowKind.DEVICE or seq is None:
            continue
        p = seq.params
        try:
            f32[i] = (p.temperature, p.top_p, p.min_p, p.top_k)
            step = batch.draw_steps[i] if batch.draw_steps else len(seq.output_ids)
            seeds[i] = (p.seed & 0x7FFF_FFFF_FFFF_FFFF, step)
        except (TypeError, ValueError, OverflowError):  # a bug past validation: this row alone fails
            f32[i], seeds[i] = 0, 0
            batch.row_kinds[i] = RowKind.INVALID
            continue
        if p.logprobs:
            rows.append(i)
            n = max(n, p.top_logprobs)
    dims["NL"], dims["N"] = len(rows), n
    _put(arena, "sampling_params", f32)
    _put(arena, "sampling_seeds", seeds)
    _put(arena, "logprob_rows", np.asarray(rows, dtype=np.int64))


def read_result(arena: HostArena, desc: LaunchDescriptor) -> DecodeResult:
    d = desc.dims
    topk_rows = arena.view("topk_rows", (d["NT"],)).tolist()
    full_rows = arena.view("full_rows", (d["NF"],)).tolist()
    nl, n = d.get("NL", 0), d.get("N", 0)
    return DecodeResult(
        logprob_rows=arena.view("logprob_rows", (nl,)).tolist(),
        sampled_logprobs=arena.view("sampled_logprobs", (nl,)).numpy() if nl else None,
        top_logprob_ids=arena.view("top_logprob_ids", (nl, n)).numpy() if nl and n else None,
        top_logprob_values=arena.view("top_logprob_values", (nl, n)).numpy() if nl and n else None,
        step=desc.step,
        sampled_ids=arena.view("sampled_ids", (d["B"],)).numpy(),
        topk_values=arena.view("topk_values", (d["NT"], d["K"])).numpy() if d["NT"] else None,
        topk_ids=arena.view("topk_ids", (d["NT"], d["K"])).numpy() if d["NT"] else None,
        topk_rows=topk_rows,
        logits=arena.view("logits_rows", (d["NF"], d["V"])).numpy() if d["NF"] else None,
        full_rows=full_rows,
    )
