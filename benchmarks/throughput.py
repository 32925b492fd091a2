"""Throughput: N random-token prompts through the server vs transformers' generate.

Both run greedy on the same checkpoint, dtype and thread count in one run; the
server path is the whole product (ZeroMQ client -> coordinator -> Ray worker ->
fused step), transformers is a static batch of the same prompts.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import checkpoint, machine


def prompts(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(n, input_len)).tolist()


def transformers_generate(batch: list[list[int]], output_len: int, dtype: str, threads: int,
                          model_dir: Path | None = None, device: str = "cpu") -> float:
    """Output tokens/s of transformers' static-batch greedy generate (default: the benchmark model)."""
    from transformers import Qwen3ForCausalLM

    torch.set_num_threads(threads)
    model = Qwen3ForCausalLM.from_pretrained(model_dir or checkpoint(), dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    ids = torch.tensor(batch, device=device)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                             attention_mask=torch.ones_like(ids))
        if ids.is_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + output_len
    return len(batch) * output_len / dt


def server_generate(batch: list[list[int]], output_len: int, dtype: str, threads: int,
                    max_batch: int) -> dict:
    import ray

    from coordinator.client import Client
    from coordinator.server.config import ServerConfig
    from coordinator.server.server import Server
    from shared_memory.contract import RunnerConfig

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    blocks = max_batch * (-(-(len(batch[0]) + output_len + 1) // 16)) + 8
    cfg = ServerConfig(model=f"default:{'benchmark'}", workers=1, device="cpu", port=0, dtype=dtype,
                       max_model_len=len(batch[0]) + output_len + 16, threads_per_worker=threads,
                       runner=RunnerConfig(max_batch=max_batch, block_size=16, num_blocks=blocks))
    coord = Server(cfg)
    coord.start()
    coord.serve_in_thread()
    try:
        with Client(coord.address) as c:  # warm-up
            c.generate(batch[0][:8], max_tokens=2)

        def one(p: list[int]) -> dict:
            with Client(coord.address, timeout_s=600) as c:
                return c.generate(p, max_tokens=output_len, ignore_eos=True)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(batch)) as pool:
            outs = list(pool.map(one, batch))
        dt = time.perf_counter() - t0
        with Client(coord.address) as c:
            stats = c.stats()
    finally:
        coord.shutdown()
    tokens = sum(len(o["token_ids"]) for o in outs)
    return {"requests_per_s": len(batch) / dt, "output_tokens_per_s": tokens / dt, "seconds": dt,
            "stats": stats}


def run(n: int, input_len: int, output_len: int, dtype: str, threads: int) -> dict:
    import json as _json

    vocab = _json.loads((checkpoint() / "config.json").read_text())["vocab_size"]
    batch = prompts(n, input_len, vocab)
    served = server_generate(batch, output_len, dtype, threads, max_batch=max(n, 1))
    hf = transformers_generate(batch, output_len, dtype, threads)
    return {"machine": machine(), "n": n, "input_len": input_len, "output_len": output_len,
            "dtype": dtype, "threads": threads, "fusedserve": served, "transformers_tokens_per_s": hf,
            "ratio": served["output_tokens_per_s"] / hf}


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
    print(f"fusedserve: {s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:.1f} output tok/s")
    print(f"transformers generate: {res['transformers_tokens_per_s']:.1f} output tok/s")
    print(f"ratio: {res['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return res


if __name__ == "__main__":
    main()
