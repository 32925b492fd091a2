"""Which GEMM runs a projection at each launch size, measured on this host at load.

The native kernels stream packed weights through vector FMAs (``vdpbf16ps``, VNNI): the fastest
where a launch is bound by reading the weights, as decode at small batches is. From some rows up
a launch is compute-bound, and a matrix engine can be several times faster: AMX-BF16/AMX-INT8 on
Intel Xeons since Sapphire Rapids, which torch reaches through oneDNN in two ways, both measured:
``onednn``, its matmul (``torch.mm`` on bf16, ``torch._int_mm`` on int8), which reorders the
weight on every call; and ``brgemm``, its batch-reduce micro-kernel (``at::native::cpublas::
brgemm``, what torch's own CPU flash attention runs) over weights repacked once at load into its
VNNI blocks (``kernels/native/csrc/brgemm.cpp``). Where the crossover lies, or whether there is one,
depends on the host (AMD Zen 4 and 5 have no AMX: oneDNN runs AVX-512 there, slower than ours at
every size), so each weight kind and shape is timed once, native against each matrix path, at
every row bucket, and the result is cached per host (CPU model, instruction set, threads, torch)
in ``$FUSEDSERVE_CACHE/gemm`` (default ``~/.cache/fusedserve``, the embedded models' home). A
model is its shapes: a second load of the same model, or of any model sharing its shapes,
measures nothing.

Numerics. int8: the matrix paths quantize rows and scale the int32 sums with the native
kernel's own code (``quantize_rows_i8``, ``scale_int32``), and int32 sums are exact, so their
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

from fusedserve.kernels.native.build import cpu_flags, cpu_generation, cpu_model

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


NATIVE = "native"


@dataclass(frozen=True)
class GemmTiming:
    """One shape's measurement: seconds per call at each bucket, per path (``native`` and the
    matrix paths measured beside it)."""

    seconds: dict[str, tuple[float, ...]]

    @property
    def choice(self) -> tuple[str, ...]:
        """Per bucket, the path that runs it: the fastest matrix path there where it is faster
        than the native kernel by ``MARGIN`` there and at every larger bucket (a compute-bound
        GEMM only gains on a matrix engine as rows grow, so an isolated win between losses is
        noise, and a choice never flips back and forth); else ``native``."""
        native = self.seconds[NATIVE]
        others = {k: v for k, v in self.seconds.items() if k != NATIVE}
        if not others:
            return (NATIVE,) * len(native)
        best = [min(others, key=lambda k, i=i: others[k][i]) for i in range(len(native))]
        wins = [others[b][i] * MARGIN < native[i] for i, b in enumerate(best)]
        return tuple(b if all(wins[i:]) else NATIVE for i, b in enumerate(best))


Kernel = Callable[[torch.Tensor, torch.Tensor], object]  # (x, out): one launch


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
    path: Path | None = None  # the host's cache file; None: ``cache_dir()/<host>.paths.json``
    timings: dict[str, GemmTiming] = field(default_factory=dict)
    measured_s: float = 0.0  # time spent measuring in this process

    def __post_init__(self) -> None:
        if self.path is None:
            self.path = cache_dir() / f"{host_key(self.isa, self.threads)}.paths.json"
        try:
            raw = json.loads(self.path.read_text())
            self.timings = {k: GemmTiming({p: tuple(float(t) for t in ts) for p, ts in v.items()})
                            for k, v in raw.items() if NATIVE in v}
        except (OSError, ValueError, AttributeError, TypeError):
            self.timings = {}

    def choose(self, kind: str, k: int, n: int, max_rows: int, paths: dict[str, Kernel],
               act_dtype: torch.dtype) -> tuple[str, ...]:
        """Per bucket up to ``max_rows``' (later buckets: the last measured one's choice), which
        of ``paths`` runs it (``native`` among them). Each ``path(x, out)`` computes one launch;
        they are timed only where this host has no cached timing for the shape and paths."""
        key = f"{kind}:{k}x{n}:rows{max_rows}"
        timing = self.timings.get(key)
        if timing is None or set(timing.seconds) != set(paths):
            timing = self._measure(k, n, max_rows, paths, act_dtype)
            self.timings[key] = timing
            self._save()
            log.info("measured %s K=%d N=%d: %s", kind, k, n, describe(timing))
        choice = timing.choice
        return choice + (choice[-1],) * (len(ROW_BUCKETS) - len(choice))

    def _measure(self, k: int, n: int, max_rows: int, paths: dict[str, Kernel],
                 act_dtype: torch.dtype) -> GemmTiming:
        start = time.perf_counter()
        buckets = [r for r in ROW_BUCKETS if r <= max_rows] or [1]
        g = torch.Generator().manual_seed(0)
        x_all = torch.randn(buckets[-1], k, generator=g).to(act_dtype)
        out_all = torch.empty(buckets[-1], n, dtype=act_dtype)
        seconds: dict[str, list[float]] = {p: [] for p in paths}
        for rows in buckets:
            x, out = x_all[:rows], out_all[:rows]
            for name, fn in paths.items():
                try:
                    seconds[name].append(_median_time(fn, x, out))
                except (RuntimeError, NotImplementedError) as exc:  # this build lacks the shape
                    if name == NATIVE:
                        raise
                    log.info("%s GEMM unavailable for K=%d N=%d rows=%d: %s", name, k, n, rows, exc)
                    seconds[name].append(float("inf"))
        self.measured_s += time.perf_counter() - start
        return GemmTiming({p: tuple(v) for p, v in seconds.items()})

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({k: v.seconds for k, v in self.timings.items()}, indent=1))
            tmp.replace(self.path)  # atomic: concurrent workers never read half a file
        except OSError as exc:
            log.warning("GEMM timings not cached (%s): the next load measures again", exc)


def describe(t: GemmTiming) -> str:
    """Per bucket, the path taken and each matrix path's speed against native (native time / its
    time): ``16:brgemm (brgemm x1.80, onednn x1.20)``."""
    native = t.seconds[NATIVE]
    parts = []
    for i, c in enumerate(t.choice):
        ratios = ", ".join(f"{p} x{native[i] / s[i]:.2f}" for p, s in t.seconds.items() if p != NATIVE)
        parts.append(f"{ROW_BUCKETS[i]}:{c} ({ratios})")
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
