"""Served figures over the OpenAI API: ``fusedserve bench serve`` against ``fusedserve serve
--http-port`` on the benchmark checkpoint, at several concurrency levels; each figure the
median (min-max) of ``RUNS`` runs against the same server.

    python -m fusedserve.benchmarks.serving --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import subprocess
import sys

from fusedserve.benchmarks.common import RUNS, checkpoint, fmt, machine, spread
from fusedserve.coordinator.openai.bench_serve import BenchConfig, run

HTTP = re.compile(r"OpenAI API on (http://\S+)")


def serve(dtype: str, threads: int, max_batch: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "fusedserve.coordinator.cli", "serve", "--model", str(checkpoint()),
           "--workers", "1",
           "--dtype", dtype, "--threads-per-worker", str(threads), "--max-batch", str(max_batch),
           "--num-blocks", str(max_batch * 8 + 8), "--zmq-port", "0", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if m := HTTP.search(line):
            return proc, m.group(1)
    raise RuntimeError("the server did not start")


FIGURES = ("request_throughput", "output_throughput", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99",
           "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99")


def bench(concurrency: list[int], input_len: int, output_len: int, dtype: str, threads: int) -> list[dict]:
    proc, url = serve(dtype, threads, max(concurrency))
    try:
        rows = []
        for c in concurrency:
            runs = []
            for i in range(RUNS):  # another seed each run: other prompts, no prefix-cache hits
                cfg = BenchConfig(url, num_prompts=max(8, 2 * c), max_concurrency=c, input_len=input_len,
                                  output_len=output_len, seed=100 * c + i, progress=False)
                runs.append(asyncio.run(run(cfg)))
            rows.append({"concurrency": c, **{k: spread([r[k] for r in runs]) for k in FIGURES}})
        return rows
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    rows = bench([int(c) for c in args.concurrency.split(",")], args.input_len, args.output_len, args.dtype,
                 args.threads)
    print(machine())
    for r in rows:
        print(f"concurrency {r['concurrency']:3d}: {fmt(r['request_throughput'], '.2f')} req/s, "
              f"{fmt(r['output_throughput'])} tok/s, TTFT p50 {fmt(r['ttft_ms_p50'], '.0f')} ms, "
              f"TPOT p50 {fmt(r['tpot_ms_p50'])} ms")
    return rows


if __name__ == "__main__":
    main()
