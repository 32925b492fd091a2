"""A Qwen3.5 hybrid (Gated DeltaNet) against llama.cpp on the same checkpoint, in one run.

The model: Qwen3.5's ~0.8B text configuration with random weights written by transformers
(hidden 1024, 24 layers, every 4th full attention with 8 heads / 2 KV heads x 256, output gate and
partial rotary 0.25, linear attention 16 key / 16 value heads x 128, conv kernel 4, intermediate
3584, vocabulary 248,320, tied embeddings; bf16, 1.5 GB). llama.cpp runs the same checkpoint
converted by its own converter (``--no-mtp``: the checkpoint has no MTP head) in bf16, and
quantized by ``llama-quantize`` to Q8_0 and Q4_0 (``benchmarks/llama_cpp.py`` builds it).

Figures: output tokens/s, 32 prompt tokens in and 64 out per request, prefill included, at
B = 1, 16 and 64, 2 threads, each engine in a subprocess of its own, runs round robin; the median
of ``--runs`` runs with min and max; fusedserve's bf16 / int8 / int4 weights against llama.cpp's
bf16 / Q8_0 / Q4_0. ``--prefill N``: one N-token prompt's prefill tokens/s (llama-batched-bench's
S_PP). At B=1 the bytes one decode step reads (weights, the attention layers' K/V at the mean
context, the recurrent states read and written) and their share of the measured read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fusedserve.benchmarks import llama_cpp
from fusedserve.benchmarks.common import RUNS, isa_line, machine, read_bandwidth, spread
from fusedserve.kernels.native.build import cpu_flags

ENGINES = ["fusedserve-bf16", "fusedserve-int8", "fusedserve-int4", "llamacpp-bf16", "llamacpp-q8_0",
           "llamacpp-q4_0"]
QUANT = {"fusedserve-bf16": None, "fusedserve-int8": "int8", "fusedserve-int4": "int4"}
PEER = {"fusedserve-bf16": "llamacpp-bf16", "fusedserve-int8": "llamacpp-q8_0",
        "fusedserve-int4": "llamacpp-q4_0"}
CONFIG = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
              num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
              linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=32768,
              tie_word_embeddings=True, eos_token_id=0,
              rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                               "partial_rotary_factor": 0.25})


def cache_root() -> Path:
    return Path(os.environ.get("FUSEDSERVE_BENCH_CACHE", Path.home() / ".cache" / "fusedserve" / "bench"))


def checkpoint() -> Path:
    """The random Qwen3.5-0.8B-shaped checkpoint, written once (with the embedded model's tokenizer,
    which llama.cpp's converter reads)."""
    path = cache_root() / "qwen3.5-0.8b-random"
    if (path / "model.safetensors").is_file():
        return path
    import shutil

    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from fusedserve.coordinator.model_files.default_model import default_model_dir

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CONFIG)).to(torch.bfloat16)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, path / name)
    return path


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(10, 30000, size=(n, length)).tolist()


def one(engine: str, model_dir: Path, batch: int, input_len: int, new: int) -> float:
    """Output tokens/s of one timed ``generate`` (after a warm-up), or prefill tokens/s for new=1."""
    from fusedserve.benchmarks.cpu_peers import fusedserve_generate
    from fusedserve.coordinator.engine.llm_engine import LLMEngine
    from fusedserve.coordinator.sampling_params import SamplingParams

    ids = prompts(batch, input_len, batch)
    if new > 1:
        return fusedserve_generate(model_dir, ids, new, QUANT[engine], runs=1)[0]
    with LLMEngine(str(model_dir), dtype="bfloat16", quantization=QUANT[engine], max_batch=1,
                   max_num_batched_tokens=input_len + 8, max_model_len=input_len + 16,
                   num_blocks=-(-(input_len + 16) // 16) + 2, enable_prefix_caching=False) as eng:
        eng.generate([ids[0][:16]], SamplingParams(max_tokens=2, ignore_eos=True))
        t0 = time.perf_counter()
        eng.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True))
        return input_len / (time.perf_counter() - t0)


def llama_prefill(llama_dir: Path, model: Path, n: int, threads: int, build: str) -> float:
    binary = llama_dir / build / "bin" / "llama-batched-bench"
    cmd = [str(binary), "-m", str(model), "-t", str(threads), "-npp", str(n), "-ntg", "1", "-npl", "1",
           "-c", str(n + 64)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=True)
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[2].isdigit():
            return float(cells[5])  # S_PP t/s
    raise RuntimeError(f"llama-batched-bench printed no row:\n{r.stdout[-2000:]}")


def step_bytes(model_dir: Path, quantization: str | None, context: int) -> dict[str, int]:
    """What one B=1 decode step reads: the projections and the lm_head (as run: 16-bit, int8 per
    channel, int4 in groups of 32 with an int8 lm_head), the attention layers' K/V at ``context``
    tokens, and the recurrent states (read and written)."""
    import torch

    from fusedserve.kernels.model_description.config import Qwen3Config

    c = Qwen3Config.from_dir(model_dir)
    la = c.linear_attention
    per_layer_mlp = 3 * c.hidden_size * c.intermediate_size
    attn = c.hidden_size * (2 * c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    linear = c.hidden_size * la.in_proj_rows + la.value_dim * c.hidden_size
    params = (len(c.attention_layers) * attn + len(c.linear_layers) * linear
              + c.num_hidden_layers * per_layer_mlp)
    head = c.vocab_size * c.hidden_size
    per = {None: 2.0, "int8": 1.0 + 4 / c.hidden_size, "int4": 0.5 + 2 / 32}[quantization]
    weights = int(params * per + head * (2 if quantization is None else 1))
    kv = len(c.attention_layers) * 2 * c.num_key_value_heads * c.head_dim * 2 * context
    states = 2 * c.state_bytes(torch.bfloat16)
    return {"weights": weights, "kv": kv, "states": states, "total": weights + kv + states}


def measure(engines: list[str], batches: list[int], input_len: int, new: int, threads: int, runs: int,
            llama_dir: str | None, llama_python: str | None, prefill: int | None) -> dict:
    model_dir = checkpoint()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    available = [e for e in engines if not e.startswith("llamacpp-") or llama_dir]
    ggufs = {e: llama_cpp.gguf(Path(llama_dir), llama_python or sys.executable, model_dir,
                               cache_root() / "llamacpp-qwen3.5-0.8b", e, ("--no-mtp",))
             for e in available if e.startswith("llamacpp-")}
    builds = {e: llama_cpp.build_for(e, "native", cpu_flags()) for e in ggufs}
    batches = [1] if prefill else batches
    raw: dict[str, dict[int, list[float]]] = {e: {b: [] for b in batches} for e in available}
    for run in range(runs):
        for engine in available:
            if engine in ggufs:
                if prefill:
                    raw[engine][1].append(llama_prefill(Path(llama_dir), ggufs[engine], prefill, threads,
                                                        builds[engine]))
                    continue
                for b, v in llama_cpp.batched_bench(Path(llama_dir), ggufs[engine], batches, input_len, new,
                                                    threads, builds[engine]).items():
                    raw[engine][b].append(v)
                continue
            for b in batches:
                cmd = [sys.executable, "-m", "fusedserve.benchmarks.hybrid_decode", "--one", engine,
                       "--batches", str(b), "--input-len", str(prefill or input_len),
                       "--new-tokens", str(1 if prefill else new), "--threads", str(threads)]
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
                if r.returncode != 0:
                    raise RuntimeError(f"{engine} batch {b} failed:\n{r.stderr[-3000:]}")
                raw[engine][b].append(json.loads(r.stdout.strip().splitlines()[-1])["tokens_per_s"])
        print(f"  run {run + 1} of {runs}: " + ", ".join(
            f"{e} " + "/".join(f"{raw[e][b][-1]:.1f}" for b in batches) for e in available), flush=True)
    context = input_len + new // 2
    return {"machine": machine(), "isa": isa_line(), "input_len": prefill or input_len,
            "new_tokens": 1 if prefill else new, "threads": threads, "read_bw_gbps": read_bandwidth() / 1e9,
            "results": {e: {b: spread(v) for b, v in row.items()} for e, row in raw.items()},
            "llama_builds": {e: f"{b} ({llama_cpp.BUILD_FLAGS[b]})" for e, b in builds.items()},
            "step_bytes": {e: step_bytes(model_dir, QUANT[e], context) for e in available if e in QUANT}}


def table(res: dict, prefill: bool) -> list[str]:
    r = res["results"]
    batches = sorted({int(b) for row in r.values() for b in row})
    unit = "prefill tok/s" if prefill else "output tok/s"
    lines = ["| engine | " + " | ".join(f"B={b} {unit}" for b in batches) + " | vs llama.cpp |",
             "|---|" + "---|" * (len(batches) + 1)]
    for e, row in r.items():
        peer = r.get(PEER.get(e, ""), {})
        ratios = "/".join(f"{row[b]['median'] / peer[b]['median']:.2f}x" for b in row if b in peer)
        cells = [f"{row[b]['median']:.1f} ({row[b]['min']:.1f}-{row[b]['max']:.1f})" for b in row]
        lines.append(f"| {e} | " + " | ".join(cells) + f" | {ratios} |")
    if not prefill:
        lines.append("")
        for e, sb in res["step_bytes"].items():
            one = r[e].get(1) or r[e].get("1")
            if one:
                share = sb["total"] * one["median"] / (res["read_bw_gbps"] * 1e9)
                lines.append(f"- {e}: a B=1 step reads {sb['total'] / 1e6:.0f} MB (weights "
                             f"{sb['weights'] / 1e6:.0f}, K/V {sb['kv'] / 1e6:.1f}, states "
                             f"{sb['states'] / 1e6:.1f}): {share:.0%} of {res['read_bw_gbps']:.1f} GB/s at "
                             "the output rate (prefill included)")
    return lines


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--prefill", type=int, default=None, metavar="N",
                    help="one N-token prompt's prefill instead")
    ap.add_argument("--llama-cpp", default=None,
                    help="a llama.cpp folder with its build (benchmarks/llama_cpp.py)")
    ap.add_argument("--llama-python", default=None, help="a Python with torch, transformers, sentencepiece")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # subprocess: one engine, one batch
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.one:
        import torch

        torch.set_num_threads(args.threads)
        v = one(args.one, checkpoint(), batches[0], args.input_len, args.new_tokens)
        print(json.dumps({"tokens_per_s": v}))
        return None
    res = measure(args.engines.split(","), batches, args.input_len, args.new_tokens, args.threads, args.runs,
                  args.llama_cpp, args.llama_python, args.prefill)
    print(f"{res['machine']}; {res['isa']}; read bandwidth {res['read_bw_gbps']:.1f} GB/s")
    print("\n".join(table(res, bool(args.prefill))))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
