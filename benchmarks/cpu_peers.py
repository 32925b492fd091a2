"""fusedserve against the CPU engines a user would pick, side by side in one run.

The model is Qwen3-0.6B's real configuration with random weights, written by the
project (``default:qwen3-0.6b``, 1.19 GB bf16). Every engine gets the same random
prompts as token ids (32 in, 64 out by default, greedy, EOS ignored), at batch
1/16/64, in a subprocess of its own (so none inherits another's threads or memory):

- fusedserve with bf16, int8 and int4 weights (``LLMEngine``; int8 and int4 multiply with int8
  activations on the native kernels); ``fusedserve-bf16-kv8``: bf16 weights over an int8 KV cache
  (``--kv-cache-dtype int8``), as OpenVINO keeps its KV cache in u8 by default on x86 CPUs;
- transformers ``generate`` (static batch), bf16;
- OpenVINO GenAI with fp16, int8 and int4 weights (group 32, symmetric), where an interpreter
  with ``openvino-genai`` is given (``--openvino-python``; the ``openvino`` extra), exported once
  with ``optimum-cli export openvino``; ``ContinuousBatchingPipeline`` for batches;
- llama.cpp with bf16, Q8_0 and Q4_0 weights, where a build is given (``--llama-cpp``;
  ``benchmarks/llama_cpp.py``);
- fusedserve reading llama.cpp's own Q8_0 and Q4_0 files (``fusedserve-gguf-q8_0``,
  ``fusedserve-gguf-q4_0``: int8 re-quantized per channel, Q4_0 as int4 bit for bit), against
  llama.cpp on the same files: the same weights, kernel against kernel.

``--isa avx2`` holds every engine to AVX2 + FMA + F16C on a wider host, as a stand-in for an
AVX2-only CPU: fusedserve's kernels built for AVX2 (``FUSEDSERVE_CPU_ISA``), ATen's and oneDNN's
dispatch capped (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``; OpenVINO computes in f32 without
dynamic int8 activations, as on an AVX2 CPU), and llama.cpp's AVX2 build. The memory system stays
the host's. The cap is partial for OpenVINO: its oneDNN kernels obey it, but some of its own JIT
kernels (RMS norm) and MLAS pick AVX-512 from the CPU's flags, so its figures are, if anything,
above an AVX2 CPU's.

Runs go round robin (run 1 of every engine and batch, then run 2, ...), so a machine whose
bandwidth drifts affects every engine alike. Figures: output tokens/s (the median, min and max
of ``RUNS`` runs, each a fresh process: a warm-up, then one timed generate), for batch 1 the
share of the measured read bandwidth (weight bytes per token x tokens/s), and each engine
against the best peer of its weight class (ratios of medians).
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

from fusedserve.benchmarks import llama_cpp
from fusedserve.benchmarks.common import RUNS, fmt, machine, read_bandwidth, spread
from fusedserve.coordinator.model_files.default_model import cache_root, default_model_dir
from fusedserve.kernels.native.build import cpu_flags

PRESET = "qwen3-0.6b"
# Environment that caps every engine at an instruction set (``--isa``); "native" leaves each its best.
ISA_ENV = {"native": {},
           "avx2": {"FUSEDSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                    "ONEDNN_MAX_CPU_ISA": "AVX2"}}
ENGINES = ("fusedserve-bf16", "fusedserve-bf16-kv8", "fusedserve-int8", "fusedserve-int4",
           "transformers-bf16", "openvino-fp16", "openvino-int8", "openvino-int4", "llamacpp-bf16",
           "llamacpp-q8_0", "llamacpp-q4_0",
           "fusedserve-gguf-q8_0", "fusedserve-gguf-q4_0")
SAME_FILE = {"fusedserve-gguf-q8_0": "llamacpp-q8_0", "fusedserve-gguf-q4_0": "llamacpp-q4_0"}
# Weight classes: fusedserve's engine first, its peers after.
CLASSES = {"16-bit": ("fusedserve-bf16", "openvino-fp16", "llamacpp-bf16"),
           "int8": ("fusedserve-int8", "openvino-int8", "llamacpp-q8_0"),
           "int4": ("fusedserve-int4", "openvino-int4", "llamacpp-q4_0")}
# fusedserve engines that differ from their class's first only in the KV cache, compared with its peers.
KV_VARIANTS = {"fusedserve-bf16-kv8": "16-bit"}


def prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    # Ids from the lower vocabulary: real text's ids; any id works for random weights.
    return np.random.default_rng(seed).integers(10, min(vocab, 30000), size=(n, input_len)).tolist()


# ------------------------------------------------------------------ engines (subprocess)

def fusedserve_generate(model_dir: Path, batch: list[list[int]], new: int, quantization: str | None,
                        device: str = "cpu", runs: int = RUNS, dtype: str = "bfloat16",
                        kv_cache_dtype: str = "auto") -> list[float]:
    """Output tokens/s of ``runs`` ``LLMEngine.generate`` calls over ``batch`` (a warm-up first)."""
    from fusedserve.coordinator.engine.llm_engine import LLMEngine
    from fusedserve.coordinator.sampling_params import SamplingParams

    total = len(batch[0]) + new + 1
    rc = dict(max_batch=len(batch), block_size=16, num_blocks=len(batch) * -(-total // 16) + 4,
              sampler_candidates=8)
    figures = []
    with LLMEngine(str(model_dir), dtype=dtype, quantization=quantization, **rc, max_model_len=total + 16,
                   device=device, kv_cache_dtype=kv_cache_dtype) as eng:
        eng.generate([batch[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for _ in range(runs):
            eng.core.scheduler.blocks.flush()  # every run prefills its prompts
            t0 = time.perf_counter()
            outs = eng.generate(batch, SamplingParams(max_tokens=new, ignore_eos=True))
            figures.append(len(batch) * new / (time.perf_counter() - t0))
            assert all(len(o.token_ids) == new for o in outs)
    return figures


def _openvino(ov_dir: Path, batch: list[list[int]], new: int, runs: int = RUNS,
              isa: str = "native") -> list[float]:
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
    # Held to AVX2, OpenVINO must be told what it does on an AVX2-only CPU: compute in f32, and no
    # dynamic int8 activations (its brgemm needs VNNI). It picks bf16 and VNNI from the CPU's flags,
    # which ONEDNN_MAX_CPU_ISA does not hide, and oneDNN then refuses those primitives.
    props = {} if isa == "native" else {"INFERENCE_PRECISION_HINT": "f32",
                                        "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
    pipe = genai.ContinuousBatchingPipeline(str(ov_dir), sched, "CPU", props)
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


def run_engine(engine: str, model_dir: Path, ov_root: Path, batch: list[list[int]], new: int,
               runs: int = RUNS, isa: str = "native") -> list[float]:
    quant = {"fusedserve-bf16": None, "fusedserve-int8": "int8", "fusedserve-int4": "int4"}
    if engine in quant:
        return fusedserve_generate(model_dir, batch, new, quant[engine], runs=runs)
    if engine == "fusedserve-bf16-kv8":
        return fusedserve_generate(model_dir, batch, new, None, runs=runs, kv_cache_dtype="int8")
    if engine in SAME_FILE:  # llama.cpp's file for its peer, made by measure() before
        path = cache_root() / f"llamacpp-{model_dir.name}" / f"{llama_cpp.WEIGHTS[SAME_FILE[engine]]}.gguf"
        return fusedserve_generate(path, batch, new, None, runs=runs)
    if engine == "transformers-bf16":
        import torch

        from fusedserve.benchmarks.throughput import transformers_generate

        return transformers_generate(batch, new, "bfloat16", torch.get_num_threads(), model_dir, runs=runs)
    if engine.startswith("openvino-"):
        return _openvino(ov_root / engine.split("-", 1)[1], batch, new, runs, isa)
    raise ValueError(f"unknown engine {engine!r}")


# ----------------------------------------------------------------------------- driver

def export_openvino(python: str, model_dir: Path, ov_root: Path) -> None:
    """``optimum-cli export openvino`` once per weight format (cached next to the model)."""
    cli = Path(python).parent / "optimum-cli"
    int4 = ["--sym", "--group-size", "32", "--ratio", "1.0"]  # as llama.cpp's Q4_0 and fusedserve's int4
    for weights, extra in (("fp16", []), ("int8", []), ("int4", int4)):
        out = ov_root / weights
        if (out / "openvino_model.xml").is_file():
            continue
        tmp = ov_root / f".{weights}-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([str(cli), "export", "openvino", "-m", str(model_dir), "--task",
                        "text-generation-with-past", "--weight-format", weights, *extra, str(tmp)],
                       check=True, stdout=subprocess.DEVNULL)
        tmp.rename(out)


def weight_bytes_per_token(model_dir: Path, quantization: str | None) -> int:
    """Bytes of weights fusedserve's decode step streams (lm_head included, the embedding gather
    not): 2 a parameter in 16 bits, 1 in int8; int4 layers 0.5625 (an fp16 scale per 32) and an
    int8 lm_head."""
    from fusedserve.kernels.model_description.config import Qwen3Config

    c = Qwen3Config.from_dir(model_dir)
    per_layer = (c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size \
        + 3 * c.intermediate_size * c.hidden_size
    layers, head = c.num_hidden_layers * per_layer, c.vocab_size * c.hidden_size
    if quantization == "int4":
        return int(layers * 0.5625) + head
    return (layers + head) * (1 if quantization else 2)


def measure(engines: list[str], batches: list[int], input_len: int, new: int, threads: int,
            openvino_python: str | None, llama_dir: str | None = None, llama_python: str | None = None,
            runs: int = RUNS, isa: str = "native") -> dict:
    model_dir = default_model_dir(PRESET)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ov_root = cache_root() / f"openvino-{model_dir.name}"
    if openvino_python:
        export_openvino(openvino_python, model_dir, ov_root)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **ISA_ENV[isa]}
    available = [e for e in engines if (not e.startswith("openvino-") or openvino_python)
                 and (not (e.startswith("llamacpp-") or e in SAME_FILE) or llama_dir)]
    ggufs = {e: llama_cpp.gguf(Path(llama_dir), llama_python or sys.executable, model_dir,
                               cache_root() / f"llamacpp-{model_dir.name}", e)
             for e in available if e.startswith("llamacpp-")}
    for e in available:
        if e in SAME_FILE:
            llama_cpp.gguf(Path(llama_dir), llama_python or sys.executable, model_dir,
                           cache_root() / f"llamacpp-{model_dir.name}", SAME_FILE[e])
    flags = cpu_flags()
    builds = {e: llama_cpp.build_for(e, isa, flags) for e in ggufs}
    raw: dict[str, dict[int, list[float]]] = {e: {b: [] for b in batches} for e in available}
    for run in range(runs):  # round robin: every engine and batch once per run
        for engine in available:
            if engine in ggufs:
                for b, v in llama_cpp.batched_bench(Path(llama_dir), ggufs[engine], batches, input_len, new,
                                                    threads, builds[engine]).items():
                    raw[engine][b].append(v)
                continue
            python = openvino_python if engine.startswith("openvino-") else sys.executable
            for b in batches:
                cmd = [python, "-m", "fusedserve.benchmarks.cpu_peers", "--one", engine, "--batches", str(b),
                       "--input-len", str(input_len), "--new-tokens", str(new), "--runs", "1", "--isa", isa]
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
                if r.returncode != 0:
                    raise RuntimeError(f"{engine} batch {b} failed:\n{r.stderr[-3000:]}")
                raw[engine][b] += json.loads(r.stdout.strip().splitlines()[-1])["tokens_per_s"]
        print(f"  run {run + 1} of {runs}: " + ", ".join(
            f"{e} " + "/".join(f"{raw[e][b][-1]:.1f}" for b in batches) for e in available), flush=True)
    results = {e: {b: spread(v) for b, v in row.items()} for e, row in raw.items()}
    bw = read_bandwidth()
    return {"machine": machine(), "isa": isa, "model": f"default:{PRESET}", "input_len": input_len,
            "new_tokens": new,
            "threads": threads, "read_bw_gbps": bw / 1e9, "results": results, "vocab": vocab,
            "llama_builds": {e: f"{b} ({llama_cpp.BUILD_FLAGS[b]})" for e, b in builds.items()},
            "weight_bytes": {"16-bit": weight_bytes_per_token(model_dir, None),
                             "int8": weight_bytes_per_token(model_dir, "int8"),
                             "int4": weight_bytes_per_token(model_dir, "int4")}}


def llama_builds(res: dict) -> str:
    """Which llama.cpp build ran which weights in ``res`` (a ``measure`` result), e.g. "`build`
    (GGML_NATIVE=ON) for bf16, Q8_0, Q4_0"; "" where no llama.cpp engine ran."""
    by_build: dict[str, list[str]] = {}
    for engine, build in res.get("llama_builds", {}).items():
        by_build.setdefault(build, []).append(llama_cpp.WEIGHTS[engine])
    parts = []
    for build, kinds in by_build.items():
        folder, flags = build.split(" ", 1)
        why = " (they crash in its AMX path on this CPU)" if folder == llama_cpp.NO_AMX_BUILD else ""
        parts.append(f"`{folder}` {flags} for {', '.join(kinds)}{why}")
    return "; ".join(parts)


def table(res: dict) -> list[str]:
    """Markdown: tok/s per batch as median (min-max), batch-1 share of read bandwidth, and per
    weight class fusedserve's ratio to the best peer measured (ratios of medians)."""
    full = {e: {int(b): v for b, v in row.items()} for e, row in res["results"].items()}
    r = medians(res)
    batches = sorted({b for v in r.values() for b in v})
    lines = ["| engine | " + " | ".join(f"batch {b}" for b in batches)
             + " | batch 1 % of read bw (fusedserve's bytes) |", "|---" * (len(batches) + 2) + "|"]
    for engine, row in r.items():
        cls = next((k for k, v in CLASSES.items() if engine in v or SAME_FILE.get(engine) in v), "16-bit")
        wb = res["weight_bytes"].get(cls, res["weight_bytes"]["16-bit"])
        bw = f"{100 * row[1] * wb / (res['read_bw_gbps'] * 1e9):.0f}%" if 1 in row else "-"
        lines.append(f"| {engine} | " + " | ".join(fmt(full[engine][b]) if b in row else "-" for b in batches)
                     + f" | {bw} |")
    lines += ["", "| ratio of medians | " + " | ".join(f"batch {b}" for b in batches) + " |",
              "|---" * (len(batches) + 1) + "|"]
    for ours, cls in [*((c[0], name) for name, c in CLASSES.items()), *KV_VARIANTS.items()]:
        have = [p for p in CLASSES[cls][1:] if p in r]
        if ours in r and have:
            lines.append(f"| {ours} / best of {', '.join(have)} ({cls}) | " + " | ".join(
                f"{r[ours][x] / max(r[p][x] for p in have):.2f}x" for x in batches) + " |")
    for ours, peer in SAME_FILE.items():
        if ours in r and peer in r:
            lines.append(f"| {ours} / {peer} (the same GGUF file) | " + " | ".join(
                f"{r[ours][x] / r[peer][x]:.2f}x" for x in batches) + " |")
    if "fusedserve-bf16" in r and "transformers-bf16" in r:
        lines.append("| fusedserve-bf16 / transformers-bf16 | " + " | ".join(
            f"{r['fusedserve-bf16'][x] / r['transformers-bf16'][x]:.2f}x" for x in batches) + " |")
    return lines


def prefill_table(res: dict) -> list[str]:
    """Markdown for a ``--prefill`` run: seconds from one prompt to its first token, median
    (min-max), and per weight class the best peer's median over fusedserve's (above 1: faster)."""
    lines = [f"| engine | {res['input_len']}-token prompt to first token, s |", "|---|---|"]
    secs = {}
    for engine, row in res["results"].items():
        v = next(iter(row.values()))  # tokens/s of the one new token: 1 / seconds
        secs[engine] = {"median": 1 / v["median"], "fastest": 1 / v["max"], "slowest": 1 / v["min"]}
        lines.append(f"| {engine} | {secs[engine]['median']:.2f} ({secs[engine]['fastest']:.2f}-"
                     f"{secs[engine]['slowest']:.2f}) |")
    lines += ["", "| ratio of medians (peer s / fusedserve s) | |", "|---|---|"]
    for cls, (ours, *peers) in CLASSES.items():
        have = [p for p in peers if p in secs]
        if ours in secs and have:
            ratio = min(secs[p]["median"] for p in have) / secs[ours]["median"]
            lines.append(f"| {ours} vs best of {', '.join(have)} ({cls}) | {ratio:.2f}x |")
    return lines


DECODE_TOKENS = 256  # long enough that the prefill's run-to-run spread is a small share of the difference


def decode_at(engines: list[str], context: int, threads: int, openvino_python: str | None,
              llama_dir: str | None, llama_python: str | None, runs: int, isa: str) -> dict:
    """Batch-1 decode tokens/s after a ``context``-token prompt: each engine times the prompt to
    1 token and to ``DECODE_TOKENS + 1``; the difference is the decode alone."""
    peers = (threads, openvino_python, llama_dir, llama_python, runs, isa)
    first = measure(engines, [1], context, 1, *peers)
    full = measure(engines, [1], context, DECODE_TOKENS + 1, *peers)
    rates = {}
    for engine in full["results"]:
        f1, fn = medians(first)[engine][1], medians(full)[engine][1]
        rates[engine] = DECODE_TOKENS / ((DECODE_TOKENS + 1) / fn - 1 / f1)
    return {"machine": full["machine"], "isa": isa, "context": context, "runs": runs, "decode_tok_s": rates,
            "prefill_s": {e: 1 / medians(first)[e][1] for e in first["results"]},
            "llama_builds": full.get("llama_builds", {}),
            "openvino_kv_cache_precision": openvino_kv_precision(openvino_python)}


def openvino_kv_precision(python: str | None) -> str | None:
    """The KV cache precision OpenVINO's CPU plugin picks on this host (its default), or None."""
    if not python:
        return None
    code = "import openvino as ov; print(ov.Core().get_property('CPU', 'KV_CACHE_PRECISION').to_string())"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return r.stdout.strip() or None if r.returncode == 0 else None


def decode_table(res: dict) -> list[str]:
    lines = [f"| engine | batch-1 decode tok/s at context {res['context']} | prefill of it, s |",
             "|---|---|---|"]
    for engine, v in res["decode_tok_s"].items():
        lines.append(f"| {engine} | {v:.1f} | {res['prefill_s'][engine]:.2f} |")
    r = res["decode_tok_s"]
    for ours, cls in [*((c[0], name) for name, c in CLASSES.items()), *KV_VARIANTS.items()]:
        have = [p for p in CLASSES[cls][1:] if p in r]
        if ours in r and have:
            ratio = r[ours] / max(r[p] for p in have)
            lines.append(f"| {ours} / best of {', '.join(have)} ({cls}) | {ratio:.2f}x | |")
    if res.get("openvino_kv_cache_precision"):
        lines += ["", f"OpenVINO's KV cache precision on this CPU (its default): "
                  f"`{res['openvino_kv_cache_precision']}`; llama.cpp's: f16 (its default)."]
    return lines


def medians(res: dict) -> dict[str, dict[int, float]]:
    return {e: {int(b): v["median"] if isinstance(v, dict) else v for b, v in row.items()}
            for e, row in res["results"].items()}


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--openvino-python", default=None,
                    help="an interpreter with openvino-genai and optimum-intel (the 'openvino' extra)")
    ap.add_argument("--llama-cpp", default=None,
                    help="a built llama.cpp source folder (benchmarks/llama_cpp.py)")
    ap.add_argument("--llama-python", default=None,
                    help="a python with torch, transformers, numpy and sentencepiece for the GGUF conversion")
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--isa", choices=sorted(ISA_ENV), default="native",
                    help="cap every engine at this instruction set (avx2: an AVX2-only CPU's kernels)")
    ap.add_argument("--prefill", type=int, default=None, metavar="N",
                    help="time one N-token prompt to its first token instead (batch 1, one new token)")
    ap.add_argument("--decode-at", type=int, default=None, metavar="N",
                    help=f"batch-1 decode tokens/s after an N-token prompt instead: {DECODE_TOKENS} / (time "
                    f"to {DECODE_TOKENS + 1} tokens - time to 1), from the medians of each")
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
                             prompts(batches[0], args.input_len, vocab, seed=batches[0]), args.new_tokens,
                             args.runs, args.isa)
        print(json.dumps({"tokens_per_s": figures}))
        return None
    if args.decode_at:
        res = decode_at(args.engines.split(","), args.decode_at, args.threads, args.openvino_python,
                        args.llama_cpp, args.llama_python, args.runs, args.isa)
        print(f"{res['machine']}; instruction set {args.isa}")
        print("\n".join(decode_table(res)))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return res
    if args.prefill:
        batches, args.input_len, args.new_tokens = [1], args.prefill, 1
    res = measure(args.engines.split(","), batches, args.input_len, args.new_tokens, args.threads,
                  args.openvino_python, args.llama_cpp, args.llama_python, args.runs, args.isa)
    print(f"{res['machine']}; instruction set {args.isa}; read bandwidth {res['read_bw_gbps']:.1f} GB/s")
    print("\n".join(prefill_table(res) if args.prefill else table(res)))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
