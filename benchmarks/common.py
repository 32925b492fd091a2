"""Shared pieces of the benchmarks: the checkpoint, machine facts, memory bandwidth."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

from kernels.model.default_model import default_model_dir

PRESET = "benchmark"


def checkpoint() -> Path:
    """The project-written benchmark checkpoint (~440 MB bf16: well past the CPU caches)."""
    return default_model_dir(PRESET)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, Python {platform.python_version()}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, device: str = "cpu") -> float:
    """Best read+write bandwidth of a large tensor copy on ``device``, in bytes/s."""
    dev = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, device: str = "cpu") -> float:
    """Best read bandwidth of a large reduction on ``device`` (what a decode step mostly
    does), bytes/s."""
    dev = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    best = float("inf")
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        src.sum()
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[i]
