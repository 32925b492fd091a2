"""Which GEMM runs a projection at each launch size, measured on this host at load.

The native kernels stream packed weights through vector FMAs (``vdpbf16ps``, VNNI): the fastest
where a launch is bound by reading the weights, as decode at small batches is. From some rows up
a launch is compute-bound, and a matrix engine can be several times faster: AMX-BF16/AMX-INT8 on
Intel Xeons since Sapphire Rapids, which torch reaches through oneDNN (``torch.mm`` on bf16,
``torch._int_mm`` on int8). Where the crossover lies, or whether there is one, depends on the
host (AMD Zen 4 has no AMX: its oneDNN runs the same AVX-512 as ours, slower at every size), so
each weight kind and shape is timed once, native against matrix, at every row bucket, and the
result is cached per host (CPU model, instruction set, threads, torch) in ``$FUSEDSERVE_CACHE/gemm``
(default ``~/.cache/fusedserve``, the embedded models' home). A model is its shapes: a second
load of the same model, or of any model sharing its shapes, measures nothing.

Numerics. int8: the matrix path quantizes rows and scales the int32 sums with the native
kernel's own code (``quantize_rows_i8``, ``scale_int32``), and int32 sums are exact, so its
output equals the native kernel's bit for bit: a row's output never depends on the kernel its
launch took. bf16: both paths multiply bf16 exactly and sum in fp32, in different orders, so
they may differ in the last bits of fp32 sums (bound tested: 1e-5 x K x max|x| max|w|). A
row's draws then depend on the bucket of its launch's size; ``mode="native"`` (``--cpu-gemm
native``) keeps every 16-bit launch on the native kernel for bit-exact batch invariance.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.native import cpu_flags, cpu_generation, cpu_model

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # rows past the last take its choice
HEAD_ROWS = 128  # an lm_head runs on the rows that need logits: at most a batch of them
MARGIN = 1.1  # the matrix path must be this much faster: noise must not flip a choice
REPEATS = 3  # timed runs per kernel and bucket (median), after one warm-up
MODES = ("auto", "native")


def bucket(rows: int) -> int:
    """The index in ``ROW_BUCKETS`` whose choice a launch of ``rows`` rows takes: the smallest
    bucket holding it (1, 2, 3-4, 5-8, ...), the last for anything larger."""
    return min(max(rows - 1, 0).bit_length(), len(ROW_BUCKETS) - 1)


@dataclass(frozen=True)
class GemmTiming:
    """One shape's measurement: seconds per call at each bucket, native and matrix."""

    native_s: tuple[float, ...]
    matrix_s: tuple[float, ...]

    @property
    def choice(self) -> tuple[bool, ...]:
        """Per bucket: whether the matrix path runs it: faster by ``MARGIN`` there and at every
        larger bucket (a compute-bound GEMM only gains on a matrix engine as rows grow, so an
        isolated win between losses is noise, and a choice never flips back and forth)."""
        wins = [m * MARGIN < n for n, m in zip(self.native_s, self.matrix_s)]
        return tuple(all(wins[i:]) for i in range(len(wins)))


def host_key(isa: str, threads: int) -> str:
    """What makes a timing valid elsewhere: the CPU (its model name, and its family, model and
    flags, which tell apart CPUs a hypervisor names alike), the build's ISA, threads, torch."""
    flags = ",".join(sorted(cpu_flags()))
    raw = (f"{cpu_model()}|{cpu_generation()}|{flags}|{isa}|{threads}|{torch.__version__}|"
           f"{torch.backends.cpu.get_cpu_capability()}")
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("FUSEDSERVE_CACHE") or Path.home() / ".cache" / "fusedserve") / "gemm"


@dataclass
class GemmChooser:
    """Times and remembers, per (kind, K, N), which GEMM wins at each row bucket on this host."""

    isa: str
    threads: int
    path: Path | None = None  # the host's cache file; None: ``cache_dir()/<host>.json``
    timings: dict[str, GemmTiming] = field(default_factory=dict)
    measured_s: float = 0.0  # time spent measuring in this process

    def __post_init__(self) -> None:
        if self.path is None:
            self.path = cache_dir() / f"{host_key(self.isa, self.threads)}.json"
        try:
            raw = json.loads(self.path.read_text())
            self.timings = {k: GemmTiming(tuple(v["native_s"]), tuple(v["matrix_s"])) for k, v in raw.items()}
        except (OSError, ValueError, KeyError, TypeError):
            self.timings = {}

    def choose(self, kind: str, k: int, n: int, max_rows: int,
               native: Callable[[torch.Tensor, torch.Tensor], object],
               matrix: Callable[[torch.Tensor, torch.Tensor], object],
               act_dtype: torch.dtype) -> tuple[bool, ...]:
        """Per bucket up to ``max_rows``' (later buckets: the last measured one's choice), whether
        the matrix path runs it. ``native(x, out)`` and ``matrix(x, out)`` each compute one
        launch; they are timed only where this host has no cached timing for the shape."""
        key = f"{kind}:{k}x{n}:rows{max_rows}"
        timing = self.timings.get(key)
        if timing is None:
            timing = self._measure(k, n, max_rows, native, matrix, act_dtype)
            self.timings[key] = timing
            self._save()
            log.info("measured %s K=%d N=%d: %s", kind, k, n, describe(timing))
        choice = timing.choice
        return choice + (choice[-1],) * (len(ROW_BUCKETS) - len(choice))

    def _measure(self, k: int, n: int, max_rows: int, native, matrix, act_dtype: torch.dtype) -> GemmTiming:
        start = time.perf_counter()
        buckets = [r for r in ROW_BUCKETS if r <= max_rows] or [1]
        g = torch.Generator().manual_seed(0)
        x_all = torch.randn(buckets[-1], k, generator=g).to(act_dtype)
        out_all = torch.empty(buckets[-1], n, dtype=act_dtype)
        native_s, matrix_s = [], []
        for rows in buckets:
            x, out = x_all[:rows], out_all[:rows]
            native_s.append(_median_time(native, x, out))
            try:
                matrix_s.append(_median_time(matrix, x, out))
            except (RuntimeError, NotImplementedError) as exc:  # this build's oneDNN lacks the shape
                log.info("matrix GEMM unavailable for K=%d N=%d rows=%d: %s", k, n, rows, exc)
                matrix_s.append(float("inf"))
        self.measured_s += time.perf_counter() - start
        return GemmTiming(tuple(native_s), tuple(matrix_s))

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({k: {"native_s": v.native_s, "matrix_s": v.matrix_s}
                                       for k, v in self.timings.items()}, indent=1))
            tmp.replace(self.path)  # atomic: concurrent workers never read half a file
        except OSError as exc:
            log.warning("GEMM timings not cached (%s): the next load measures again", exc)


def describe(t: GemmTiming) -> str:
    """Which path each bucket took, with the speed ratio (native time / matrix time)."""
    parts = [f"{ROW_BUCKETS[i]}:{'matrix' if c else 'native'} x{n / m:.2f}"
             for i, (c, n, m) in enumerate(zip(t.choice, t.native_s, t.matrix_s))]
    return ", ".join(parts)


def _median_time(fn: Callable[[torch.Tensor, torch.Tensor], object], x: torch.Tensor,
                 out: torch.Tensor) -> float:
    fn(x, out)
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(x, out)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
