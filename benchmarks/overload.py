"""Overload: ten times the requests a server can serve, arriving open-loop, for a minute.

``python -m fusedserve.benchmarks.overload [--seconds 60] [--json F]``

Starts ``fusedserve serve`` (one worker, the embedded default model) with the admission bounds
under test (``--max-queued-requests``, ``--max-queue-time``), measures what it serves closed-loop
(requests per second at its batch), then sends ``--factor`` times that rate open-loop: each
request a streamed completion of ``MAX_TOKENS`` tokens, sent on schedule whatever came back.
Throughout, ``/health`` is probed every 100 ms and the serve process's RSS sampled every second, from
a process of their own (the load generator's event loop, busy with thousands of streams, would time
itself).
It reports what was served and shed, how fast a refusal came (a 429 must be at once, not after a
timeout), how long an admitted request took (its bound: the queue bound plus its own service
time), the probe's latencies, memory, and what ``/metrics`` counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import time
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

import httpx

from fusedserve.benchmarks.common import machine, percentile
from fusedserve.benchmarks.soak import start_server, stop_server

MAX_TOKENS = 256
BODY = {"prompt": "a story about a cat", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
SERVE_ARGS = ["--dtype", "float32", "--max-batch", "8", "--num-blocks", "128"]


@dataclass
class Burst:
    """Per request (status, seconds to the status line, seconds to the end, had Retry-After); per
    /health probe (status, seconds); RSS samples of the serve process (bytes)."""

    requests: list[tuple[int, float, float, bool]] = field(default_factory=list)
    probes: list[tuple[int, float]] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def burst(url: str, rate: float, seconds: float, pid: int | None = None,
                give_up_s: float | None = None, body: dict = BODY) -> Burst:
    """``rate`` requests a second for ``seconds``, open-loop. ``give_up_s``: requests still running
    that long after the last arrival are dropped and recorded as never ending."""
    out = Burst()
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def one() -> None:
            t0 = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body) as r:
                t_status = time.perf_counter() - t0
                chunks = sum([1 async for line in r.aiter_lines() if line.startswith("data: {")])
                if r.status_code == 200 and chunks < body["max_tokens"]:
                    raise AssertionError(f"a served stream ended after {chunks} chunks")
                out.requests.append((r.status_code, t_status, time.perf_counter() - t0,
                                     "retry-after" in r.headers))

        ctx = multiprocessing.get_context("spawn")
        stop, results = ctx.Event(), ctx.Queue()
        watcher = ctx.Process(target=watch, args=(url, pid, stop, results), daemon=True)
        watcher.start()
        tasks, start = [], time.perf_counter()
        for i in range(int(rate * seconds)):
            tasks.append(asyncio.ensure_future(one()))
            await asyncio.sleep(max(0.0, start + (i + 1) / rate - time.perf_counter()))
        _, pending = await asyncio.wait(tasks, timeout=give_up_s)
        for t in pending:
            t.cancel()
        out.requests += [(200, 0.0, float("inf"), False)] * len(pending)
        stop.set()
        out.probes, out.rss = results.get(timeout=60)
        watcher.join(30)
    return out


def watch(url: str, pid: int | None, stop: Event, results: Queue) -> None:
    """``/health`` every 100 ms and the RSS of ``pid`` every second, in a process of its own, so that
    what it times is the server, not the load generator's busy event loop."""
    probes: list[tuple[int, float]] = []
    samples: list[int] = []
    next_rss = 0.0
    with httpx.Client(base_url=url, timeout=10) as probe:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = probe.get("/health")
            probes.append((r.status_code, time.perf_counter() - t0))
            if pid is not None and t0 >= next_rss:
                samples.append(rss(pid))
                next_rss = t0 + 1.0
            time.sleep(0.1)
    results.put((probes, samples))


async def capacity(url: str, concurrency: int, seconds: float) -> tuple[float, float]:
    """Closed-loop: (requests served a second, median seconds per request) at ``concurrency``."""
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def loop() -> None:
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json={**BODY, "stream": False})
                r.raise_for_status()
                times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return len(times) / (time.perf_counter() - t0), percentile(times, 50)


def shed_counted(url: str) -> float:
    """What ``/metrics`` counts as shed (the gateway's 429s and the coordinator's, queue timeouts too)."""
    text = httpx.get(f"{url}/metrics").text
    return sum(float(v) for v in re.findall(r"^fusedserve:requests_shed_total\{[^}]*\} (\S+)$", text, re.M))


def _quantiles(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values)}


def summarize(b: Burst) -> dict:
    served = [r for r in b.requests if r[0] == 200]
    shed = [r for r in b.requests if r[0] == 429]
    probes = [s for _, s in b.probes]
    return {
        "offered": len(b.requests), "served": len(served), "shed": len(shed),
        "other": len(b.requests) - len(served) - len(shed),
        "shed_with_retry_after": sum(r[3] for r in shed),
        "refusal_s": _quantiles([r[1] for r in shed]) if shed else None,
        "served_s": _quantiles([r[2] for r in served]) if served else None,
        "health_s": _quantiles(probes),
        "health_probes": len(probes), "health_not_ok": sum(s != 200 for s, _ in b.probes),
        "rss_mib": {"start": b.rss[0] / 2**20, "max": max(b.rss) / 2**20, "end": b.rss[-1] / 2**20}
        if b.rss else None,
    }


def run(seconds: float = 60.0, factor: float = 10.0, hold: int = 16, queue_time_s: float = 2.0) -> dict:
    args = [*SERVE_ARGS, "--max-queued-requests", str(hold), "--max-requests-per-client", str(hold),
            "--max-queue-time", str(queue_time_s)]
    proc, _, url = start_server("default", 1, args)
    try:
        served_rate, service_s = asyncio.run(capacity(url, 8, 15.0))
        rate = factor * served_rate
        b = asyncio.run(burst(url, rate, seconds, pid=proc.pid))
        counted = shed_counted(url)
    finally:
        stop_server(proc)
    return {"machine": machine(), "seconds": seconds, "factor": factor, "hold": hold,
            "queue_time_s": queue_time_s, "capacity_rps": served_rate, "service_s": service_s,
            "rate_rps": rate, "metrics_shed": counted, **summarize(b), "max_tokens": MAX_TOKENS,
            "bound_s": queue_time_s + 2 * service_s}


def check(res: dict) -> list[str]:
    """What the run must show; each failure named."""
    fails = []
    if res["other"]:
        fails.append(f"{res['other']} answers neither 200 nor 429")
    if res["shed"] and res["refusal_s"]["p99"] > 0.5:
        fails.append(f"p99 refusal took {res['refusal_s']['p99']:.2f} s (> 0.5 s: not at once)")
    if res["shed_with_retry_after"] != res["shed"]:
        fails.append("a 429 without Retry-After")
    if res["served_s"] is None or res["served_s"]["max"] > res["bound_s"]:
        fails.append(f"an admitted request took past its bound of {res['bound_s']:.1f} s")
    if res["health_s"]["max"] > 0.1 or res["health_not_ok"]:
        fails.append(f"/health took up to {1e3 * res['health_s']['max']:.0f} ms "
                     f"({res['health_not_ok']} not ok)")
    if res["metrics_shed"] != res["shed"]:
        fails.append(f"/metrics counted {res['metrics_shed']:g} shed of {res['shed']}")
    if res["rss_mib"] and res["rss_mib"]["max"] > res["rss_mib"]["start"] + 200:
        fails.append(f"serve RSS grew {res['rss_mib']['max'] - res['rss_mib']['start']:.0f} MiB")
    return fails


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--factor", type=float, default=10.0, help="arrivals as a multiple of the served rate")
    ap.add_argument("--hold", type=int, default=16, help="--max-queued-requests")
    ap.add_argument("--queue-time", type=float, default=2.0, help="--max-queue-time (s)")
    ap.add_argument("--runs", type=int, default=3, help="each a server of its own")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    runs = []
    for _ in range(args.runs):
        res = run(args.seconds, args.factor, args.hold, args.queue_time)
        res["failures"] = check(res)
        runs.append(res)
    out = {"machine": machine(), "seconds": args.seconds, "factor": args.factor, "hold": args.hold,
           "queue_time_s": args.queue_time, "max_tokens": MAX_TOKENS, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return out


def table(res: dict) -> list[str]:
    """One row per run: what came, what was served and shed, and how fast."""
    lines = ["| run | served/s closed-loop | offered/s | offered | served | shed (429) | 429 p50 / p99 / max "
             "| served p50 / p99 / max (bound) | /health p50 / p99 / max | serve RSS start / max |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(res["runs"], 1):
        ms = "{:.1f} / {:.1f} / {:.1f} ms".format
        sv = r["served_s"]
        lines.append(
            f"| {i} | {r['capacity_rps']:.1f} | {r['rate_rps']:.1f} | {r['offered']} | {r['served']} "
            f"| {r['shed']} "
            f"| {ms(*(1e3 * r['refusal_s'][q] for q in ('p50', 'p99', 'max')))} "
            f"| {sv['p50']:.2f} / {sv['p99']:.2f} / {sv['max']:.2f} s ({r['bound_s']:.1f} s) "
            f"| {ms(*(1e3 * r['health_s'][q] for q in ('p50', 'p99', 'max')))} "
            f"| {r['rss_mib']['start']:.0f} / {r['rss_mib']['max']:.0f} MiB |")
    return lines


if __name__ == "__main__":
    main()
