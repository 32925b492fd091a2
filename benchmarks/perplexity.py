"""Held-out perplexity of the embedded default model in fp32, bf16 and int8 weight-only.

    python -m benchmarks.perplexity

The held-out text ships with the model (``kernels/default_model/heldout.txt``: documents
of its corpus it was not trained on). int8 is weight-only, per output channel
(``kernels/quantize.py``) on every linear layer but the tied embedding / lm_head,
evaluated by quantizing and dequantizing the weights: what an int8 kernel computes, up to
its accumulation order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kernels.model.default_model import resolve_model
from kernels.model.tokenizer import TextTokenizer
from kernels.model.train_default import perplexity
from kernels.quantize import dequantize_int8, quantize_int8


def load(model_dir: Path, weights: str):
    from transformers import Qwen3ForCausalLM

    dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    model = Qwen3ForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).eval()
    if weights == "int8":
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and not (tied and name == "lm_head"):
                with torch.no_grad():
                    mod.weight.copy_(dequantize_int8(*quantize_int8(mod.weight), dtype))
    return model


def run(max_tokens: int = 8192, model: str = "default") -> dict[str, float]:
    model_dir = resolve_model(model)
    ids = TextTokenizer.from_dir(model_dir).encode((model_dir / "heldout.txt").read_text())[:max_tokens]
    t = torch.tensor(ids)
    return {w: perplexity(load(model_dir, w), t) for w in ("fp32", "bf16", "int8")} | {"tokens": len(ids)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=8192)
    args = ap.parse_args(argv)
    r = run(args.max_tokens)
    print(f"held-out perplexity over {r['tokens']} tokens: fp32 {r['fp32']:.3f}, bf16 {r['bf16']:.3f}, "
          f"int8 weight-only {r['int8']:.3f} ({100 * (r['int8'] / r['bf16'] - 1):+.2f}% vs bf16)")
    return r


if __name__ == "__main__":
    main()
