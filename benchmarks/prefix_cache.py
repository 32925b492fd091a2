"""Time to first token with a shared system prompt: the first request vs one that hits the cache.

Offline engine (the same engine core, scheduler and launch path the server runs), greedy,
one token out: the time is the prefill. The system prompt is ``--system-tokens`` random
ids; each request appends its own ``--question-tokens``. The cache-off run is the reference.
Each figure is the median (min-max) of ``--runs`` runs, each on a fresh engine.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from fusedserve.benchmarks.common import RUNS, fmt, machine, spread
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.coordinator.sampling_params import SamplingParams


def ttft(eng: LLMEngine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    eng.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    return time.perf_counter() - t0


def once(model_dir, system_tokens: int, question_tokens: int, repeats: int, dtype: str,
         seed: int) -> dict:
    """One run: first and cached requests with the cache on, and the same with it off."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(seed)
    system = rng.integers(10, vocab, system_tokens).tolist()
    questions = [rng.integers(10, vocab, question_tokens).tolist() for _ in range(repeats + 1)]
    total = system_tokens + question_tokens + 8
    out = {}
    for caching in (True, False):
        rc = dict(max_batch=4, block_size=16, num_blocks=4 * (-(-total // 16)) + 8,
                  enable_prefix_caching=caching)
        with LLMEngine(str(model_dir), dtype=dtype, **rc, max_model_len=total) as eng:
            ttft(eng, rng.integers(10, vocab, 16).tolist())  # warm-up, shares nothing
            first = ttft(eng, system + questions[0])
            later = [ttft(eng, system + q) for q in questions[1:]]
            stats = eng.core.scheduler.blocks.stats
        key = "on" if caching else "off"
        out[f"{key}_first_ms"], out[f"{key}_later_ms"] = first * 1e3, float(np.median(later)) * 1e3
        if caching:
            out["hit_tokens"], out["queries"] = stats.hit_tokens, stats.queries
    out["speedup"] = out["on_first_ms"] / out["on_later_ms"]
    return out


FIGURES = ("on_first_ms", "on_later_ms", "off_first_ms", "off_later_ms", "speedup")


def run(model: str, system_tokens: int, question_tokens: int, repeats: int, dtype: str,
        runs: int = RUNS) -> dict:
    model_dir = resolve_model(model)
    each = [once(model_dir, system_tokens, question_tokens, repeats, dtype, seed) for seed in range(runs)]
    return {"machine": machine(), "model": model, "dtype": dtype, "system_tokens": system_tokens,
            "question_tokens": question_tokens, "runs": runs, "hit_tokens": each[0]["hit_tokens"],
            "queries": each[0]["queries"], **{k: spread([r[k] for r in each]) for k in FIGURES}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default:benchmark")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, default=RUNS)
    args = ap.parse_args(argv)
    res = run(args.model, args.system_tokens, args.question_tokens, args.repeats, args.dtype, args.runs)
    print(f"{res['machine']}; {res['model']} {res['dtype']}, system prompt {res['system_tokens']} tokens "
          f"+ {res['question_tokens']} per request; median (min-max) of {res['runs']} runs")
    print(f"cache on:  first {fmt(res['on_first_ms'], '.0f')} ms, cached requests "
          f"{fmt(res['on_later_ms'], '.0f')} ms -> {fmt(res['speedup'])}x; hit tokens {res['hit_tokens']} "
          f"over {res['queries']} lookups (first run)")
    print(f"cache off: first {fmt(res['off_first_ms'], '.0f')} ms, "
          f"later {fmt(res['off_later_ms'], '.0f')} ms")
    return res


if __name__ == "__main__":
    main()
