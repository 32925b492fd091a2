"""The Qwen3-MoE decode step against a dense Qwen3 step that reads the same active weight bytes.

    python -m fusedserve.benchmarks.moe_decode [--batches 1,16]

Two random checkpoints written with transformers (cached): a MoE model (hidden 1024, 6
layers, 32 experts of intermediate 256, top 4 per token) and a dense one whose MLP has
intermediate 4 x 256 = 1024, so that one token reads the same weight bytes in both (the
router's 32 x 1024 aside). The step is the real launch path (``decode_step.run``: arena,
forward, sampler), greedy, context 128. Target: MoE at batch 1 <= 1.3x the dense step. At
batch 16 the MoE step reads more experts than a token's 4 (up to all 32): a comparison of
work, not of bytes. Each figure is the median (min-max) over ``--runs`` runs (dense and MoE
alternating) of a run's median step; the ratio is of those medians.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fusedserve.benchmarks import decode_step
from fusedserve.benchmarks.common import fmt, machine, median, spread
from fusedserve.coordinator.model_files.default_model import cache_root

SHAPE = dict(vocab_size=32768, hidden_size=1024, num_hidden_layers=6, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True)
EXPERTS, TOP_K, EXPERT_INTER = 32, 4, 256


def checkpoints() -> dict[str, Path]:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = {"moe": cache_root() / "bench-qwen3-moe-32x256-top4",
           "dense": cache_root() / "bench-qwen3-dense-1024"}
    for name, path in out.items():
        if (path / "config.json").is_file():
            continue
        torch.manual_seed(0)
        if name == "moe":
            cfg = Qwen3MoeConfig(**SHAPE, intermediate_size=TOP_K * EXPERT_INTER,
                                 moe_intermediate_size=EXPERT_INTER, num_experts=EXPERTS,
                                 num_experts_per_tok=TOP_K, norm_topk_prob=True)
            model = Qwen3MoeForCausalLM(cfg)
        else:
            model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, intermediate_size=TOP_K * EXPERT_INTER))
        model.to(torch.bfloat16).save_pretrained(path)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    dirs = checkpoints()
    res: dict = {"machine": machine(), "dtype": args.dtype, "runs": args.runs}
    steps: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in dirs}
    for _ in range(args.runs):
        for name, path in dirs.items():
            run = decode_step.run(batches, 128, args.steps, args.dtype, model_dir=str(path))
            for row in run["rows"]:
                steps[name][row["batch"]].append(row["step_ms"])
    print(f"{machine()}; {args.dtype}, context 128, greedy; step ms, median (min-max) of {args.runs} runs")
    print(f"{'batch':>5s} {'dense':>22s} {'MoE':>22s} {'MoE / dense':>12s}")
    res["step_ms"], res["ratios"] = {}, {}
    for b in batches:
        d, m = spread(steps["dense"][b]), spread(steps["moe"][b])
        res["step_ms"][b] = {"dense": d, "moe": m}
        res["ratios"][b] = median(m) / median(d)
        print(f"{b:5d} {fmt(d, '.2f'):>22s} {fmt(m, '.2f'):>22s} {res['ratios'][b]:12.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
