"""Device->host bytes per decode step for greedy, top-p-only and mixed batches.

The offline engine's counted launch path, batch 16: every kind is sampled on the device, so
a step hands back the ids (and the asked-for logprobs), against the anchor's full-logits copy
(B x vocab x 4 every step). The counts are exact (the same in every run).
"""

from __future__ import annotations

import argparse
import json

from fusedserve.benchmarks.common import machine
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.coordinator.sampling_params import SamplingParams


def batches(n: int) -> dict[str, list[SamplingParams]]:
    greedy = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in range(n)]
    top_p = [SamplingParams(max_tokens=12, temperature=0.7, top_p=0.95, seed=i, ignore_eos=True)
             for i in range(n)]
    kinds = [SamplingParams(max_tokens=12, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=0.7, top_p=0.95, seed=1, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=2, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=1.0, min_p=0.05, seed=3, logprobs=True,
                            top_logprobs=5, ignore_eos=True)]
    return {"greedy": greedy, "top-p only": top_p, "mixed": [kinds[i % 4] for i in range(n)]}


def run(model: str, n: int, dtype: str) -> dict:
    model_dir = resolve_model(model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = [[11 + i, 12, 13, 14] for i in range(n)]
    rows = {}
    rc = dict(max_batch=n, block_size=16, num_blocks=4 * n)
    with LLMEngine(str(model_dir), dtype=dtype, **rc, max_model_len=64) as eng:
        eng.runtime.keep_history = 10_000
        for name, params in batches(n).items():
            eng.runtime.history.clear()
            eng.generate(prompts, params)
            d2h = {r.d2h_bytes for r in eng.runtime.history if r.kind == "decode" and r.dims["B"] == n}
            assert len(d2h) == 1, f"{name}: d2h per full decode step varies: {d2h}"
            rows[name] = {"device": d2h.pop(), "anchor_full_logits": n * vocab * 4}
    return {"machine": machine(), "model": model, "batch": n, "vocab": vocab, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default:benchmark")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    res = run(args.model, args.batch, args.dtype)
    print(f"{res['machine']}; {res['model']} (vocab {res['vocab']}), batch {res['batch']}: "
          "d2h bytes per decode step")
    print(f"{'batch kind':>12} {'fusedserve':>12} {'full logits':>12}")
    for name, r in res["rows"].items():
        print(f"{name:>12} {r['device']:>12} {r['anchor_full_logits']:>12}")
    return res


if __name__ == "__main__":
    main()
