"""The integer GEMMs (W8A8, W4A8) on every native build this CPU runs, side by side: what a VNNI
build gains over the build of the same vector width without it.

Pairs: ``avx512vnni`` against ``avx512`` (512-bit VNNI: Cascade Lake, Ice Lake), and ``avxvnni``
against ``avx2`` (256-bit VNNI: Alder Lake, Sierra Forest). Where the CPU has AVX-512 VNNI but
not AVX-VNNI, the 256-bit VNNI code runs as its ``avxvnni_evex`` twin (the same instructions,
vpdpbusd EVEX-encoded): a measure of the code on this CPU's 256-bit units, not of an AVX-VNNI CPU.

Figures: GOP/s (2 x rows x K x N per call) for Qwen3-0.6B's projections at 1, 16 and 64 rows, each
the median of ``--repeats`` timings of a loop of calls, builds interleaved within each repeat.

    python -m fusedserve.benchmarks.int_gemm_isa [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from fusedserve.benchmarks.common import machine
from fusedserve.kernels.linear import Int4Weight, Int8Weight, PackedWeight
from fusedserve.kernels.native import build as native

SHAPES = {"qkv": (1024, 4096), "o_proj": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}
ROWS = (1, 16, 64)
BUILDS = ("avx2", "avxvnni", "avxvnni_evex", "avx512", "avx512vnni", "avx512bf16")
PAIRS = (("avxvnni", "avx2"), ("avxvnni_evex", "avx2"), ("avx512vnni", "avx512"))


def runnable_builds() -> list[str]:
    flags = native.cpu_flags()
    return [b for b in BUILDS if native.ISA_FLAGS[b][0] <= flags]


def _time(fn, min_s: float = 0.1) -> float:
    """Seconds per call: calls looped until ``min_s`` has passed."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / n


def measure(threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    builds = {b: native.build(b) for b in runnable_builds()}
    out = {"machine": machine(), "threads": threads, "repeats": repeats, "builds": list(builds), "cases": []}
    g = torch.Generator().manual_seed(0)
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, generator=g) * 0.02
        i8 = Int8Weight.quantize(w, torch.bfloat16, torch.device("cpu"))
        i4 = Int4Weight.quantize(w, torch.device("cpu"))
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g).bfloat16()
            y = torch.empty(rows, n, dtype=torch.bfloat16)
            calls = {}
            for b, m in builds.items():
                p8 = PackedWeight.pack_w8a8(i8, m.int8_lanes())
                p4 = PackedWeight.pack_w4a8(i4, m.int4_lanes())
                calls[("w8a8", b)] = functools.partial(m.linear_w8a8, x, p8.packed, p8.scale, p8.wsum, y)
                calls[("w4a8", b)] = functools.partial(m.linear_w4a8, x, p4.packed, p4.scale, y)
            times: dict = {key: [] for key in calls}
            for _ in range(repeats):  # builds interleaved: drift in the host hits them alike
                for key, fn in calls.items():
                    times[key].append(_time(fn))
            for (kind, b), ts in times.items():
                s = statistics.median(ts)
                case = {"shape": name, "k": k, "n": n, "rows": rows, "kind": kind, "build": b}
                gops = 2 * rows * k * n / s / 1e9
                out["cases"].append({**case, "s": s, "gops": gops, "range_s": [min(ts), max(ts)]})
    return out


def table(res: dict) -> list[str]:
    by = {(c["kind"], c["shape"], c["rows"], c["build"]): c["gops"] for c in res["cases"]}
    pairs = [(a, b) for a, b in PAIRS if a in res["builds"] and b in res["builds"]]
    lines = [f"{res['machine']}; builds {', '.join(res['builds'])}; medians of {res['repeats']}", "",
             "| kernel | projection | rows | " + " | ".join(f"{b} GOP/s" for b in res["builds"]) + " | "
             + " | ".join(f"{a} / {b}" for a, b in pairs) + " |",
             "|---|---|---|" + "---|" * (len(res["builds"]) + len(pairs))]
    for kind in ("w8a8", "w4a8"):
        for shape in SHAPES:
            for rows in ROWS:
                g = [by[(kind, shape, rows, b)] for b in res["builds"]]
                r = [by[(kind, shape, rows, a)] / by[(kind, shape, rows, b)] for a, b in pairs]
                lines.append(f"| {kind} | {shape} | {rows} | " + " | ".join(f"{v:.0f}" for v in g) + " | "
                             + " | ".join(f"{v:.2f}x" for v in r) + " |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = measure(args.threads, args.repeats)
    print("\n".join(table(res)))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
