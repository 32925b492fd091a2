"""The CPU GEMM choice on this host: native kernels against oneDNN's (AMX where the CPU has it)
for each projection of Qwen3-0.6B, bf16 and W8A8, at every row bucket, as the load-time
measurement (``kernels/native/gemm_choice.py``) sees them; and its prompt attention (16 query / 8 KV
heads of 128, bf16 and int8 caches), the native flash kernel against torch's SDPA (oneDNN's
brgemm, AMX where the CPU has it), a chunk of each bucket's rows after a prefix as long
(``kernels/native/prompt_choice.py``).

Figures: GFLOP/s (GOP/s for W8A8) of each path, each a median of ``REPEATS`` timed calls after a
warm-up (attention counts 4 x heads x head_dim per visible query-key pair): native, oneDNN's
matmul, oneDNN's brgemm micro-kernel over prepacked weights, SDPA for attention; and which path
a load on this host picks. Nothing is read from
or written to the user's cache: a fresh measurement every run.

    python -m fusedserve.benchmarks.gemm_choice [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from fusedserve.benchmarks.common import machine
from fusedserve.kernels.linear import Int8Weight, LinearOp
from fusedserve.kernels.native import build as native
from fusedserve.kernels.native.gemm_choice import HEAD_ROWS, NATIVE, REPEATS, ROW_BUCKETS, GemmChooser
from fusedserve.kernels.native.prompt_choice import choose_prompt_attention, prompt_kind

# Qwen3-0.6B: hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, vocab 151,936.
SHAPES = {"qkv": (1024, 4096), "o_proj": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024),
          "lm_head": (1024, 151936)}
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def cpu_has_amx() -> bool:
    return "amx_tile" in native.cpu_flags()


def measure(threads: int) -> dict:
    torch.set_num_threads(threads)
    build = native.kernels()
    if build is None:
        raise SystemExit("no native build here: nothing to choose between")
    out = {"machine": machine(), "isa": build.isa(), "amx": cpu_has_amx(), "threads": threads,
           "repeats": REPEATS, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        op = LinearOp(torch.device("cpu"), build, torch.bfloat16)
        op.chooser = GemmChooser(build.isa(), threads, Path(tmp) / "gemm.json")
        g = torch.Generator().manual_seed(0)
        for name, (k, n) in SHAPES.items():
            w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
            rows = HEAD_ROWS if name == "lm_head" else ROW_BUCKETS[-1]
            for kind, weight in (("bfloat16", w), ("w8a8", Int8Weight.quantize(w.float(), torch.bfloat16,
                                                                                torch.device("cpu")))):
                op.prepare(weight, rows)
                t = op.chooser.timings[f"{kind}:{k}x{n}:rows{rows}"]
                buckets = ROW_BUCKETS[: len(t.seconds[NATIVE])]
                out["shapes"][f"{name} {kind}"] = {
                    "k": k, "n": n, "rows": list(buckets),
                    "gflops": {p: [2 * r * k * n / x / 1e9 for r, x in zip(buckets, ts)]
                               for p, ts in t.seconds.items()},
                    "choice": list(t.choice[: len(buckets)])}
        for cache in ("auto", "int8"):
            choose_prompt_attention(op.chooser, build, HEADS, KV_HEADS, HEAD_DIM, cache, HEAD_DIM**-0.5)
            kind = "int8" if cache == "int8" else "bf16"
            w = HEADS * HEAD_DIM
            t = op.chooser.timings[f"{prompt_kind(cache, KV_HEADS, HEAD_DIM)}:{w}x{w}:rows{ROW_BUCKETS[-1]}"]
            flops = [4 * HEADS * HEAD_DIM * (r * r + r * (r + 1) // 2) for r in ROW_BUCKETS]
            out["shapes"][f"prompt attention, {kind} cache"] = {
                "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "rows": list(ROW_BUCKETS),
                "gflops": {p: [f / x / 1e9 for f, x in zip(flops, ts)] for p, ts in t.seconds.items()},
                "choice": list(t.choice)}
        out["measure_s"] = op.chooser.measured_s
    return out


def table(res: dict) -> list[str]:
    """One row per shape and bucket: each path's GFLOP/s, and the one a load here picks."""
    paths = ["native", "onednn", "brgemm", "sdpa"]
    lines = [f"{res['machine']}; build {res['isa']}; AMX {'yes' if res['amx'] else 'no'}; "
             f"{res['threads']} threads; load-time measurement {res['measure_s']:.1f} s",
             "", "| shape | rows | native | oneDNN matmul | oneDNN brgemm | SDPA | chosen |",
             "|---|---|---|---|---|---|---|"]
    for name, s in res["shapes"].items():
        for i, r in enumerate(s["rows"]):
            cells = [f"{s['gflops'][p][i]:.0f}" if p in s["gflops"] else "" for p in paths]
            lines.append(f"| {name} | {r} | {' | '.join(cells)} | {s['choice'][i]} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = measure(args.threads)
    print("\n".join(table(res)))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
