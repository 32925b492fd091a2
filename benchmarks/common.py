"""Shared pieces of the benchmarks: the checkpoint, machine facts, memory bandwidth."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fusedserve.coordinator.model_files.default_model import default_model_dir
from fusedserve.kernels.native.build import cpu_flags, cpu_generation, cpu_model

PRESET = "benchmark"


def checkpoint() -> Path:
    """The project-written benchmark checkpoint (~440 MB bf16: well past the CPU caches)."""
    return default_model_dir(PRESET)


def machine() -> str:
    return (f"{cpu_model()} ({cpu_generation()}), {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, Python {platform.python_version()}")


# The CPU features that decide which kernels win, in the words the report uses.
ISA_FEATURES = (("AMX-BF16", "amx_bf16"), ("AMX-INT8", "amx_int8"), ("AVX-512 FP16", "avx512_fp16"),
                ("AVX-512 BF16", "avx512_bf16"), ("AVX-512 VNNI", "avx512_vnni"), ("AVX-512", "avx512f"),
                ("AVX-VNNI", "avx_vnni"), ("AVX2", "avx2"))


def isa_line() -> str:
    """What this CPU has and lacks of ``ISA_FEATURES`` (AMX named either way): e.g. "AVX-512 BF16,
    AVX-512 VNNI, AVX-512, AVX-VNNI, AVX2; no AMX"."""
    flags = cpu_flags()
    have = [name for name, flag in ISA_FEATURES if flag in flags]
    amx = "AMX" if "amx_tile" in flags else "no AMX"
    return f"{', '.join(have) or 'no vector extensions'}; {amx}"


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


RUNS = 3  # every figure: the median of at least this many runs, with their min and max


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements (at least ``RUNS``)."""
    if len(values) < RUNS:
        raise ValueError(f"{len(values)} runs: a figure needs at least {RUNS}")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def repeat(fn: Callable[[], float], runs: int = RUNS) -> dict[str, float]:
    """``spread`` of ``runs`` calls of ``fn``."""
    return spread([fn() for _ in range(runs)])


def fmt(s: dict[str, float] | float, spec: str = ".1f") -> str:
    """``median (min-max)``, as the tables print a figure (a stored single figure as is)."""
    if not isinstance(s, dict):
        return f"{s:{spec}}"
    return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"


def median(s: dict[str, float] | float) -> float:
    return s["median"] if isinstance(s, dict) else s


def emit(res: dict, table: list[str], path: Path | None) -> dict:
    """Print a benchmark's table and keep its results as JSON in ``path`` (if given)."""
    for line in table:
        print(line)
    if path is not None:
        path.write_text(json.dumps(res, indent=1))
    return res
