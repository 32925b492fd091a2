"""fusedserve against the CPU engines a user would pick, side by side in one run.

The model is Qwen3-0.6B's real configuration with random weights, written by the
project (``default:qwen3-0.6b``, 1.19 GB bf16). Every engine gets the same random
prompts as token ids (32 in, 64 out by default, greedy, EOS ignored), at batch
1/16/64, in a subprocess of its own (so none inherits another's threads or memory):

- fusedserve, 16-bit and int8 weights (``LLMEngine``: scheduler, arena, fused step);
- transformers ``generate`` (static batch), bf16;
- OpenVINO GenAI with fp16 and int8 weights, where an interpreter with
  ``openvino-genai`` is given (``--openvino-python``; the ``openvino`` extra), exported
  once with ``optimum-cli export openvino``; ``ContinuousBatchingPipeline`` for batches.

Figures: output tokens/s (the median, min and max of ``RUNS`` generate calls after a
warm-up, the model loaded once), for batch 1 the share of the measured read bandwidth
(weight bytes per token x tokens/s), and each engine against its peer of the same weight
class (ratios of medians).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RUNS, fmt, machine, read_bandwidth, spread
from kernels.model.default_model import cache_root, default_model_dir

PRESET = "qwen3-0.6b"
ENGINES = ("fusedserve-bf16", "fusedserve-int8", "transformers-bf16", "openvino-fp16", "openvino-int8")


def prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    # Ids from the lower vocabulary: real text's ids; any id works for random weights.
    return np.random.default_rng(seed).integers(10, min(vocab, 30000), size=(n, input_len)).tolist()


# ------------------------------------------------------------------ engines (subprocess)

def fusedserve_generate(model_dir: Path, batch: list[list[int]], new: int, quantization: str | None,
                        device: str = "cpu", runs: int = RUNS, dtype: str = "bfloat16") -> list[float]:
    """Output tokens/s of ``runs`` ``LLMEngine.generate`` calls over ``batch`` (a warm-up first)."""
    from coordinator.engine.llm_engine import LLMEngine
    from coordinator.sampling_params import SamplingParams
    from shared_memory.contract import RunnerConfig

    total = len(batch[0]) + new + 1
    rc = RunnerConfig(max_batch=len(batch), block_size=16, num_blocks=len(batch) * -(-total // 16) + 4,
                      top_k=8)
    figures = []
    with LLMEngine(str(model_dir), dtype=dtype, quantization=quantization, runner=rc,
                   max_model_len=total + 16, device=device) as eng:
        eng.generate([batch[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for _ in range(runs):
            eng.core.scheduler.blocks.flush()  # every run prefills its prompts
            t0 = time.perf_counter()
            outs = eng.generate(batch, SamplingParams(max_tokens=new, ignore_eos=True))
            figures.append(len(batch) * new / (time.perf_counter() - t0))
            assert all(len(o.token_ids) == new for o in outs)
    return figures


def _openvino(ov_dir: Path, batch: list[list[int]], new: int, runs: int = RUNS) -> list[float]:
    import openvino as ov
    import openvino_genai as genai

    cfg = genai.GenerationConfig()
    cfg.max_new_tokens = cfg.min_new_tokens = new
    cfg.ignore_eos = True
    tensors = [ov.Tensor(np.asarray([p], dtype=np.int64)) for p in batch]
    sched = genai.SchedulerConfig()
    sched.cache_size = 2  # GB of KV cache
    sched.max_num_batched_tokens = max(256, len(batch) * len(batch[0]))
    sched.max_num_seqs = max(len(batch), 1)
    pipe = genai.ContinuousBatchingPipeline(str(ov_dir), sched, "CPU")
    warm = genai.GenerationConfig()
    warm.max_new_tokens = 4
    pipe.generate([ov.Tensor(np.asarray([batch[0][:8]], dtype=np.int64))], [warm])
    figures = []
    for _ in range(runs):
        t0 = time.perf_counter()
        res = pipe.generate(tensors, [cfg] * len(batch))
        figures.append(len(batch) * new / (time.perf_counter() - t0))
        assert all(len(r.m_generation_ids[0]) == new for r in res)
    return figures


def run_engine(engine: str, model_dir: Path, ov_root: Path, batch: list[list[int]], new: int) -> list[float]:
    if engine == "fusedserve-bf16":
        return fusedserve_generate(model_dir, batch, new, None)
    if engine == "fusedserve-int8":
        return fusedserve_generate(model_dir, batch, new, "int8")
    if engine == "fusedserve-int4":
        return fusedserve_generate(model_dir, batch, new, "int4")
    if engine == "transformers-bf16":
        import torch

        from benchmarks.throughput import transformers_generate

        return transformers_generate(batch, new, "bfloat16", torch.get_num_threads(), model_dir)
    if engine.startswith("openvino-"):
        return _openvino(ov_root / engine.split("-", 1)[1], batch, new)
    raise ValueError(f"unknown engine {engine!r}")


# ----------------------------------------------------------------------------- driver

def export_openvino(python: str, model_dir: Path, ov_root: Path) -> None:
    """``optimum-cli export openvino`` once per weight format (cached next to the model)."""
    cli = Path(python).parent / "optimum-cli"
    for weights in ("fp16", "int8"):
        out = ov_root / weights
        if (out / "openvino_model.xml").is_file():
            continue
        tmp = ov_root / f".{weights}-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([str(cli), "export", "openvino", "-m", str(model_dir), "--task",
                        "text-generation-with-past", "--weight-format", weights, str(tmp)],
                       check=True, stdout=subprocess.DEVNULL)
        tmp.rename(out)


def weight_bytes_per_token(model_dir: Path, quantization: str | None) -> int:
    """Bytes of weights a decode step streams (lm_head included, the embedding gather not)."""
    from kernels.model.config import Qwen3Config

    c = Qwen3Config.from_dir(model_dir)
    per_layer = (c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size \
        + 3 * c.intermediate_size * c.hidden_size
    params = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size
    return params * (1 if quantization else 2)


def measure(engines: list[str], batches: list[int], input_len: int, new: int, threads: int,
            openvino_python: str | None) -> dict:
    model_dir = default_model_dir(PRESET)
    ov_root = cache_root() / f"openvino-{model_dir.name}"
    if openvino_python:
        export_openvino(openvino_python, model_dir, ov_root)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    results: dict[str, dict[int, dict]] = {}
    for engine in engines:
        python = sys.executable
        if engine.startswith("openvino-"):
            if not openvino_python:
                continue
            python = openvino_python
        results[engine] = {}
        for b in batches:
            cmd = [python, "-m", "benchmarks.cpu_peers", "--one", engine, "--batches", str(b),
                   "--input-len", str(input_len), "--new-tokens", str(new)]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if r.returncode != 0:
                raise RuntimeError(f"{engine} batch {b} failed:\n{r.stderr[-3000:]}")
            results[engine][b] = spread(json.loads(r.stdout.strip().splitlines()[-1])["tokens_per_s"])
            print(f"  {engine:>18} batch {b:>3}: {fmt(results[engine][b])} tok/s", flush=True)
    bw = read_bandwidth()
    return {"machine": machine(), "model": f"default:{PRESET}", "input_len": input_len, "new_tokens": new,
            "threads": threads, "read_bw_gbps": bw / 1e9, "results": results,
            "weight_bytes": {"16-bit": weight_bytes_per_token(model_dir, None),
                             "int8": weight_bytes_per_token(model_dir, "int8")}}


def table(res: dict) -> list[str]:
    """Markdown: tok/s per batch as median (min-max), batch-1 share of read bandwidth, ratios of
    medians to the peers."""
    full = {e: {int(b): v for b, v in row.items()} for e, row in res["results"].items()}
    r = {e: {b: v["median"] for b, v in row.items()} for e, row in full.items()}
    batches = sorted({b for v in r.values() for b in v})
    lines = ["| engine | " + " | ".join(f"batch {b}" for b in batches) + " | batch 1 % of read bw |",
             "|---" * (len(batches) + 2) + "|"]
    for engine, row in r.items():
        wb = res["weight_bytes"]["int8" if engine.endswith("int8") else "16-bit"]
        bw = f"{100 * row[1] * wb / (res['read_bw_gbps'] * 1e9):.0f}%" if 1 in row else "-"
        lines.append(f"| {engine} | " + " | ".join(fmt(full[engine][b]) if b in row else "-" for b in batches)
                     + f" | {bw} |")
    pairs = [("fusedserve-bf16", "openvino-fp16"), ("fusedserve-int8", "openvino-int8"),
             ("fusedserve-bf16", "transformers-bf16"), ("fusedserve-int8", "transformers-bf16")]
    lines += ["", "| ratio | " + " | ".join(f"batch {b}" for b in batches) + " |",
              "|---" * (len(batches) + 1) + "|"]
    for a, b in pairs:
        if a in r and b in r:
            lines.append(f"| {a} / {b} | " + " | ".join(f"{r[a][x] / r[b][x]:.2f}x" for x in batches) + " |")
    return lines


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--openvino-python", default=None,
                    help="an interpreter with openvino-genai and optimum-intel (the 'openvino' extra)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # subprocess: one engine, one batch
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.one:
        import torch

        torch.set_num_threads(args.threads)
        model_dir = default_model_dir(PRESET)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        figures = run_engine(args.one, model_dir, cache_root() / f"openvino-{model_dir.name}",
                         prompts(batches[0], args.input_len, vocab, seed=batches[0]), args.new_tokens)
        print(json.dumps({"tokens_per_s": figures}))
        return None
    res = measure(args.engines.split(","), batches, args.input_len, args.new_tokens, args.threads,
                  args.openvino_python)
    print(f"{res['machine']}; read bandwidth {res['read_bw_gbps']:.1f} GB/s")
    print("\n".join(table(res)))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
