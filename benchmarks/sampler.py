"""The sampler's cost per launch on this device, by kind of row.

    python -m fusedserve.benchmarks.sampler --batch 16 --vocab 151936

Every row of the batch asks for the same kind; each figure is the median (min-max) of
``--runs`` calls after a warm-up. Greedy is one argmax; top-k within the candidates sorts 64
values a row; the whole-vocabulary kinds run the radix select over every token.
"""

from __future__ import annotations

import argparse
import time

import torch

from fusedserve.benchmarks.common import fmt, machine, spread
from fusedserve.kernels.sampler import sample
from fusedserve.shared_memory.sampling_row import SamplingPlan

KINDS = {  # (temperature, top_p, min_p, top_k) of every row
    "greedy": (0.0, 1.0, 0.0, 0),
    "top_k 20, top_p 0.95 (candidates)": (0.7, 0.95, 0.0, 20),
    "temperature only (whole vocabulary)": (0.7, 1.0, 0.0, 0),
    "top_p 0.95 (whole vocabulary)": (0.7, 0.95, 0.0, 0),
    "top_k 200, min_p 0.05 (whole vocabulary)": (0.7, 1.0, 0.05, 200),
}


def run(batch: int, vocab: int, runs: int, device: str = "cpu") -> dict[str, dict]:
    logits = torch.randn(batch, vocab, device=device) * 3
    seeds = torch.stack([torch.arange(batch), torch.arange(batch)], 1).to(device)
    out = torch.empty(batch, dtype=torch.int32, device=device)
    res = {}
    for name, row in KINDS.items():
        params = torch.tensor([row] * batch, dtype=torch.float32)
        plan = SamplingPlan.for_rows(params.numpy(), 64, vocab)
        params = params.to(device)
        sample(logits, params, seeds, out, plan, 64)
        times = []
        for _ in range(runs):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            sample(logits, params, seeds, out, plan, 64)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        res[name] = spread(times)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    res = run(args.batch, args.vocab, args.runs, args.device)
    print(f"{machine()}; {args.batch} rows x {args.vocab} tokens on {args.device}, ms per launch")
    for name, s in res.items():
        print(f"{name:>42}: {fmt(s, '.1f')}")
    return res


if __name__ == "__main__":
    main()
