"""The host side of a launch, alone: the launch runtime around a step that does nothing.

    python -m fusedserve.benchmarks.launch_overhead [--device cpu|cuda] [--launches 2000] [--batch 1]

A decode launch at Qwen3's vocabulary (151,936) and 64 rows of capacity: its HOST_SHARED
inputs copied in, the (empty) step, its ids copied back, counted, and on CUDA the one event
waited on. What it prints is what every launch costs before the model runs, per launch, the
median of 3 runs (with their range). On a GPU, ``fusedserve.benchmarks.cuda_profile``'s launch minus replay
adds the id feed and the graph launch to it.
"""

from __future__ import annotations

import argparse
import statistics
import time

from fusedserve.benchmarks.common import machine
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.engine_config import EngineConfig
from fusedserve.shared_memory.slots import step_table
from fusedserve.worker.launch_runtime import LaunchRuntime
from fusedserve.worker.scratch_pool import DeviceScratchPool


def run(device: str = "cpu", launches: int = 2000, batch: int = 1) -> dict:
    cfg = EngineConfig.build(max_batch=64, max_model_len=4096, block_size=16, num_blocks=1024)
    max_dims = cfg.max_dims(151936)
    table = step_table()
    arena = HostArena.create(table, max_dims, tag="overhead")
    try:
        runtime = LaunchRuntime(table, arena, DeviceScratchPool(table, max_dims, device))
        dims = dict.fromkeys(max_dims, 0) | {"B": batch, "B1": batch + 1, "T": batch, "W": 9,
                                            "V": max_dims["V"]}
        for _ in range(200):  # warm-up: the copy plan, the allocator, the event
            runtime.launch(dims, lambda v: None)
        per_launch = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(launches):
                runtime.launch(dims, lambda v: None)
            per_launch.append((time.perf_counter() - t0) / launches * 1e6)
        runtime.close()
    finally:
        arena.close()
    return {"device": device, "batch": batch, "us_per_launch": statistics.median(per_launch),
            "range_us": [min(per_launch), max(per_launch)], "machine": machine()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--launches", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    res = run(args.device, args.launches, args.batch)
    lo, hi = res["range_us"]
    print(f"{res['machine']}\nhost side of a launch ({args.device}, batch {args.batch}): "
          f"{res['us_per_launch']:.1f} us ({lo:.1f}-{hi:.1f}), median of 3 x {args.launches} launches")
    return res


if __name__ == "__main__":
    main()
