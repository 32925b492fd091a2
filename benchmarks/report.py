"""Regenerate BENCHMARKS.md and the tokens/s plot: ``python -m benchmarks.report``.

Runs every benchmark on the project-written ~440 MB checkpoint and writes the
commands, the machine, the figures and the targets (met or not) in one file.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from benchmarks import (
    chunked_prefill,
    cpu_peers,
    cuda_peers,
    d2h,
    decode_step,
    latency,
    prefix_cache,
    serving,
    throughput,
)
from benchmarks.common import checkpoint
from kernels.model.default_model import default_model_dir

ROOT = Path(__file__).resolve().parents[1]
CUDA_RESULTS = ROOT / "benchmarks" / "results" / "cuda_peers.json"


def transformers_curve(batches: list[int], output_len: int, dtype: str, threads: int) -> dict[int, float]:
    import json

    v = json.loads((checkpoint() / "config.json").read_text())["vocab_size"]
    return {b: throughput.transformers_generate(throughput.prompts(b, 32, v, seed=b), output_len, dtype, threads)
            for b in batches}


def plot(ds: dict, hf: dict[int, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = ds["rows"]
    ax.plot([r["batch"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", label="fusedserve decode step")
    ax.plot(list(hf), list(hf.values()), "s--", label="transformers generate")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Decode throughput, {ds['dtype']}, 2 CPU threads")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_peers(peers: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for engine, row in peers["results"].items():
        ax.plot(list(row), list(row.values()), "o-" if engine.startswith("fusedserve") else "s--", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Qwen3-0.6B shape, 32 in / 64 out, 2 CPU threads")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def peer_section(args, t: list) -> list[str]:
    """Issue 13's side-by-side: fusedserve (16-bit, int8) vs transformers and OpenVINO GenAI."""
    model = str(default_model_dir(cpu_peers.PRESET))
    peers = cpu_peers.measure(list(cpu_peers.ENGINES), [1, 16, 64], 32, 64, args.threads, args.openvino_python)
    steps = {q: decode_step.run([1, 16, 64], context=128, steps=8, dtype="bfloat16", quantization=q,
                                model_dir=model) for q in (None, "int8")}
    ctx = {c: decode_step.run([8], context=c, steps=8, dtype="bfloat16", model_dir=model)["rows"][0]
           for c in (128, 2000)}
    png = Path(args.out).with_name("benchmarks_cpu_peers.png")
    plot_peers(peers, png)
    r = peers["results"]
    kernels = steps[None]["kernels"]
    lines = ["", "## CPU peers on a Qwen3-0.6B-shaped checkpoint (issue 13)", "",
             f"`python -m benchmarks.cpu_peers --openvino-python PY` ({peers['model']}: the real config, random "
             f"weights; 32 prompt / 64 new tokens, greedy, {peers['threads']} threads, each engine in a subprocess "
             f"of its own). Read bandwidth in this run: {peers['read_bw_gbps']:.1f} GB/s. fusedserve kernels: "
             f"linear `{kernels['linear']}`, attention `{kernels['attention']}`. Output tokens/s, prefill included:",
             "", *cpu_peers.table(peers), "", f"![CPU peers]({png.name})", "",
             "Decode step alone on the same checkpoint (in-process launch path, context 128):", "",
             "| weights | batch | ms/step | tok/s | % of read bw |", "|---|---|---|---|---|"]
    for q, res in steps.items():
        for row in res["rows"]:
            lines.append(f"| {q or 'bf16'} | {row['batch']} | {row['step_ms']:.1f} | {row['tokens_per_s']:.1f} "
                         f"| {100 * row['fraction_of_read_bw']:.0f}% |")
    c128, c2000 = ctx[128], ctx[2000]
    grow, bytes_grow = c2000["step_ms"] / c128["step_ms"], c2000["bytes_read"] / c128["bytes_read"]
    lines += ["", f"Long context, batch 8: {c128['step_ms']:.1f} ms/step at context 128, {c2000['step_ms']:.1f} "
              f"at 2000 ({grow:.2f}x); the bytes a step must read (weights + K/V) grow {bytes_grow:.2f}x, so a "
              "step bound by memory bandwidth cannot grow less than that."]
    b1 = steps[None]["rows"][0]
    if "openvino-fp16" in r:
        t.append(("ahead of OpenVINO at batch 1 and 16, 16-bit weights (bf16 vs fp16)",
                  all(r["fusedserve-bf16"][b] > r["openvino-fp16"][b] for b in (1, 16)),
                  ", ".join(f"B={b}: {r['fusedserve-bf16'][b] / r['openvino-fp16'][b]:.2f}x" for b in (1, 16))))
        t.append(("ahead of OpenVINO at batch 1 and 16, int8 weights",
                  all(r["fusedserve-int8"][b] > r["openvino-int8"][b] for b in (1, 16)),
                  ", ".join(f"B={b}: {r['fusedserve-int8'][b] / r['openvino-int8'][b]:.2f}x" for b in (1, 16))))
    t += [("batch-1 decode step >= 70% of read bandwidth, 16-bit weights (0.6B)", b1["fraction_of_read_bw"] >= 0.7,
           f"{100 * b1['fraction_of_read_bw']:.0f}%"),
          (">= 3x transformers at batch 16 (0.6B, bf16 weights)",
           r["fusedserve-bf16"][16] >= 3 * r["transformers-bf16"][16],
           f"{r['fusedserve-bf16'][16] / r['transformers-bf16'][16]:.2f}x"),
          ("decode step at context 2000 <= 1.3x context 128, batch 8", grow <= 1.3,
           f"{grow:.2f}x (bytes read: {bytes_grow:.2f}x)")]
    return lines


def engine_section(args, t: list) -> list[str]:
    """Issue 14's figures: prefix-cache TTFT, inter-token gaps under long arrivals, d2h per step."""
    pc = prefix_cache.run("default:benchmark", 1000, 24, 5, args.dtype)
    model = prefix_cache.resolve_model("default:benchmark")
    gaps = [chunked_prefill.gaps(model, b, 8, 2, 2000, args.dtype) for b in (0, 256)]
    dh = d2h.run("default:benchmark", 16, args.dtype)
    on, off = pc["cache_on"], pc["cache_off"]
    lines = ["", "## Prefix caching, chunked prefill, device sampling (issue 14)", "",
             "`python -m benchmarks.prefix_cache` (a 1,000-token shared system prompt + 24 tokens per request, "
             f"{args.dtype}, one token out): cache on, first request {on['first_ms']:.0f} ms, cached requests "
             f"{on['later_ms_median']:.0f} ms (median), **{pc['speedup']:.1f}x**; cache off {off['first_ms']:.0f} / "
             f"{off['later_ms_median']:.0f} ms.", "",
             "`python -m benchmarks.chunked_prefill` (8 streams decoding while 2 prompts of 2,000 tokens arrive):", "",
             "| setting | inter-token gap p50 ms | p99 ms | max ms | long prompts' first token s |", "|---|---|---|---|---|"]
    for g in gaps:
        name = "no chunking" if not g["budget"] else f"--max-num-batched-tokens {g['budget']}"
        lines.append(f"| {name} | {g['p50_ms']:.0f} | {g['p99_ms']:.0f} | {g['max_ms']:.0f} | {g['window_s']:.2f} |")
    lines += ["", f"`python -m benchmarks.d2h` (batch {dh['batch']}, vocab {dh['vocab']}; mixed = greedy, top-p, top-k "
              "and min-p with top-5 logprobs, one each of four rows): d2h bytes per decode step", "",
              "| batch | device sampling | host fallback | anchor's full logits |", "|---|---|---|---|"]
    for name, r in dh["rows"].items():
        lines.append(f"| {name} | {r['device']:.0f} | {r['host']:.0f} | {r['anchor_full_logits']} |")
    t += [("cached TTFT >= 5x faster with a shared 1,000-token system prompt", pc["speedup"] >= 5,
           f"{pc['speedup']:.1f}x"),
          ("top-p-only batch d2h == B x 4 (device sampling)", dh["rows"]["top-p only"]["device"] == 4 * dh["batch"],
           f"{dh['rows']['top-p only']['device']:.0f} B")]
    return lines


def cuda_section(t: list) -> list[str]:
    """The stored CUDA run: this machine has no GPU, so the figures are those a GPU machine
    measured with ``bash benchmarks/gpu_check.sh`` (its ``cuda_peers.json``), not re-run here."""
    import json

    if not CUDA_RESULTS.is_file():
        return []
    res = json.loads(CUDA_RESULTS.read_text())
    lines = ["", f"## On a CUDA GPU ({res['gpu']}; stored run of {res['date']})", "",
             "Not measured on this machine: `bash benchmarks/gpu_check.sh OUT` ran the CUDA tests and "
             "`python -m benchmarks.cuda_peers` on a GPU machine, and its JSON is kept in "
             f"`benchmarks/results/cuda_peers.json`. Machine there: {res['machine']}. Model: `{res['model']}` "
             f"(bf16), {res['input_len']} in / {res['new_tokens']} out, greedy; fusedserve's `LLMEngine` "
             "(decode graphs, async scheduling, device sampling) and transformers' `generate` on the same GPU "
             "in the same run. Output tokens/s, prefill included:", ""]
    lines += cuda_peers.table(res)
    fs, hf = res["results"].get("fusedserve-bf16", {}), res["results"].get("transformers-bf16", {})
    if fs and hf:
        worst = min(fs[b] / hf[b] for b in fs if b in hf)
        t.append(("ahead of transformers on the same CUDA GPU at every batch (stored GPU run)", worst > 1,
                  f"lowest ratio {worst:.2f}x"))
    return lines


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--openvino-python", default=None,
                    help="an interpreter with the 'openvino' extra: OpenVINO GenAI joins the CPU peers")
    args = ap.parse_args(argv)
    t0 = time.time()
    ds = decode_step.run([1, 2, 4, 8, 16, 32, 64], context=128, steps=12, dtype=args.dtype)
    tp16 = throughput.run(16, 32, 64, args.dtype, args.threads)
    tp1 = throughput.run(1, 32, 64, args.dtype, args.threads)
    lat = latency.latency([1, 4, 16], 32, 32, args.dtype, args.threads)
    served = serving.bench([1, 8, 32], 32, 32, args.dtype, args.threads)
    ovh = latency.overhead([1, 16, 64], 32, args.dtype, args.threads)
    hf = transformers_curve([1, 4, 16, 64], 32, args.dtype, args.threads)
    png = Path(args.out).with_name("benchmarks_tokens_per_s.png")
    plot(ds, hf, png)
    by_b = {r["batch"]: r for r in ds["rows"]}
    b16 = {r["batch"]: r for r in ovh if r["transport"] == "shm" and not r["async"]}.get(16)
    a16 = {r["batch"]: r for r in ovh if r["transport"] == "shm" and r["async"]}.get(16)
    lines = [
        "# Benchmarks", "",
        "Regenerate everything here with one command: `.venv/bin/python -m benchmarks.report` "
        "(needs `pip install -e '.[bench]'`). Each part also runs alone: "
        "`python -m benchmarks.decode_step`, `python -m benchmarks.throughput`, `python -m benchmarks.latency`.",
        "", f"Machine: {ds['machine']}.", "",
        f"Checkpoint: the project-written `default:benchmark` Qwen3 ({ds['weights_bytes'] / 2**20:.0f} MiB of "
        f"weights read per decode step in {ds['dtype']}, random weights, fixed seed). "
        f"Measured bandwidth: {ds['read_bw_gbps']:.1f} GB/s read (sum), {ds['copy_bw_gbps']:.1f} GB/s copy (r+w).",
        "", "## Decode step (one worker, in-process launch path, greedy, context 128)", "",
        "| batch | ms/step | tokens/s | bytes read/step | GB/s | % of read bw | h2d B/step | d2h B/step "
        "| anchor's logits d2h (B x V x 4) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ds["rows"]:
        lines.append(f"| {r['batch']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.1f} | {r['bytes_read'] / 2**20:.0f} MiB "
                     f"| {r['achieved_gbps']:.1f} | {100 * r['fraction_of_read_bw']:.0f}% | {r['h2d_bytes']} "
                     f"| {r['d2h_bytes']} | {r['anchor_logits_d2h']} |")
    lines += ["", f"![tokens/s vs batch]({png.name})", "",
              "## Throughput through the server vs transformers `generate` (same run)", "",
              "| prompts | in/out tokens | fusedserve req/s | fusedserve out tok/s | transformers out tok/s | ratio |",
              "|---|---|---|---|---|---|"]
    for tp in (tp1, tp16):
        s = tp["fusedserve"]
        lines.append(f"| {tp['n']} | {tp['input_len']}/{tp['output_len']} | {s['requests_per_s']:.2f} | "
                     f"{s['output_tokens_per_s']:.1f} | {tp['transformers_tokens_per_s']:.1f} | {tp['ratio']:.2f}x |")
    lines += ["", "transformers `generate` by batch (32 output tokens): " +
              ", ".join(f"B={b}: {v:.1f} tok/s" for b, v in hf.items()), "",
              "## Latency through the server (streaming clients, 32 in / 32 out)", "",
              "| concurrency | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms |", "|---|---|---|"]
    for r in lat:
        lines.append(f"| {r['concurrency']} | {r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
                     f"| {r['tpot_p50_ms']:.1f} / {r['tpot_p90_ms']:.1f} / {r['tpot_p99_ms']:.1f} |")
    lines += ["", "## Served over the OpenAI API (`fusedserve bench serve`, 32 words in / 32 tokens out)", "",
              "`fusedserve serve --http-port` on the same checkpoint, streaming completions, at most C in flight.",
              "", "| concurrency C | req/s | output tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms |",
              "|---|---|---|---|---|"]
    for r in served:
        lines.append(f"| {r['concurrency']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                     f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p90']:.0f} / {r['ttft_ms_p99']:.0f} | "
                     f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p90']:.1f} / {r['tpot_ms_p99']:.1f} |")
    lines += ["", "## The coordinator's share of a decode step", "",
              "Seen from the worker, steady decode steps at the full batch. *Gap*: from the end of one launch "
              "to the start of the next. *Waiting for the coordinator*: the part of the gap the worker spent "
              "blocked on the next descriptor after sending its reply (the coordinator reading ids, streaming "
              "to clients, checking stops, scheduling, writing the arena, and the IPC); the rest is the "
              "worker's own reply and descriptor decoding. Shares are of the whole step (gap + launch). With "
              "async scheduling (the default) the next descriptor is already queued when a launch ends.", "",
              "| transport | async scheduling | batch | steps | launch ms | gap ms (share) "
              "| waiting for the coordinator ms | coordinator share |",
              "|---|---|---|---|---|---|---|---|"]
    for r in ovh:
        lines.append(f"| {r['transport']} | {'on' if r['async'] else 'off'} | {r['batch']} | {r['steps']} "
                     f"| {r['launch_ms']:.2f} | {r['gap_ms']:.3f} ({r['gap_pct']:.2f}%) | {r['overhead_ms']:.3f} "
                     f"| {r['overhead_pct']:.2f}% |")
    t = [
        ("decode throughput >= 3x transformers at batch 16 (server, 16 prompts)", tp16["ratio"] >= 3,
         f"{tp16['ratio']:.2f}x"),
        ("ahead of transformers at batch 1", tp1["ratio"] > 1, f"{tp1['ratio']:.2f}x"),
        ("batch-1 decode step >= 60% of the read-bandwidth limit", by_b[1]["fraction_of_read_bw"] >= 0.6,
         f"{100 * by_b[1]['fraction_of_read_bw']:.0f}%"),
        ("coordinator + IPC overhead < 5% of the step at batch 16 (async scheduling off)",
         b16 is not None and b16["gap_pct"] < 5, f"{b16['gap_pct']:.1f}%" if b16 else "n/a"),
        ("coordinator's share of the step < 1% with async scheduling (batch 16, shm)",
         a16 is not None and a16["overhead_pct"] < 1, f"{a16['overhead_pct']:.2f}%" if a16 else "n/a"),
        ("greedy d2h bytes per step == B x 4", all(r["d2h_bytes"] == 4 * r["batch"] for r in ds["rows"]),
         ", ".join(f"B={r['batch']}: {r['d2h_bytes']}" for r in ds["rows"][:3]) + ", ..."),
    ]
    lines += peer_section(args, t)
    lines += engine_section(args, t)
    lines += cuda_section(t)
    lines += ["", "## Targets", "", "| target | met | figure |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if ok else 'no'} | {fig} |" for name, ok, fig in t]
    lines += ["", f"_Generated in {time.time() - t0:.0f} s._", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
