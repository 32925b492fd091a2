"""Latency and overhead through the server: TTFT / TPOT percentiles at several
concurrency levels, and the coordinator's share of a decode step (the worker's wait
between launches against its launch time) per transport, with and without async
scheduling."""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import machine, percentile
from benchmarks.throughput import prompts


def _server(transport: str, max_batch: int, threads: int, dtype: str, async_scheduling: bool = True):
    import ray

    from coordinator.server.config import ServerConfig
    from coordinator.server.server import Server
    from shared_memory.contract import RunnerConfig

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = ServerConfig(model="default:benchmark", workers=1, device="cpu", port=0, dtype=dtype,
                       max_model_len=256, threads_per_worker=threads, transport=transport,
                       runner=RunnerConfig(max_batch=max_batch, block_size=16, num_blocks=max_batch * 16 + 8,
                                           async_scheduling=async_scheduling))
    coord = Server(cfg)
    coord.start()
    coord.serve_in_thread()
    return coord


def _stream_one(address: str, prompt: list[int], output_len: int) -> tuple[float, float]:
    from coordinator.client import Client

    with Client(address, timeout_s=600) as c:
        t0 = time.perf_counter()
        first = last = None
        n = 0
        for frame in c.stream(prompt, max_tokens=output_len, ignore_eos=True):
            now = time.perf_counter()
            if frame["type"] == "token":
                n += 1
                first = first or now
                last = now
    return first - t0, (last - first) / max(n - 1, 1)


def latency(concurrency: list[int], input_len: int, output_len: int, dtype: str, threads: int) -> list[dict]:
    coord = _server("auto", max(concurrency), threads, dtype)
    rows = []
    try:
        _stream_one(coord.address, [1, 2, 3], 2)  # warm-up
        for c in concurrency:
            batch = prompts(2 * c, input_len, coord.config.vocab_size, seed=c)
            with ThreadPoolExecutor(c) as pool:
                res = list(pool.map(lambda p: _stream_one(coord.address, p, output_len), batch))
            ttft = [r[0] * 1e3 for r in res]
            tpot = [r[1] * 1e3 for r in res]
            rows.append({"concurrency": c, **{f"ttft_p{q}_ms": percentile(ttft, q) for q in (50, 90, 99)},
                         **{f"tpot_p{q}_ms": percentile(tpot, q) for q in (50, 90, 99)}})
    finally:
        coord.shutdown()
    return rows


OVERHEAD_SETUPS = (("shm", False), ("shm", True), ("serial", True))  # (transport, async scheduling)


def overhead(batches: list[int], output_len: int, dtype: str, threads: int) -> list[dict]:
    """The coordinator's share of a decode step, seen from the worker: how long it waited
    for the coordinator's next descriptor after replying (the coordinator reading ids,
    streaming, checking stops, scheduling, writing the arena, and the IPC), against the
    whole step. The rest of the gap between launches is the worker's own (sending its
    reply, decoding the next descriptor). Steady decode steps at the full batch only;
    with async scheduling the next descriptor is already queued when a launch ends."""
    from coordinator.client import Client

    rows = []
    for transport, async_on in OVERHEAD_SETUPS:
        coord = _server("auto" if transport == "shm" else "serial", max(batches), threads, dtype, async_on)
        try:
            for b in batches:
                w = coord.workers[0]
                w.core.stats.recent.clear()
                batch = prompts(b, 16, coord.config.vocab_size, seed=b)

                def one(p: list[int], address: str = coord.address) -> None:
                    with Client(address, timeout_s=600) as c:
                        c.generate(p, max_tokens=output_len, ignore_eos=True)

                with ThreadPoolExecutor(b) as pool:
                    list(pool.map(one, batch))
                # The first step at the full batch waited for the prompts to arrive: skip it.
                full = [x[1:] for x in list(w.core.stats.recent) if x[0] == b][1:]
                idle, wait, kern = (sum(x[i] for x in full) / max(len(full), 1) for i in range(3))
                step = idle + kern
                rows.append({"transport": transport, "async": async_on, "batch": b, "steps": len(full),
                             "step_ms": step * 1e3, "launch_ms": kern * 1e3, "gap_ms": idle * 1e3,
                             "overhead_ms": wait * 1e3,
                             "overhead_pct": 100 * wait / step if step else float("nan"),
                             "gap_pct": 100 * idle / step if step else float("nan")})
        finally:
            coord.shutdown()
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--overhead-batches", default="1,16,64")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = {"machine": machine(),
           "latency": latency([int(c) for c in args.concurrency.split(",")], args.input_len,
                              args.output_len, args.dtype, args.threads),
           "overhead": overhead([int(b) for b in args.overhead_batches.split(",")], args.output_len,
                                args.dtype, args.threads)}
    for r in res["latency"]:
        print(f"concurrency {r['concurrency']:>3}: TTFT p50/p90/p99 {r['ttft_p50_ms']:.0f}/"
              f"{r['ttft_p90_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms, TPOT {r['tpot_p50_ms']:.1f}/"
              f"{r['tpot_p90_ms']:.1f}/{r['tpot_p99_ms']:.1f} ms")
    for r in res["overhead"]:
        print(f"{r['transport']:>6} async {'on ' if r['async'] else 'off'} batch {r['batch']:>3}: step "
              f"{r['step_ms']:.2f} ms, launch {r['launch_ms']:.2f} ms, "
              f"gap {r['gap_ms']:.3f} ms ({r['gap_pct']:.2f}%), "
              f"of which waiting for the coordinator {r['overhead_ms']:.3f} ms ({r['overhead_pct']:.2f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
