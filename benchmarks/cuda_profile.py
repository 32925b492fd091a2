"""Where a CUDA decode launch spends its time: the captured graph's replay against the whole
launch path (arena copies, id feed, device sampling, counted copy-back), and how many
kernels one replay runs. A replay far above the weights' read time with thousands of
kernels means the step is bound by kernel count, not bandwidth: fusing is the remedy.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.decode_step import greedy_batch
from coordinator.engine.batch_io import write_batch
from kernels.model.qwen3 import Qwen3Model
from shared_memory.arena import HostArena
from shared_memory.contract import RunnerConfig
from shared_memory.slots import step_table
from worker.model_runner import ModelRunner, model_dims


def _gpu_ms(fn, n: int = 50) -> float:
    """Mean GPU milliseconds of ``fn`` over ``n`` calls (CUDA events, after a warm-up)."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _kernels(fn) -> int:
    """CUDA kernels one call of ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "cuda" in str(e.device_type).lower())


def run(model_dir: str, batches: list[int], context: int = 128, calls: int = 50) -> list[dict]:
    model = Qwen3Model.from_pretrained(model_dir, "bfloat16", "cuda", max_model_len=context + 32)
    c, bs = model.config, 16
    per_seq = -(-(context + 2) // bs)
    rc = RunnerConfig(max_batch=max(batches), block_size=bs, num_blocks=max(batches) * per_seq, top_k=64)
    arena = HostArena.create(step_table(), model_dims(model, rc), tag="profile")
    try:
        runner = ModelRunner(model, rc, arena)
        graphs = runner.graphs
        rows = []
        for b in batches:
            tables = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)
            desc = write_batch(arena, greedy_batch(tables, context, bs), 0, rc.top_k, c.vocab_size)
            replay = graphs.graphs[graphs.bucket(b)].replay
            for _ in range(5):
                runner.execute(desc)
            t0 = time.perf_counter()
            for _ in range(calls):
                runner.execute(desc)
            launch_ms = (time.perf_counter() - t0) / calls * 1e3
            rows.append({"batch": b, "replay_ms": _gpu_ms(replay, calls), "launch_ms": launch_ms,
                         "kernels_per_replay": _kernels(replay)})
        return rows
    finally:
        arena.close()
