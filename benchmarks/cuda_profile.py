"""Where a CUDA decode step spends its time, on the ATen path and the Triton path in one run.

    python -m fusedserve.benchmarks.cuda_profile [--json OUT] [--models 0.6b,8b] [--calls 20]

For each kernel path (ATen's ops, and ``FUSEDSERVE_TRITON=1``'s fused kernels and paged
attention) and each model (Qwen3-0.6B's shape from the project-written checkpoint; Qwen3-8B's
shape with random weights made on the device: 36 layers, hidden 4096, 32/8 heads of 128,
intermediate 12288, vocabulary 151936), at batch 1/16/64 with context 128 and batch 32 with
context 4096, greedy:
- the step: the whole launch path (wall: arena copies, id feed, one graph replay with the sampler
  inside, counted copy-back), the replay alone (CUDA events), and launch minus replay (the
  host side of a step);
- the sampled step: the same launch and replay with every row sampling (temperature 0.8, top-p
  0.9 over the whole vocabulary: the every-stage graph), and its ratio to the greedy replay;
- kernels per replay and per layer (torch.profiler), and per layer by kernel name;
- bytes the step reads (weights once, plus every row's K/V) against the measured read bandwidth;
- on the Triton path, the attention kernels' own GPU time and the bandwidth they reach on the K/V
  bytes they read (the paged decode kernels are named, so the profiler can sum them).

- ``max_model_len`` 40,960 (Qwen3's own) against 4,128 at the same context (batch 32 at 4,096,
  the 0.6B shape): what a row costs must follow its own length, not the longest allowed.

A replay far above the weights' read time with thousands of kernels means the step is bound by
kernel count, not bandwidth. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from fusedserve.benchmarks.common import machine, read_bandwidth
from fusedserve.benchmarks.decode_step import bench_runner, greedy_batch, launch, weight_bytes
from fusedserve.coordinator.model_files.default_model import default_model_dir
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.worker.graphs import EVERY_STAGE, GREEDY
from fusedserve.worker.model.qwen3 import Qwen3Model
from fusedserve.worker.model.weights import LayerWeights, Qwen3Weights

CASES = [(1, 128), (16, 128), (64, 128), (32, 4096)]  # (batch, context)
LONG_CASE, LONG_MAX_LEN = (32, 4096), 40960  # Qwen3's max_model_len, against CASES' context + 32
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=1 << 30)
QWEN3_8B = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, tie_word_embeddings=False, eos_token_ids=(151645,))
ATTENTION_KERNELS = ("_split_kernel", "_merge_kernel")  # kernels/triton/decode_attention.py


def _gpu_ms(fn, n: int) -> float:
    """Mean GPU milliseconds of ``fn`` over ``n`` calls (CUDA events, after a warm-up; wall time
    off CUDA, where this runs only to check the code: tests/kernels/test_decode_step.py)."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _kernels(fn) -> tuple[int, float, dict[str, int]]:
    """CUDA kernels one call of ``fn`` runs, the GPU ms of the paged attention kernels among them,
    and how many of each kernel name ran."""
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    kind = "cuda" if cuda else "cpu"  # off CUDA: the ATen ops, to check the code runs
    events = [e for e in prof.events()
              if kind in str(e.device_type).lower() and (cuda or e.name.startswith("aten"))]
    attention_us = sum(e.device_time for e in events if any(k in e.name for k in ATTENTION_KERNELS))
    names: dict[str, int] = {}
    for e in events:
        names[e.name[:80]] = names.get(e.name[:80], 0) + 1
    return len(events), attention_us / 1e3, dict(sorted(names.items(), key=lambda kv: -kv[1]))


def _launch_ms(runner, desc, calls: int) -> float:
    """Wall milliseconds of the whole launch path, after a warm-up."""
    for _ in range(3):
        runner.execute(desc)
    t0 = time.perf_counter()
    for _ in range(calls):
        runner.execute(desc)
    return (time.perf_counter() - t0) / calls * 1e3


def sampled_batch(tables: np.ndarray, ctx: int, bs: int):
    """``greedy_batch`` with every row sampling over the whole vocabulary (top-p 0.9)."""
    batch = greedy_batch(tables, ctx, bs)
    for seq in batch.seqs:
        seq.params = SAMPLED
    return batch


def random_model(config: Qwen3Config, max_model_len: int, device: str = "cuda") -> Qwen3Model:
    """A bf16 model of ``config``'s shape with random weights made on the device (no checkpoint)."""
    g = torch.Generator(device=device).manual_seed(0)
    kw = {"dtype": torch.bfloat16, "device": device}
    c, hidden = config, config.hidden_size

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, **kw).mul_(std)

    def norm(n: int) -> torch.Tensor:
        return torch.ones(n, **kw)

    qkv = c.q_size + 2 * c.kv_size
    layers = [LayerWeights(input_norm=norm(hidden), qkv=rand(qkv, hidden, std=hidden**-0.5), qkv_bias=None,
                           q_norm=norm(c.head_dim), k_norm=norm(c.head_dim),
                           o_proj=rand(hidden, c.q_size, std=c.q_size**-0.5), post_norm=norm(hidden),
                           gate_up=rand(2 * c.intermediate_size, hidden, std=hidden**-0.5),
                           down=rand(hidden, c.intermediate_size, std=c.intermediate_size**-0.5))
              for _ in range(c.num_hidden_layers)]
    weights = Qwen3Weights(embed=rand(c.vocab_size, hidden, std=1.0), layers=layers, final_norm=norm(hidden),
                           lm_head=rand(c.vocab_size, hidden, std=2.0 * hidden**-0.5))
    return Qwen3Model(config, weights, torch.bfloat16, device, max_model_len)


def _replay(graphs, b: int, plan):
    """The captured graph of ``b`` rows and ``plan`` (off CUDA, its padded eager twin)."""
    captured = graphs.graphs.get((graphs.bucket(b), plan))
    return captured.replay if captured is not None else lambda: graphs.run(b, plan)


def profile_model(model: Qwen3Model, cases: list[tuple[int, int]], calls: int, read_bw: float) -> list[dict]:
    """Every case's figures on one model (a runner sized for the largest case; CUDA graphs where
    the model is on CUDA, their padded eager twins elsewhere)."""
    c, bs = model.config, 16
    max_b = max(b for b, _ in cases)
    per_seq = max(-(-(ctx + 2) // bs) for _, ctx in cases)
    blocks = max(b * -(-(ctx + 2) // bs) for b, ctx in cases)
    cfg, arena, runner = bench_runner(model, "profile", max_batch=max_b, block_size=bs, num_blocks=blocks,
                                      sampler_candidates=64,
                                      graphs="auto" if model.device.type == "cuda" else "padded")
    wbytes = weight_bytes(model)
    kv_per_token = c.num_hidden_layers * 2 * c.kv_size * model.dtype.itemsize
    try:
        graphs, rows = runner.graphs, []
        for b, ctx in cases:
            tables = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)
            desc = launch(arena, greedy_batch(tables, ctx, bs), 0, cfg, c.vocab_size)
            replay = _replay(graphs, b, GREEDY)
            launch_ms = _launch_ms(runner, desc, calls)
            replay_ms = _gpu_ms(replay, calls)
            kernels, attention_ms, names = _kernels(replay)
            # The sampled step: its launch leaves the rows' sampling settings in the pool, where
            # the every-stage graph reads them.
            sampled = launch(arena, sampled_batch(tables, ctx, bs), 0, cfg, c.vocab_size)
            sampled_launch_ms = _launch_ms(runner, sampled, calls)
            sampled_replay_ms = _gpu_ms(_replay(graphs, b, EVERY_STAGE), calls)
            kv_bytes = b * (ctx + 1) * kv_per_token
            read = wbytes + kv_bytes
            row = {"batch": b, "context": ctx, "launch_ms": launch_ms, "replay_ms": replay_ms,
                   "launch_minus_replay_ms": launch_ms - replay_ms, "sampled_launch_ms": sampled_launch_ms,
                   "sampled_replay_ms": sampled_replay_ms,
                   "sampled_over_greedy": sampled_replay_ms / replay_ms,
                   "kernels_per_replay": kernels, "kernels_per_layer": kernels / c.num_hidden_layers,
                   "kernels_per_layer_by_name": {k: n / c.num_hidden_layers for k, n in names.items()},
                   "bytes_read": read, "fraction_of_read_bw": read / (replay_ms / 1e3) / read_bw}
            if attention_ms > 0:
                row |= {"attention_ms": attention_ms,
                        "attention_fraction_of_read_bw": kv_bytes / (attention_ms / 1e3) / read_bw}
            rows.append(row)
            print(f"  batch {b:>3} context {ctx:>5}: launch {launch_ms:.3f} ms, replay {replay_ms:.3f} ms "
                  f"(host side {launch_ms - replay_ms:.3f} ms), sampled replay {sampled_replay_ms:.3f} ms "
                  f"({sampled_replay_ms / replay_ms:.2f}x), {kernels} kernels "
                  f"({kernels / c.num_hidden_layers:.1f} a layer), "
                  f"{100 * row['fraction_of_read_bw']:.0f}% of read bw", flush=True)
        return rows
    finally:
        arena.close()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.6b,8b")
    ap.add_argument("--paths", default="triton,aten")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fusedserve.benchmarks.cuda_profile needs a CUDA GPU")
    read_bw = read_bandwidth(device="cuda")
    res: dict = {"machine": machine(), "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                 "read_bw_gbps": read_bw / 1e9, "cases": CASES, "results": {}, "errors": {}}
    max_len = max(ctx for _, ctx in CASES) + 32
    # The default path first, and the 0.6B shape under Qwen3's own max_model_len right after its
    # run: a check cut short by its time limit keeps the figures the targets need.
    runs = []
    for path in args.paths.split(","):
        for name in args.models.split(","):
            runs.append((f"{name}/{path}", name, path, max_len, CASES))
            if name == "0.6b":
                long = f"0.6b/{path}/max_model_len_{LONG_MAX_LEN}"
                runs.append((long, "0.6b", path, LONG_MAX_LEN, [LONG_CASE]))
    for key, name, path, model_len, cases in runs:
        os.environ["FUSEDSERVE_TRITON"] = "1" if path == "triton" else "0"  # read when a model loads
        print(f"{key}:", flush=True)
        try:
            if name == "0.6b":
                path_06b = default_model_dir("qwen3-0.6b")
                model = Qwen3Model.from_pretrained(path_06b, "bfloat16", "cuda", model_len)
            else:
                model = random_model(QWEN3_8B, model_len)
            res["results"][key] = {"weights_bytes": weight_bytes(model), "kernels": model.kernel_info(),
                                   "max_model_len": model_len,
                                   "rows": profile_model(model, cases, args.calls, read_bw)}
        except Exception as exc:  # noqa: BLE001 - one configuration's failure is a figure, not the end
            res["errors"][key] = f"{type(exc).__name__}: {exc}"
            print(f"  failed: {res['errors'][key]}", flush=True)
        model = None
        gc.collect()
        torch.cuda.empty_cache()
        if args.json:  # as each case ends: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
