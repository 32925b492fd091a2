"""Time to first token with a shared system prompt: the first request vs one that hits the cache.

Offline engine (the same engine core, scheduler and launch path the server runs), greedy,
one token out: the time is the prefill. The system prompt is ``--system-tokens`` random
ids; each request appends its own ``--question-tokens``. The cache-off run is the reference.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.common import machine
from coordinator.engine.llm_engine import LLMEngine
from coordinator.sampling_params import SamplingParams
from kernels.model.default_model import resolve_model
from shared_memory.contract import RunnerConfig


def ttft(eng: LLMEngine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    eng.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    return time.perf_counter() - t0


def run(model: str, system_tokens: int, question_tokens: int, repeats: int, dtype: str) -> dict:
    model_dir = resolve_model(model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    system = rng.integers(10, vocab, system_tokens).tolist()
    questions = [rng.integers(10, vocab, question_tokens).tolist() for _ in range(repeats + 1)]
    total = system_tokens + question_tokens + 8
    out = {}
    for caching in (True, False):
        rc = RunnerConfig(max_batch=4, block_size=16, num_blocks=4 * (-(-total // 16)) + 8,
                          enable_prefix_caching=caching)
        with LLMEngine(str(model_dir), dtype=dtype, runner=rc, max_model_len=total) as eng:
            ttft(eng, rng.integers(10, vocab, 16).tolist())  # warm-up, shares nothing
            first = ttft(eng, system + questions[0])
            later = [ttft(eng, system + q) for q in questions[1:]]
            stats = eng.core.scheduler.blocks.stats
        out["cache_on" if caching else "cache_off"] = {
            "first_ms": first * 1e3, "later_ms_median": float(np.median(later)) * 1e3,
            "hit_tokens": stats.hit_tokens, "queries": stats.queries}
    on = out["cache_on"]
    return {"machine": machine(), "model": model, "dtype": dtype, "system_tokens": system_tokens,
            "question_tokens": question_tokens, **out,
            "speedup": on["first_ms"] / on["later_ms_median"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default:benchmark")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    res = run(args.model, args.system_tokens, args.question_tokens, args.repeats, args.dtype)
    on, off = res["cache_on"], res["cache_off"]
    print(f"{res['machine']}; {res['model']} {res['dtype']}, system prompt {res['system_tokens']} tokens "
          f"+ {res['question_tokens']} per request")
    print(f"cache on:  first {on['first_ms']:.0f} ms, cached requests {on['later_ms_median']:.0f} ms "
          f"(median) -> {res['speedup']:.1f}x; hit tokens {on['hit_tokens']} over {on['queries']} lookups")
    print(f"cache off: first {off['first_ms']:.0f} ms, later {off['later_ms_median']:.0f} ms")
    return res


if __name__ == "__main__":
    main()
