"""Inter-token gaps of running streams while long prompts arrive, at two token budgets.

Offline engine (the server's engine core and launch path), bf16: ``--streams`` requests
decode; once they all stream, ``--long`` prompts of ``--long-tokens`` random ids arrive.
Each stream's gap between consecutive tokens is measured from the arrival until the long
prompts' first tokens and one more token of every stream; p50/p99/max per setting, each
the median (min-max) of ``--runs`` runs. The budget ``0`` means one large enough that no
prompt is split (whole prompts in one launch): the reference without chunking.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from fusedserve.benchmarks.common import RUNS, fmt, machine, percentile, spread
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.coordinator.sampling_params import SamplingParams


def gaps(model_dir, budget: int, streams: int, long: int, long_tokens: int, dtype: str) -> dict:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    max_len = long_tokens + 256
    whole = streams + long * long_tokens  # every prompt in one launch, beside the decode rows
    rc = dict(max_batch=streams + long, block_size=16, sampler_candidates=8,
              num_blocks=(streams + long) * (-(-max_len // 16)) + 8,
                      max_num_batched_tokens=budget or whole, enable_prefix_caching=False)
    with LLMEngine(str(model_dir), dtype=dtype, **rc, max_model_len=max_len) as eng:
        sched = eng.core.scheduler
        runs = [sched.add(f"s{i}", rng.integers(10, vocab, 16).tolist(),
                          SamplingParams(max_tokens=max_len - 32, ignore_eos=True)) for i in range(streams)]
        while any(len(s.output_ids) < 2 for s in runs):
            eng.core.step()
        bigs = [sched.add(f"long{i}", rng.integers(10, vocab, long_tokens).tolist(),
                          SamplingParams(max_tokens=1, ignore_eos=True)) for i in range(long)]
        last = {s.seq_id: time.perf_counter() for s in runs}  # each just got a token
        gap: list[float] = []
        t0 = time.perf_counter()
        window, after = None, set()
        while window is None or len(after) < len(runs):  # until every stream got one token past it
            for ev in eng.core.step():
                if ev.seq in runs:
                    now = time.perf_counter()
                    gap.append(now - last[ev.seq.seq_id])
                    last[ev.seq.seq_id] = now
                    if window is not None:
                        after.add(ev.seq.seq_id)
            if window is None and all(b.output_ids for b in bigs):
                window = time.perf_counter() - t0
        for s in runs:
            sched.abort(s.seq_id)
    return {"budget": budget, "window_s": window, "p50_ms": percentile(gap, 50) * 1e3,
            "p99_ms": percentile(gap, 99) * 1e3, "max_ms": max(gap) * 1e3, "tokens": len(gap)}


FIGURES = ("p50_ms", "p99_ms", "max_ms", "window_s")


def repeated(model_dir, budget: int, streams: int, long: int, long_tokens: int, dtype: str,
             runs: int = RUNS) -> dict:
    """``gaps`` ``runs`` times: each figure's median, min and max."""
    each = [gaps(model_dir, budget, streams, long, long_tokens, dtype) for _ in range(runs)]
    return {"budget": budget, "runs": runs, **{k: spread([r[k] for r in each]) for k in FIGURES}}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default:benchmark")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--budgets", default="0,256")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, default=RUNS)
    args = ap.parse_args(argv)
    model_dir = resolve_model(args.model)
    rows = [repeated(model_dir, int(b), args.streams, args.long, args.long_tokens, args.dtype, args.runs)
            for b in args.budgets.split(",")]
    print(f"{machine()}; {args.model} {args.dtype}: {args.streams} streams decoding while "
          f"{args.long} prompts of {args.long_tokens} tokens arrive")
    for r in rows:
        name = "whole prompts" if not r["budget"] else f"--max-num-batched-tokens {r['budget']}"
        f = {k: fmt(r[k], ".2f" if k == "window_s" else ".0f") for k in FIGURES}
        print(f"{name:>30}: inter-token gap p50 {f['p50_ms']} ms, p99 {f['p99_ms']} ms, "
              f"max {f['max_ms']} ms; long prompts' first token after {f['window_s']} s")
    return rows


if __name__ == "__main__":
    main()
