"""Overload: ten times the requests a server may hold, arriving open-loop. The gateway sheds what
passes ``--max-queued-requests`` at once (429 with Retry-After, before reading the prompt), counts
it in ``/metrics``, serves every request it admitted within the bound stated here, keeps its
memory, and answers ``/health`` from its watcher throughout. Its negative control: the same
arrivals against a server allowed to queue them all, where admitted requests miss the bound."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from fusedserve.benchmarks.overload import burst, rss
from tests.serve_proc import ServeProcess

HOLD = 12  # --max-queued-requests
# Open-loop arrivals: 800 requests of 256 tokens in 10 s, where the server (8 rows a launch) serves
# about 8 a second: ten times what it can take.
RATE, SECONDS = 80.0, 10.0
DEADLINE_S = 15.0  # an admitted request's bound, arrival to its last token


def _serve(tmp: Path, hold: int) -> ServeProcess:
    args = ["--workers", "1", "--dtype", "float32", "--max-batch", "8", "--num-blocks", "128",
            "--max-queued-requests", str(hold), "--max-requests-per-client", str(hold), "--http-port", "0"]
    return ServeProcess.start(tmp / f"serve-{hold}.log", *args)


def test_ten_times_too_much_is_shed_at_once_and_the_rest_served_in_time(ray_session, tmp_path):
    srv = _serve(tmp_path, HOLD)
    try:
        rss0 = rss(srv.proc.pid)
        b = asyncio.run(burst(srv.http, RATE, SECONDS))
        results, probes = b.requests, b.probes
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
        assert rss(srv.proc.pid) < rss0 + (200 << 20)  # memory stays bounded
    finally:
        srv.stop()


@pytest.mark.parametrize("hold", [4096])
def test_negative_control_a_server_that_queues_everything_misses_the_bound(ray_session, tmp_path, hold):
    srv = _serve(tmp_path, hold)
    try:
        results = asyncio.run(burst(srv.http, RATE, SECONDS, give_up_s=DEADLINE_S + 5)).requests
        assert all(r[0] == 200 for r in results)  # nothing shed ...
        assert max(r[2] for r in results) > DEADLINE_S  # ... so the last admitted wait past the bound
    finally:
        srv.stop()
