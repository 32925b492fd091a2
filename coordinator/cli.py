"""The ``fusedserve`` command: serve, generate, stats, demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from fusedserve.coordinator import vllm_flags
from fusedserve.coordinator.cli_parser import http_config, parse, read_file, server_config
from fusedserve.coordinator.client import TOKEN_ENV, Client, ServerError
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.coordinator.openai.http_config import API_KEY_ENV, HttpConfig
from fusedserve.coordinator.server.core_slots import CoreSlots
from fusedserve.coordinator.server.ray_cluster import EmbeddedHead, RayPorts, connect, embedded_env

if TYPE_CHECKING:
    from fusedserve.coordinator.server.config import ServerConfig
    from fusedserve.coordinator.server.server import Server

DEMO_PROMPTS = [
    "The with statement",
    "A list comprehension is",
    "def hello(name):",
    "To read a file,",
    "Python is an easy to learn, powerful programming language.",
    "The capital of France is",
]


def _read_token(args: argparse.Namespace) -> str | None:
    if getattr(args, "auth_token_file", None):
        return read_file(args.auth_token_file)
    return os.environ.get(TOKEN_ENV) or None


def _ray(args: argparse.Namespace) -> EmbeddedHead | None:
    """Join ``--ray-address``, or start a head of this process's own (stop it at exit)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ports = RayPorts(gcs=args.ray_gcs_port, dashboard_agent=args.ray_dashboard_agent_port,
                     metrics_export=args.ray_metrics_export_port,
                     runtime_env_agent=args.ray_runtime_env_agent_port)
    return connect(args.ray_address, max(2, (args.workers or 1) * args.tensor_parallel_size), ports)


def _leave_ray(head: EmbeddedHead | None) -> None:
    import ray

    t0 = time.perf_counter()
    ray.shutdown()
    if head is not None:
        head.stop()
    logging.getLogger(__name__).info("left Ray in %.2f s", time.perf_counter() - t0)


def _refuse(message: str) -> int:
    print(f"fusedserve: {message}", file=sys.stderr)
    return 2


def _settings(args: argparse.Namespace) -> tuple[ServerConfig, HttpConfig] | int:
    """The server's and the HTTP API's configs, with a notice for each vLLM flag that does nothing
    here; an exit status instead where a flag or a bind is refused."""
    from fusedserve.coordinator.server.config import LOOPBACK, MIN_TOKEN_CHARS

    notes, refusals = vllm_flags.notices(args)
    if args.quantization == "fp8":
        notes.append("--quantization fp8: an FP8 checkpoint runs its own path (its blocks dequantized: int8 "
                     "per channel on the CPU, 16-bit on an accelerator); another checkpoint is quantized to "
                     "int8 per channel at load (no FP8 GEMM here)")
    for note in notes:
        print(f"fusedserve: {note}", file=sys.stderr)
    if refusals:
        return _refuse("; ".join(refusals))
    token = _read_token(args)
    if args.zmq_host not in LOOPBACK and token is None:
        return _refuse(f"refusing to bind ZeroMQ to {args.zmq_host}: beyond loopback every client must "
                       f"authenticate. Give --auth-token-file FILE (or set ${TOKEN_ENV}) with a token of at "
                       f"least {MIN_TOKEN_CHARS} characters; clients send it with --auth-token-file or "
                       f"${TOKEN_ENV}.")
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        return _refuse(f"the auth token must have at least {MIN_TOKEN_CHARS} characters")
    try:
        cfg, http = server_config(args, token), http_config(args)
        cfg.check()
        http.check()
    except ValueError as exc:
        return _refuse(str(exc))
    if http.http and http.host not in LOOPBACK and http.api_key is None and token is None:
        return _refuse(f"refusing to bind the HTTP API to {http.host}: beyond loopback every client must "
                       f"authenticate. Give --api-key KEY (or set ${API_KEY_ENV}); clients send it as "
                       "'Authorization: Bearer KEY'.")
    return cfg, http


def cmd_serve(args: argparse.Namespace) -> int:
    from fusedserve.coordinator.server.server import Server

    settings = _settings(args)
    if isinstance(settings, int):
        return settings
    cfg, http_cfg = settings
    try:
        m = cfg.engine.model
        resolve_model(m.model, m.revision, m.download_dir)  # before Ray: a missing model fails fast
    except (ValueError, FileNotFoundError) as exc:
        return _refuse(str(exc))
    head = _ray(args)
    if head is not None:
        print(f"fusedserve: embedded Ray head at {head.address} (session {head.session}), loopback only",
              flush=True)
    try:
        try:
            coord = Server(cfg)
        except (FileNotFoundError, ValueError) as exc:  # no such model, a KV cache too small: one line
            return _refuse(str(exc))
        return _serve(coord, http_cfg)
    finally:
        _leave_ray(head)


def _startup_lines(coord: Server) -> None:
    """What is about to load and what the KV cache holds, as soon as both are known."""
    e, r = coord.engine_config, coord.resolved
    threads: int | str = e.device.threads_per_worker or "auto"
    if threads == "auto" and e.parallel.workers > 0:  # as the pool will split this node's cores
        threads = CoreSlots(e.parallel.workers * e.parallel.tensor_parallel_size).threads
    print(f"fusedserve: loading {e.model.model} ({r.parameters / 1e6:.1f}M parameters, {e.model.dtype}, "
          f"quantization {e.model.quantization or 'none'}) on {e.parallel.workers or 'auto'} workers x "
          f"{e.parallel.tensor_parallel_size} ranks x {threads} threads; max_model_len {e.max_model_len}",
          flush=True)
    print(f"fusedserve: {r.kv.describe()}", flush=True)
    if e.pooling:
        m = e.model
        row = f"{m.pooled_width} floats" if m.pooling_task == "embed" else f"{m.pooled_width} score logit(s)"
        print(f"fusedserve: a pooling model ({m.pooling_task}): each request's prompt runs once and its last "
              f"token's row ({row}) comes back; /v1/embeddings, /pooling, /score, /rerank", flush=True)


def _serve(coord: Server, http_cfg: HttpConfig) -> int:
    _startup_lines(coord)
    coord.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    http = None
    try:
        coord.serve_in_thread()
        auth = "token auth on every frame" if coord.server_config.auth_token else "no auth (loopback only)"
        print(f"fusedserve: serving on {coord.address} (ZeroMQ) with {len(coord.workers)} workers; {auth}",
              flush=True)
        if http_cfg.http:
            from fusedserve.coordinator.openai.gateway import Gateway, GatewayConfig
            from fusedserve.coordinator.openai.http_server import HttpServer

            gw = Gateway(GatewayConfig.for_server(coord, http_cfg), coord.tokenizer)
            http = HttpServer(gw)
            try:
                http.start()
            except RuntimeError as exc:
                http = None
                return _refuse(str(exc))
            key = "bearer token required" if gw.bearer else "no auth (loopback only)"
            print(f"fusedserve: OpenAI API on {http.url}/v1 (model {gw.model_name!r}); {key}", flush=True)
        while not stop.wait(0.5):
            if not coord.alive():
                print("fusedserve: the coordinator loop died; see the log", file=sys.stderr)
                return 1
        return 0
    finally:
        print("fusedserve: shutting down", flush=True)
        if http is not None:
            http.stop()
        coord.shutdown()


def _client(args: argparse.Namespace) -> Client:
    return Client(args.address, token=_read_token(args), admin_token=read_file(args.admin_token_file),
                  curve_server_key=read_file(args.curve_server_key_file))


def cmd_curve_keygen(args: argparse.Namespace) -> int:
    """A CURVE key pair for the ZeroMQ front end: the secret for the server, the public key for
    its clients (z85 text, the secret file readable by its owner alone)."""
    public, secret = zmq.curve_keypair()
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / "server.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.decode() + "\n")
    (out / "server.pub").write_text(public.decode() + "\n")
    print(f"fusedserve: serve with --curve-secret-key-file {out / 'server.key'}; clients use "
          f"--curve-server-key-file {out / 'server.pub'}")
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    with _client(args) as c:
        print(json.dumps(c.scale(args.workers), indent=2))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
              "top_p": args.top_p}
    if args.seed is not None:
        params["seed"] = args.seed
    with _client(args) as c:
        if args.stream:
            for frame in c.stream(args.prompt, **params):
                if frame["type"] == "token":
                    print(frame.get("text", ""), end="", flush=True)
                else:
                    usage = frame["usage"]
                    print(f"\n[{frame['finish_reason']}, {usage['completion_tokens']} tokens]")
        else:
            print(json.dumps(c.generate(args.prompt, **params), indent=2))
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as c:
        print(json.dumps(c.stats(), indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The README's main job: a two-worker server, concurrent prompts, outputs and stats."""

    head = _ray(args)
    try:
        return _demo(args)
    finally:
        _leave_ray(head)


def _demo(args: argparse.Namespace) -> int:
    from fusedserve.coordinator.server.server import Server

    args.zmq_port = 0
    settings = _settings(args)
    if isinstance(settings, int):
        return settings
    coord = Server(settings[0])
    coord.start()
    coord.serve_in_thread()
    print(f"fusedserve demo: {args.workers} {args.device} workers on {coord.address}")

    def one(prompt: str) -> dict:
        with Client(coord.address) as c:
            return c.generate(prompt, max_tokens=args.max_tokens)

    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(len(DEMO_PROMPTS)) as pool:
            outs = list(pool.map(one, DEMO_PROMPTS))
        wall = time.perf_counter() - started
        for prompt, out in zip(DEMO_PROMPTS, outs):
            t = out["timings"]
            print(f"{prompt!r} -> {out['text']!r} [{out['finish_reason']}, "
                  f"{out['usage']['completion_tokens']} tokens, ttft {t['ttft_s'] * 1e3:.0f} ms, "
                  f"total {t['total_s'] * 1e3:.0f} ms]")
        with Client(coord.address) as c:
            stats = c.stats()
        if args.json:
            print(json.dumps(stats, indent=2))
        else:
            print(_demo_summary(outs, wall, stats))
    finally:
        coord.shutdown()
    return 0


def _demo_summary(outs: list[dict], wall_s: float, stats: dict) -> str:
    """A few lines a person reads: throughput, time to first token, the workers and their cache."""
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    ttfts = sorted(o["timings"]["ttft_s"] * 1e3 for o in outs)
    lines = [f"{len(outs)} requests, {tokens} tokens in {wall_s:.2f} s: {tokens / wall_s:.1f} tokens/s; "
             f"time to first token {ttfts[len(ttfts) // 2]:.0f} ms median, {ttfts[-1]:.0f} ms at most"]
    for w in stats.get("workers", []):
        blocks = w.get("kv_blocks_used", 0) + w.get("kv_blocks_free", 0)
        lines.append(f"  {w.get('id', '?')}: {w.get('tokens', 0)} tokens, KV cache "
                     f"{w.get('kv_blocks_cached', 0)} of {blocks} blocks cached after the run")
    lines.append("(--json prints the server's stats document)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("FUSEDSERVE_LOG", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from fusedserve.coordinator.openai import bench_serve

    args = parse(argv)
    if args.cmd in ("serve", "demo") and not args.ray_address:
        os.environ.update(embedded_env())  # an embedded head: loopback, one auth mode; before ray is imported
    commands = {"serve": cmd_serve, "generate": cmd_generate, "stats": cmd_stats, "demo": cmd_demo,
                "scale": cmd_scale, "bench": bench_serve.main, "curve-keygen": cmd_curve_keygen}
    try:
        return commands[args.cmd](args)
    except (ServerError, TimeoutError) as exc:  # a refused or unanswered client command
        print(f"fusedserve: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
