"""Throughput: N random-token prompts through the server vs transformers' generate.

Both run greedy on the same checkpoint, dtype and thread count in one run, prefill
included; the server path is the whole product (ZeroMQ client -> coordinator -> Ray
worker -> one forward and the sampler per launch), transformers is a static batch of the
same prompts. Each figure is the median (min-max) of ``RUNS`` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from fusedserve.benchmarks.common import RUNS, checkpoint, fmt, machine, spread


def prompts(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(n, input_len)).tolist()


def transformers_generate(batch: list[list[int]], output_len: int, dtype: str, threads: int,
                          model_dir: Path | None = None, device: str = "cpu",
                          runs: int = RUNS) -> list[float]:
    """Output tokens/s of ``runs`` transformers static-batch greedy ``generate`` calls (the
    model loaded once; default: the benchmark model)."""
    from transformers import Qwen3ForCausalLM

    torch.set_num_threads(threads)
    model = Qwen3ForCausalLM.from_pretrained(model_dir or checkpoint(), dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    ids = torch.tensor(batch, device=device)
    figures = []
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
        for _ in range(runs):
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                 attention_mask=torch.ones_like(ids))
            if ids.is_cuda:
                torch.cuda.synchronize()
            figures.append(len(batch) * output_len / (time.perf_counter() - t0))
            assert out.shape[1] == ids.shape[1] + output_len
    return figures


def server_generate(batch: list[list[int]], output_len: int, dtype: str, threads: int,
                    max_batch: int) -> dict:
    import ray

    from fusedserve.coordinator.client import Client
    from fusedserve.coordinator.server.config import ServerConfig
    from fusedserve.coordinator.server.server import Server

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    blocks = max_batch * (-(-(len(batch[0]) + output_len + 1) // 16)) + 8
    cfg = ServerConfig.build(model=f"default:{'benchmark'}", workers=1, device="cpu", port=0, dtype=dtype,
                       max_model_len=len(batch[0]) + output_len + 16, threads_per_worker=threads,
                       **dict(max_batch=max_batch, block_size=16, num_blocks=blocks))
    coord = Server(cfg)
    coord.start()
    coord.serve_in_thread()
    try:
        with Client(coord.address) as c:  # warm-up
            c.generate(batch[0][:8], max_tokens=2)

        def one(p: list[int]) -> dict:
            with Client(coord.address, timeout_s=600) as c:
                return c.generate(p, max_tokens=output_len, ignore_eos=True)

        rps, tps = [], []
        for _ in range(RUNS):
            coord.workers[0].scheduler.blocks.flush()  # every run prefills its prompts
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(batch)) as pool:
                outs = list(pool.map(one, batch))
            dt = time.perf_counter() - t0
            rps.append(len(batch) / dt)
            tps.append(sum(len(o["token_ids"]) for o in outs) / dt)
        with Client(coord.address) as c:
            stats = c.stats()
    finally:
        coord.shutdown()
    return {"requests_per_s": spread(rps), "output_tokens_per_s": spread(tps), "stats": stats}


def run(n: int, input_len: int, output_len: int, dtype: str, threads: int) -> dict:
    import json as _json

    vocab = _json.loads((checkpoint() / "config.json").read_text())["vocab_size"]
    batch = prompts(n, input_len, vocab)
    served = server_generate(batch, output_len, dtype, threads, max_batch=max(n, 1))
    hf = spread(transformers_generate(batch, output_len, dtype, threads))
    return {"machine": machine(), "n": n, "input_len": input_len, "output_len": output_len,
            "dtype": dtype, "threads": threads, "fusedserve": served, "transformers_tokens_per_s": hf,
            "ratio": served["output_tokens_per_s"]["median"] / hf["median"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = run(args.num_prompts, args.input_len, args.output_len, args.dtype, args.threads)
    s = res["fusedserve"]
    print(f"{res['machine']}")
    print(f"fusedserve: {fmt(s['requests_per_s'], '.2f')} req/s, "
          f"{fmt(s['output_tokens_per_s'])} output tok/s")
    print(f"transformers generate: {fmt(res['transformers_tokens_per_s'])} output tok/s")
    print(f"ratio of medians: {res['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return res


if __name__ == "__main__":
    main()
