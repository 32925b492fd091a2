"""Overload: ten times the requests a server may hold, arriving open-loop. The gateway sheds what
passes ``--max-queued-requests`` at once (429 with Retry-After, before reading the prompt), counts
it in ``/metrics``, serves every request it admitted within the bound stated here, keeps its
memory, and answers ``/health`` from its watcher throughout. Its negative control: the same
arrivals against a server allowed to queue them all, where admitted requests miss the bound."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.serve_proc import ServeProcess

HOLD = 12  # --max-queued-requests
# Open-loop arrivals: 800 requests of 256 tokens in 10 s, where the server (8 rows a launch) serves
# about 8 a second: ten times what it can take.
RATE, SECONDS = 80.0, 10.0
DEADLINE_S = 15.0  # an admitted request's bound, arrival to its last token
BODY = {"prompt": "a story about a cat", "max_tokens": 256, "ignore_eos": True, "stream": True}


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _burst(url: str, give_up_s: float | None = None
                 ) -> tuple[list[tuple[int, float, float, bool]], list[tuple[int, float]]]:
    """(status, seconds to the status line, seconds to the end, had Retry-After) per request, and
    (status, seconds) per /health probe taken every 100 ms during the burst. ``give_up_s``: requests
    still running that long after the last arrival are dropped and recorded as never ending."""
    results: list[tuple[int, float, float, bool]] = []
    probes: list[tuple[int, float]] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def one() -> None:
            t0 = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=BODY) as r:
                t_status = time.perf_counter() - t0
                chunks = sum([1 async for line in r.aiter_lines() if line.startswith("data: {")])
                if r.status_code == 200:
                    assert chunks >= BODY["max_tokens"], chunks
                end = time.perf_counter() - t0
                results.append((r.status_code, t_status, end, "retry-after" in r.headers))

        async def health(stop: asyncio.Event) -> None:
            async with httpx.AsyncClient(base_url=url, timeout=10) as probe:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    r = await probe.get("/health")
                    probes.append((r.status_code, time.perf_counter() - t0))
                    await asyncio.sleep(0.1)

        stop = asyncio.Event()
        watcher = asyncio.ensure_future(health(stop))
        tasks = []
        for _ in range(int(RATE * SECONDS)):
            tasks.append(asyncio.ensure_future(one()))
            await asyncio.sleep(1 / RATE)
        done, pending = await asyncio.wait(tasks, timeout=give_up_s)
        for t in pending:
            t.cancel()
        results += [(200, 0.0, float("inf"), False)] * len(pending)
        stop.set()
        await watcher
    return results, probes


def _serve(tmp: Path, hold: int) -> ServeProcess:
    args = ["--workers", "1", "--dtype", "float32", "--max-batch", "8", "--num-blocks", "128",
            "--max-queued-requests", str(hold), "--max-requests-per-client", str(hold), "--http-port", "0"]
    return ServeProcess.start(tmp / f"serve-{hold}.log", *args)


def test_ten_times_too_much_is_shed_at_once_and_the_rest_served_in_time(ray_session, tmp_path):
    srv = _serve(tmp_path, HOLD)
    try:
        rss0 = _rss(srv.proc.pid)
        results, probes = asyncio.run(_burst(srv.http))
        shed = [r for r in results if r[0] == 429]
        served = [r for r in results if r[0] == 200]
        assert len(results) == int(RATE * SECONDS) and len(shed) + len(served) == len(results), \
            sorted({r[0] for r in results})
        assert len(shed) > len(results) / 2 and served  # most is shed, some is served
        assert all(r[3] for r in shed)  # each refusal says when to come back
        refusal = sorted(r[1] for r in shed)
        assert refusal[int(0.99 * (len(refusal) - 1))] < 0.5, refusal[-10:]  # at once, not after a timeout
        assert max(r[2] for r in served) <= DEADLINE_S, max(r[2] for r in served)
        slow = sorted(t for _, t in probes)
        assert all(s == 200 for s, _ in probes) and slow[int(0.95 * (len(slow) - 1))] < 0.1, slow[-10:]
        metrics = httpx.get(f"{srv.http}/metrics").text
        shed_lines = re.findall(r"^fusedserve:requests_shed_total\{[^}]*\} (\S+)$", metrics, re.M)
        counted = sum(float(v) for v in shed_lines)
        assert counted == len(shed)
        assert _rss(srv.proc.pid) < rss0 + (200 << 20)  # memory stays bounded
    finally:
        srv.stop()


@pytest.mark.parametrize("hold", [4096])
def test_negative_control_a_server_that_queues_everything_misses_the_bound(ray_session, tmp_path, hold):
    srv = _serve(tmp_path, hold)
    try:
        results, _ = asyncio.run(_burst(srv.http, give_up_s=DEADLINE_S + 5))
        assert all(r[0] == 200 for r in results)  # nothing shed ...
        assert max(r[2] for r in results) > DEADLINE_S  # ... so the last admitted wait past the bound
    finally:
        srv.stop()
