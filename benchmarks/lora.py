"""Multi-LoRA: output tokens per second with adapters against the same batch on the base model.

``python -m fusedserve.benchmarks.lora [--runs 3] [--json F]``

Qwen3-0.6B's shape with random bf16 weights (``default:qwen3-0.6b``), 2 CPU threads, and adapters
of rank 16 on all seven projections of every layer, written in PEFT's format with random A and B
(their values do not change the work). Each run times, alternating, the base model alone and the
same batch with adapters, 32 prompt tokens and 64 output tokens a request, prefill included
(``ignore_eos``; output tok/s = batch x 64 / seconds): batch 16 with 4 distinct adapters (4 rows
each), and batch 1 with one adapter. The base figure comes from an engine without LoRA, the
adapter figure from one with ``--enable-lora --max-loras 4`` over the same loaded weights, with
the adapters already in their slots (a warm-up request each), as a server that serves them is.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from fusedserve.benchmarks.common import RUNS, emit, fmt, isa_line, machine, median, spread
from fusedserve.coordinator.engine.llm_engine import LLMEngine, load_model
from fusedserve.coordinator.model_files.default_model import cache_root
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.model_description.config import Qwen3Config

log = logging.getLogger(__name__)
RANK, ADAPTERS, PROMPT, OUTPUT = 16, 4, 32, 64
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(c: Qwen3Config, out: Path, seed: int, rank: int = RANK) -> Path:
    """A PEFT LoRA adapter of ``rank`` on every projection of every layer, random A and B."""
    if (out / "adapter_model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for module, (fan_in, fan_out) in dims.items():
            name = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            a = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{name}.lora_A.weight"] = a.bfloat16()
            tensors[f"{name}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01).bfloat16()
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
        "bias": "none", "use_rslora": False, "use_dora": False}))
    return out


def timed(eng: LLMEngine, batch: int, loras: list[str | None]) -> float:
    """Output tokens a second of ``batch`` requests (prompt ``PROMPT`` ids, ``OUTPUT`` tokens each)."""
    prompts = [[(7 * r + 3 * t) % 1000 + 100 for t in range(PROMPT)] for r in range(batch)]
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params, lora=loras)
    seconds = time.perf_counter() - t0
    assert all(len(o.token_ids) == OUTPUT for o in outs)
    return batch * OUTPUT / seconds


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("default:qwen3-0.6b", dtype="bfloat16")
    c = model.config
    names = [f"lora{k}" for k in range(ADAPTERS)]
    dirs = {n: write_adapter(c, cache_root() / "bench-lora" / f"{n}-r{RANK}", k) for k, n in enumerate(names)}
    common = dict(max_batch=16, block_size=16, max_num_batched_tokens=1024, num_blocks=256)
    base = LLMEngine(model, tokenizer=tokenizer, **common)
    lora = LLMEngine(model, tokenizer=tokenizer, enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK,
                     **common)
    for n, d in dirs.items():
        lora.add_lora(n, d)
    cases = {"B16, 4 adapters": (16, [names[r % ADAPTERS] for r in range(16)]),
             "B1, 1 adapter": (1, names[:1])}
    timed(lora, 4, names)  # every adapter read into its slot; first-call costs of both engines
    timed(base, 4, [None] * 4)
    figures: dict[str, dict[str, list[float]]] = {k: {"base": [], "lora": []} for k in cases}
    for _ in range(args.runs):
        for case, (batch, loras) in cases.items():
            figures[case]["base"].append(timed(base, batch, [None] * batch))
            figures[case]["lora"].append(timed(lora, batch, loras))
    results = {}
    for case, f in figures.items():
        ratios = [lo / b for lo, b in zip(f["lora"], f["base"])]
        results[case] = {"base": spread(f["base"]), "lora": spread(f["lora"]), "ratio": spread(ratios)}
    base.close()
    lora.close()
    res = {"machine": machine(), "isa": isa_line(), "threads": args.threads, "rank": RANK, "runs": args.runs,
           "results": results}
    return emit(res, table(res), args.json)


def table(res: dict) -> list[str]:
    targets = {"B16, 4 adapters": 0.85, "B1, 1 adapter": 0.9}
    rows = ["| case | base model, out tok/s | with adapters, out tok/s | ratio | target |",
            "|---|---|---|---|---|"]
    for case, r in res["results"].items():
        rows.append(f"| {case} | {fmt(r['base'])} | {fmt(r['lora'])} | {fmt(r['ratio'], '.3f')}x | "
                    f">= {targets[case]}x ({'met' if median(r['ratio']) >= targets[case] else 'not met'}) |")
    return rows


if __name__ == "__main__":
    main()
