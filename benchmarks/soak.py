"""Soak: a server under a mixed load for a long time, and whether anything of it grows.

``python -m fusedserve.benchmarks.soak --minutes 30 [--json F] [--png F]``

Starts ``fusedserve serve`` (2 workers, the embedded default model unless ``--model``) as a process
of its own, drives it with ``soak_load``'s clients for ``--minutes``, and every ``--interval``
seconds samples: RSS and open file descriptors of the serve process (the coordinator and its HTTP
gateway share it) and of each worker, its shared-memory segments, KV blocks in use, the grammar
cache, the request table, and the window's p50/p99 TTFT and TPOT. Then it stops the load, waits
for the server to drain, and checks:

- growth: after ``--warmup`` seconds of load (sampled, not judged) and the first quarter of the
  rest, the last quarter's median of every resource series is within 5% of the second quarter's
  (counts of descriptors, segments and cached grammars get an absolute slack of 2: a client's
  connection opens and closes);
- drained: every KV block free, no request in any table or queue;
- every response as expected (served, dropped by its client, or a bad request's 4xx).

The JSON holds every sample; the PNG plots them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from fusedserve.benchmarks.common import machine, percentile
from fusedserve.benchmarks.soak_load import LoadLog, expected, run_clients
from fusedserve.coordinator.client import Client
from fusedserve.shared_memory.arena import list_segments

SERVING = re.compile(r"serving on (tcp://\S+)")
HTTP = re.compile(r"OpenAI API on (https?://[^/\s]+)")
BYTES = ("serve_rss", "worker_rss")  # series held to 5%
COUNTS = ("serve_fds", "worker_fds", "shm_segments", "grammar_cache")  # 5%, with a slack of 2
GROWTH, SLACK = 0.05, 2


def start_server(model: str, workers: int, extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    """``fusedserve serve`` with an embedded Ray head of its own: (process, ZeroMQ address, HTTP URL)."""
    cmd = [sys.executable, "-m", "fusedserve.coordinator.cli", "serve", "--model", model, "--workers",
           str(workers), "--zmq-port", "0", "--port", "0", "--enable-auto-tool-choice", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    zmq_addr = url = None
    for line in proc.stdout:
        zmq_addr = zmq_addr or (m.group(1) if (m := SERVING.search(line)) else None)
        url = url or (m.group(1) if (m := HTTP.search(line)) else None)
        if zmq_addr and url:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, zmq_addr, url
    proc.kill()
    raise RuntimeError("the server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server ends its Ray session), SIGKILL after a minute."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _proc(pid: int) -> tuple[int, int]:
    """(RSS bytes, open descriptors) of a process; (0, 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0, 0


def sample(client: Client, pid: int, log: LoadLog, t0: float, t1: float) -> dict:
    """One point of every series."""
    stats = client.stats()
    worker_pids = [r["pid"] for w in client.workers() for r in w["ranks"]]
    serve = _proc(pid)
    wk = [_proc(p) for p in worker_pids]
    window = log.window(t0, t1)
    ttft = [o.ttft_s for o in window if o.ttft_s is not None]
    tpot = [o.tpot_s for o in window if o.tpot_s is not None]
    return {
        "t": t1, "serve_rss": serve[0], "serve_fds": serve[1], "worker_rss": sum(r for r, _ in wk),
        "worker_fds": sum(f for _, f in wk),
        "shm_segments": sum(name.split("_")[1] == str(pid) for name in list_segments()),  # PREFIX_pid_...
        "kv_blocks_used": sum(w["kv_blocks_used"] for w in stats["workers"]),
        "grammar_cache": stats["coordinator"].get("grammar_cache", 0),
        "requests": stats["coordinator"]["pending"], "queue": stats["queue_length"],
        "served": len(window), "ttft_p50": percentile(ttft, 50) if ttft else None,
        "ttft_p99": percentile(ttft, 99) if ttft else None,
        "tpot_p50": percentile(tpot, 50) if tpot else None,
        "tpot_p99": percentile(tpot, 99) if tpot else None,
    }


def quarters(samples: list[dict]) -> tuple[list[dict], list[dict]]:
    """The second and the last quarter of the samples after warm-up: what growth compares."""
    judged = [s for s in samples if not s.get("warmup")]
    n = len(judged)
    return judged[n // 4 : n // 2], judged[3 * n // 4 :]


def _medians(samples: list[dict], key: str) -> tuple[float, float]:
    """A series' medians over the second and the last quarter after warm-up."""
    q2, q4 = quarters(samples)
    return statistics.median(s[key] for s in q2), statistics.median(s[key] for s in q4)


def growth(samples: list[dict]) -> dict[str, float]:
    """Each resource series' last-quarter median over its second-quarter median, minus 1."""
    out = {}
    for key in (*BYTES, *COUNTS):
        a, b = _medians(samples, key)
        out[key] = (b - a) / a if a else float(b > SLACK)
    return out


def check(res: dict) -> list[str]:
    """What failed: growth past the bound, a server not drained, an unexpected response."""
    fails = []
    for key, g in res["growth"].items():
        a, b = _medians(res["samples"], key)
        slack = SLACK if key in COUNTS else 0
        if b > a * (1 + GROWTH) + slack:
            fails.append(f"{key} grew {100 * g:.1f}% ({a:.0f} -> {b:.0f}) from the second quarter to the "
                         "last")
    end = res["end"]
    if end["kv_blocks_used"] or end["requests"] or end["queue"] or end["running"]:
        fails.append(f"not drained at the end: {end}")
    if res["unexpected"]:
        fails.append(f"{res['unexpected']} responses not as expected: {res['unexpected_examples']}")
    return fails


# The default model's context is 2,048 positions; the soak's prompts reach 4,000 tokens, so it runs
# past them (allowed: it continues as transformers does, tests/model/test_default_model.py).
LONG = ["--max-model-len", "4608", "--allow-long-max-model-len"]


def run(minutes: float, model: str = "default", workers: int = 2, clients: int = 8, interval: float = 10.0,
        prompt_max: int = 2750, extra: list[str] | None = None, warmup: float = 60.0) -> dict:
    """``minutes`` of load judged after ``warmup`` seconds of it: the serve process's heap grows for
    its first minute or so under this load (allocator arenas of its threads, caches filling to their
    bounds; a 30-minute run is flat after it), and on a slower host that minute outlasts the first
    quarter of a short run. ``prompt_max``: the longest prompt in words (about 1.45 tokens each on
    the default model's tokenizer: 2,750 words are about 4,000 tokens, inside the 4,608 of ``LONG``
    with the chat turn and the output)."""
    proc, address, url = start_server(model, workers, LONG + (extra or []))
    log, samples = LoadLog(), []
    try:
        with Client(address, timeout_s=60) as client:
            stop = asyncio.Event()
            loop = asyncio.new_event_loop()
            load = threading.Thread(target=loop.run_until_complete,
                                    args=(run_clients(url, clients, stop, log, prompt_max),), daemon=True)
            start = time.perf_counter()
            load.start()
            t_prev = start
            while time.perf_counter() - start < warmup + minutes * 60:
                time.sleep(interval)
                now = time.perf_counter()
                samples.append({**sample(client, proc.pid, log, t_prev, now), "t": now - start,
                                "warmup": now - start <= warmup})
                t_prev = now
            loop.call_soon_threadsafe(stop.set)
            load.join(300)
            deadline = time.time() + 60  # drain: whatever is still in flight finishes
            while time.time() < deadline:
                stats = client.stats()
                if not stats["coordinator"]["pending"] and not stats["queue_length"]:
                    break
                time.sleep(0.5)
            stats = client.stats()
            end = {"kv_blocks_used": sum(w["kv_blocks_used"] for w in stats["workers"]),
                   "running": stats["running"], "requests": stats["coordinator"]["pending"],
                   "queue": stats["queue_length"]}
    finally:
        stop_server(proc)
    bad = [o for o in log.outcomes if not expected(o)]
    kinds: dict[str, int] = {}
    for o in log.outcomes:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    res = {"machine": machine(), "minutes": minutes, "warmup_s": warmup, "model": model, "workers": workers,
           "clients": clients, "prompt_max_words": prompt_max,
           "interval_s": interval, "requests": len(log.outcomes), "by_kind": kinds, "samples": samples,
           "end": end, "unexpected": len(bad),
           "unexpected_examples": [(o.kind, o.status) for o in bad[:5]]}
    res["growth"] = growth(samples)
    res["failures"] = check(res)
    return res


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("serve_rss", "worker_rss", "serve_fds", "worker_fds", "shm_segments", "kv_blocks_used",
            "grammar_cache", "requests", "ttft_p99", "tpot_p99")
    fig, axes = plt.subplots(5, 2, figsize=(10, 12), sharex=True)
    t = [s["t"] / 60 for s in res["samples"]]
    for ax, key in zip(axes.flat, keys):
        ax.plot(t, [s[key] if s[key] is not None else float("nan") for s in res["samples"]])
        ax.set_title(key, fontsize=9)
        ax.grid(True, alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("minutes")
    title = f"soak: {res['minutes']} min, {res['workers']} workers, {res['clients']} clients"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--model", default="default")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds of load before it is judged")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    res = run(args.minutes, args.model, args.workers, args.clients, args.interval, warmup=args.warmup)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.png:
        plot(res, Path(args.png))
    print(json.dumps({k: res[k] for k in ("requests", "by_kind", "growth", "end", "failures")}, indent=1))
    return res


if __name__ == "__main__":
    main()
