"""Latency and overhead through the server: TTFT / TPOT percentiles at several
concurrency levels, and the decode step seen from the worker (its launch, the gap before
the next one, and the coordinator's share of that gap) per transport, with and without
async scheduling. Each figure is the median (min-max) of ``RUNS`` runs."""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

from fusedserve.benchmarks.common import RUNS, fmt, machine, percentile, spread
from fusedserve.benchmarks.throughput import prompts


def _server(transport: str, max_batch: int, threads: int, dtype: str, async_scheduling: bool = True):
    import ray

    from fusedserve.coordinator.server.config import ServerConfig
    from fusedserve.coordinator.server.server import Server

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = ServerConfig.build(model="default:benchmark", workers=1, device="cpu", port=0, dtype=dtype,
                       max_model_len=256, threads_per_worker=threads, transport=transport,
                       **dict(max_batch=max_batch, block_size=16, num_blocks=max_batch * 16 + 8,
                              async_scheduling=async_scheduling))
    coord = Server(cfg)
    coord.start()
    coord.serve_in_thread()
    return coord


def _stream_one(address: str, prompt: list[int], output_len: int) -> tuple[float, float]:
    from fusedserve.coordinator.client import Client

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


LATENCY_FIGURES = tuple(f"{k}_p{q}_ms" for k in ("ttft", "tpot") for q in (50, 90, 99))


def latency(concurrency: list[int], input_len: int, output_len: int, dtype: str, threads: int) -> list[dict]:
    coord = _server("auto", max(concurrency), threads, dtype)
    rows = []
    try:
        _stream_one(coord.address, [1, 2, 3], 2)  # warm-up
        for c in concurrency:
            batch = prompts(2 * c, input_len, coord.model_config.vocab_size, seed=c)
            runs = []
            for _ in range(RUNS):
                coord.workers[0].scheduler.blocks.flush()  # every run prefills its prompts
                with ThreadPoolExecutor(c) as pool:
                    res = list(pool.map(lambda p: _stream_one(coord.address, p, output_len), batch))
                ttft = [r[0] * 1e3 for r in res]
                tpot = [r[1] * 1e3 for r in res]
                runs.append({**{f"ttft_p{q}_ms": percentile(ttft, q) for q in (50, 90, 99)},
                             **{f"tpot_p{q}_ms": percentile(tpot, q) for q in (50, 90, 99)}})
            rows.append({"concurrency": c, **{k: spread([r[k] for r in runs]) for k in LATENCY_FIGURES}})
    finally:
        coord.shutdown()
    return rows


OVERHEAD_SETUPS = (("shm", False), ("shm", True), ("serial", True))  # (transport, async scheduling)


OVERHEAD_FIGURES = ("step_ms", "launch_ms", "gap_ms", "overhead_ms", "overhead_pct", "gap_pct")


def overhead(batches: list[int], output_len: int, dtype: str, threads: int) -> list[dict]:
    """A decode step seen from the worker: its launch, the gap before the next one, and of
    that gap how long it waited for the coordinator's next descriptor after replying (the
    coordinator reading ids, streaming, checking stops, scheduling, writing the arena, and
    the IPC); the rest of the gap is the worker's own (sending its reply, decoding the next
    descriptor). ``step_ms`` (gap + launch) is what async scheduling must shorten. Steady
    decode steps at the full batch only."""
    from fusedserve.coordinator.client import Client

    rows = []
    for transport, async_on in OVERHEAD_SETUPS:
        coord = _server("auto" if transport == "shm" else "serial", max(batches), threads, dtype, async_on)
        try:
            for b in batches:
                w = coord.workers[0]
                batch = prompts(b, 16, coord.model_config.vocab_size, seed=b)

                def one(p: list[int], address: str = coord.address) -> None:
                    with Client(address, timeout_s=600) as c:
                        c.generate(p, max_tokens=output_len, ignore_eos=True)

                runs = []
                for _ in range(RUNS):
                    w.core.stats.recent.clear()
                    with ThreadPoolExecutor(b) as pool:
                        list(pool.map(one, batch))
                    # The first step at the full batch waited for the prompts to arrive: skip it.
                    full = [x[1:] for x in list(w.core.stats.recent) if x[0] == b][1:]
                    idle, wait, kern = (sum(x[i] for x in full) / max(len(full), 1) for i in range(3))
                    step = idle + kern
                    runs.append({"steps": len(full), "step_ms": step * 1e3, "launch_ms": kern * 1e3,
                                 "gap_ms": idle * 1e3, "overhead_ms": wait * 1e3,
                                 "overhead_pct": 100 * wait / step if step else float("nan"),
                                 "gap_pct": 100 * idle / step if step else float("nan")})
                rows.append({"transport": transport, "async": async_on, "batch": b,
                             "steps": sum(r["steps"] for r in runs),
                             **{k: spread([r[k] for r in runs]) for k in OVERHEAD_FIGURES}})
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
        print(f"concurrency {r['concurrency']:>3}: TTFT p50 {fmt(r['ttft_p50_ms'], '.0f')} ms, "
              f"p99 {fmt(r['ttft_p99_ms'], '.0f')} ms; TPOT p50 {fmt(r['tpot_p50_ms'])} ms, "
              f"p99 {fmt(r['tpot_p99_ms'])} ms")
    for r in res["overhead"]:
        print(f"{r['transport']:>6} async {'on ' if r['async'] else 'off'} batch {r['batch']:>3}: step "
              f"{fmt(r['step_ms'], '.2f')} ms, launch {fmt(r['launch_ms'], '.2f')} ms, "
              f"gap {fmt(r['gap_ms'], '.3f')} ms, of which waiting for the coordinator "
              f"{fmt(r['overhead_ms'], '.3f')} ms ({fmt(r['overhead_pct'], '.2f')}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
