"""The offline engine against the server, at the same batch, in one run (issue 59's target:
offline output tok/s >= the served path's at every batch).

    python -m fusedserve.benchmarks.offline_vs_served [--batches 1,16,64]

Offline: ``LLMEngine.generate`` of B random-token prompts (32 in, 64 out, greedy, prefill
included) in this process, as ``benchmarks/cpu_peers.py`` runs it. Served: the same prompts
through an in-process coordinator and one Ray worker, B concurrent ZeroMQ clients. Both with
speculation off (``LLMEngine``'s default) and with n-gram speculation (``fusedserve serve``'s
default), so a served figure measured with the CLI has its like-for-like offline one. Each
figure: the median (min-max) of 3 runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fusedserve.benchmarks.common import RUNS, fmt, machine, spread
from fusedserve.benchmarks.throughput import prompts
from fusedserve.coordinator.model_files.default_model import default_model_dir


def offline(model: Path, batch: list[list[int]], new: int, dtype: str, speculative: str) -> list[float]:
    """Output tokens/s of ``LLMEngine.generate`` over ``batch``, as ``cpu_peers`` runs it."""
    from fusedserve.coordinator.engine.llm_engine import LLMEngine
    from fusedserve.coordinator.sampling_params import SamplingParams

    total = len(batch[0]) + new + 1
    figures = []
    with LLMEngine(str(model), dtype=dtype, max_batch=max(2, len(batch)), block_size=16,
                   num_blocks=len(batch) * -(-total // 16) + 8, sampler_candidates=8,
                   max_model_len=total + 16, speculative_method=speculative) as eng:
        eng.generate([batch[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for _ in range(RUNS):
            eng.core.scheduler.blocks.flush()  # every run prefills its prompts
            t0 = time.perf_counter()
            outs = eng.generate(batch, SamplingParams(max_tokens=new, ignore_eos=True))
            figures.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    return figures


def served(model: Path, batch: list[list[int]], new: int, dtype: str, threads: int,
           speculative: str) -> list[float]:
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from fusedserve.coordinator.client import Client
    from fusedserve.coordinator.server.config import ServerConfig
    from fusedserve.coordinator.server.server import Server

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    total = len(batch[0]) + new + 1
    cfg = ServerConfig.build(model=str(model), workers=1, device="cpu", port=0, dtype=dtype,
                             max_model_len=total + 16, threads_per_worker=threads,
                             max_batch=max(2, len(batch)), block_size=16,
                             num_blocks=len(batch) * -(-total // 16) + 8, sampler_candidates=8,
                             speculative_method=speculative)
    coord = Server(cfg)
    coord.start()
    coord.serve_in_thread()
    try:
        with Client(coord.address) as c:
            c.generate(batch[0][:8], max_tokens=4, ignore_eos=True)  # warm-up

        def one(p: list[int]) -> int:
            with Client(coord.address, timeout_s=600) as c:
                return len(c.generate(p, max_tokens=new, ignore_eos=True)["token_ids"])

        figures = []
        for _ in range(RUNS):
            coord.workers[0].scheduler.blocks.flush()  # every run prefills its prompts
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(batch)) as pool:
                tokens = sum(pool.map(one, batch))
            figures.append(tokens / (time.perf_counter() - t0))
        return figures
    finally:
        coord.shutdown()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--preset", default="benchmark", help="the project-written checkpoint: benchmark "
                    "(~440 MB bf16) or qwen3-0.6b (Qwen3-0.6B's shape, the CPU peers' table)")
    args = ap.parse_args(argv)
    model = default_model_dir(args.preset)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    print(machine(), "checkpoint", model.name)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        batch = prompts(b, args.input_len, vocab, seed=b)
        new, dtype, threads = args.output_len, args.dtype, args.threads
        row: dict = {"batch": b, "preset": args.preset}
        for spec in ("off", "ngram"):
            row[f"offline_{spec}"] = spread(offline(model, batch, new, dtype, spec))
            row[f"served_{spec}"] = spread(served(model, batch, new, dtype, threads, spec))
            ratio = row[f"offline_{spec}"]["median"] / row[f"served_{spec}"]["median"]
            row[f"offline_over_served_{spec}"] = ratio
        rows.append(row)
        print(f"B={b:3d}: speculation off: offline {fmt(row['offline_off'])} tok/s, served "
              f"{fmt(row['served_off'])} ({row['offline_over_served_off']:.2f}x); n-gram (serve's default): "
              f"offline {fmt(row['offline_ngram'])}, served {fmt(row['served_ngram'])} "
              f"({row['offline_over_served_ngram']:.2f}x)", flush=True)
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
