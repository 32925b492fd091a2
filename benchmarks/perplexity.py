"""Held-out perplexity of the embedded default model in fp32, bf16, int8 and int4, computed by
fusedserve's own engine and kernels.

    python -m fusedserve.benchmarks.perplexity

The held-out text ships with the model (``coordinator/model_files/default_model/heldout.txt``: documents
of its corpus it was not trained on). Each window of 256 predictions is one request through
``LLMEngine`` asking for its prompt logprobs (``SamplingParams.prompt_logprobs``): the same
scheduler, launch contract, native kernels and quantized weights as serving: int8 per output
channel (``--quantization int8``), int4 in groups of 32 with the lm_head int8 (``--quantization
int4``), both multiplied with int8 activations quantized per token.
"""

from __future__ import annotations

import argparse
import math

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.sampling_params import SamplingParams

WINDOW = 256
SETTINGS = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
            "int8": {"dtype": "bfloat16", "quantization": "int8"},
            "int4": {"dtype": "bfloat16", "quantization": "int4"}}


def engine_perplexity(eng: LLMEngine, ids: list[int], window: int = WINDOW) -> float:
    """exp(mean next-token loss) over ``ids``, in independent windows of ``window`` predictions."""
    prompts = [ids[s : s + window + 1] for s in range(0, len(ids) - 1, window)]
    prompts = [p for p in prompts if len(p) >= 2]
    outs = eng.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll = -sum(sum(o.prompt_logprobs[1:]) for o in outs)
    return math.exp(nll / sum(len(p) - 1 for p in prompts))


def run(max_tokens: int = 8192, model: str = "default") -> dict[str, float]:
    model_dir = resolve_model(model)
    ids = TextTokenizer.from_dir(model_dir).encode((model_dir / "heldout.txt").read_text())[:max_tokens]
    rc = dict(max_batch=16, block_size=16, num_blocks=16 * (WINDOW // 16 + 2))
    result: dict[str, float] = {"tokens": len(ids)}
    for name, kw in SETTINGS.items():
        with LLMEngine(model, **rc, **kw) as eng:
            result[name] = engine_perplexity(eng, ids)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=8192)
    args = ap.parse_args(argv)
    r = run(args.max_tokens)
    print(f"held-out perplexity over {r['tokens']} tokens (fusedserve engine): fp32 {r['fp32']:.3f}, "
          f"bf16 {r['bf16']:.3f}, int8 {r['int8']:.3f} ({100 * (r['int8'] / r['bf16'] - 1):+.2f}% vs bf16), "
          f"int4 {r['int4']:.3f} ({100 * (r['int4'] / r['bf16'] - 1):+.2f}%)")
    return r


if __name__ == "__main__":
    main()
