"""Multi-turn sessions through the served OpenAI API, routed least-loaded, cache-aware or by
session: how many follow-up turns find their history cached on the worker they land on.

S concurrent sessions of T turns each resend their whole history (the previous prompt, its
output and a new question) to ``/v1/completions`` with an ``X-Session-Id``; optionally U other
clients send unrelated one-off prompts meanwhile. Each policy gets its own server (the embedded
default model, ``--workers N``) and ``RUNS`` runs with fresh prompts; every figure is the median
(min-max) of those runs. A follow-up turn *hits* when its cached tokens cover every full block of
the previous turn's prompt (what that worker computed and cached). Load is the tokens each
worker computed over the run, prompt tokens not found cached plus tokens generated (``stats``);
the spread is the busiest worker's over the mean.

    python -m fusedserve.benchmarks.multiturn --workers 2,4 --sessions 16 --turns 3 --others 0,4

It also times the routing choice itself at 64 workers and 8,000-token prompts (``--choice-only``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from fusedserve.benchmarks.common import RUNS, fmt, machine, spread
from fusedserve.coordinator.model_files.default_model import default_model_dir

POLICIES = ("least-loaded", "cache-aware", "session")
BLOCK = 16
HTTP = re.compile(r"OpenAI API on (http://\S+)/v1")
ZMQ = re.compile(r"serving on (tcp://\S+) ")
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government "
         "number night point home water room mother area money story fact month lot right study book "
         "eye job word business issue side kind head house service friend father power hour game line "
         "end member law car city community name president team minute idea kid body information back "
         "parent face others level office door health person art war history party result change "
         "morning reason research girl guy moment air teacher force education").split()


@dataclass
class Turn:
    session: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_text: str = ""
    ttft_s: float = 0.0
    error: str = ""


@dataclass
class Workload:
    sessions: int = 16
    turns: int = 3
    others: int = 0  # clients sending unrelated one-off prompts while the sessions run
    prompt_words: int = 60  # of the first turn (the tiny default vocabulary: ~5 tokens a word)
    question_words: int = 6
    max_tokens: int = 16
    seed: int = 0


@dataclass
class RunResult:
    turns: list[Turn] = field(default_factory=list)
    others_sent: int = 0
    worker_tokens: list[int] = field(default_factory=list)  # tokens each worker computed


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def _stream(client, prompt: str, session: str, max_tokens: int) -> tuple[dict, str, float]:
    """One streamed completion: its usage, text and time to the first token."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = 0.0, [], {}
    async with client.stream("POST", "/v1/completions", json=body, headers={"X-Session-Id": session}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "error"))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    ttft = ttft or time.perf_counter() - t0
                    text.append(choice["text"])
    return usage, "".join(text), ttft


async def _session(client, w: Workload, sid: int, out: list[Turn]) -> None:
    rng = random.Random(w.seed * 1000 + sid)
    prompt = f"Session {w.seed}-{sid}. " + _text(rng, w.prompt_words)
    prompt += "\nQuestion: " + _text(rng, w.question_words)
    for t in range(w.turns):
        turn = Turn(sid, t)
        try:
            usage, text, turn.ttft_s = await _stream(client, prompt, f"s{w.seed}-{sid}", w.max_tokens)
            turn.prompt_tokens = usage["prompt_tokens"]
            turn.cached_tokens = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            turn.output_text = text
        except Exception as exc:  # noqa: BLE001 - counted as a failed turn
            turn.error = f"{type(exc).__name__}: {exc}"
        out.append(turn)
        if turn.error:
            return
        prompt += turn.output_text + "\nQuestion: " + _text(rng, w.question_words)


async def _others(client, w: Workload, cid: int, stop: asyncio.Event) -> int:
    rng, sent = random.Random(w.seed * 7919 + cid + 10**6), 0
    while not stop.is_set():
        try:
            await _stream(client, f"Other {w.seed}-{cid}-{sent}. " + _text(rng, w.prompt_words),
                          f"o{w.seed}-{cid}-{sent}", w.max_tokens)
        except Exception:  # noqa: BLE001 - background traffic; its failures do not matter here
            pass
        sent += 1
    return sent


async def run_workload(url: str, w: Workload) -> RunResult:
    import httpx

    limits = httpx.Limits(max_connections=w.sessions + w.others + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        res, stop = RunResult(), asyncio.Event()
        others = [asyncio.create_task(_others(client, w, c, stop)) for c in range(w.others)]
        await asyncio.gather(*(_session(client, w, s, res.turns) for s in range(w.sessions)))
        stop.set()
        res.others_sent = sum(await asyncio.gather(*others))
    return res


def serve(workers: int, policy: str, num_blocks: int, threads: int,
          extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, str]:
    cmd = [sys.executable, "-m", "fusedserve.coordinator.cli", "serve", "--workers", str(workers),
           "--routing", policy,
           *extra, "--zmq-port", "0", "--port", "0", "--block-size", str(BLOCK), "--num-blocks",
           str(num_blocks), "--threads-per-worker", str(threads), "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    zmq = ""
    for line in proc.stdout:
        if m := ZMQ.search(line):
            zmq = m.group(1).replace("0.0.0.0", "127.0.0.1")
        if m := HTTP.search(line):
            return proc, m.group(1), zmq
    raise RuntimeError(f"the server did not start: {' '.join(cmd)}")


def _worker_tokens(addr: str) -> dict[str, int]:
    """Each worker's work so far: prompt tokens it computed (queried less found cached) and
    tokens it generated."""
    from fusedserve.coordinator.client import Client

    with Client(addr, timeout_s=60) as c:
        workers = c.stats()["workers"]
    return {w["id"]: w["prefix_cache"]["query_tokens"] - w["prefix_cache"]["hit_tokens"] + w["tokens"]
            for w in workers}


def one_run(url: str, addr: str, w: Workload) -> RunResult:
    before = _worker_tokens(addr)
    res = asyncio.run(run_workload(url, w))
    after = _worker_tokens(addr)
    res.worker_tokens = [after[k] - before.get(k, 0) for k in sorted(after)]
    return res


def figures(res: RunResult) -> dict:
    """The figures of one run; a follow-up hits when its cached tokens cover the previous turn's
    full prompt blocks."""
    by = {(t.session, t.turn): t for t in res.turns}
    follow = [t for t in res.turns if t.turn > 0 and not t.error]
    hits = [t for t in follow
            if t.cached_tokens >= by[(t.session, t.turn - 1)].prompt_tokens // BLOCK * BLOCK]
    prompt = sum(t.prompt_tokens for t in res.turns if not t.error)
    computed = sum(t.prompt_tokens - t.cached_tokens for t in res.turns if not t.error)
    mean = statistics.mean(res.worker_tokens) if res.worker_tokens else 0
    return {
        "follow_ups": len(follow), "follow_up_hits": len(hits),
        "follow_up_hit_rate": len(hits) / len(follow) if follow else 0.0,
        "failed_turns": sum(1 for t in res.turns if t.error),
        "session_prompt_tokens": prompt, "session_prompt_tokens_computed": computed,
        "session_cached_share": 1 - computed / prompt if prompt else 0.0,
        "follow_up_ttft_ms_p50": 1e3 * _pct([t.ttft_s for t in follow], 50),
        "follow_up_ttft_ms_p99": 1e3 * _pct([t.ttft_s for t in follow], 99),
        "load_max_over_mean": max(res.worker_tokens) / mean if mean else 0.0,
        "others_sent": res.others_sent,
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, -(-len(s) * q // 100) - 1))]


SUMMARY = ("follow_up_hit_rate", "follow_up_hits", "follow_ups", "session_prompt_tokens_computed",
           "session_cached_share", "follow_up_ttft_ms_p50", "follow_up_ttft_ms_p99", "load_max_over_mean",
           "failed_turns", "others_sent")


def line(r: dict) -> str:
    return (f"{r['workers']} workers, {r['others']} other clients, {r['policy']:>12}: follow-ups hit "
            f"{fmt(r['follow_up_hits'], '.0f')}/{fmt(r['follow_ups'], '.0f')}, prompt tokens computed "
            f"{fmt(r['session_prompt_tokens_computed'], '.0f')}, cached share "
            f"{fmt(r['session_cached_share'], '.2f')}, follow-up TTFT p50 "
            f"{fmt(r['follow_up_ttft_ms_p50'], '.0f')} ms p99 {fmt(r['follow_up_ttft_ms_p99'], '.0f')} "
            f"ms, load max/mean {fmt(r['load_max_over_mean'], '.2f')}, failed "
            f"{fmt(r['failed_turns'], '.0f')}")


def bench(workers: list[int], others: list[int], w: Workload, num_blocks: int, threads: int,
          policies: tuple[str, ...] = POLICIES, extra: tuple[str, ...] = ()) -> list[dict]:
    """Every (workers, others, policy) cell: RUNS runs, each with fresh sessions."""
    rows = []
    for n in workers:
        for policy in policies:
            proc, url, addr = serve(n, policy, num_blocks, threads, extra)
            try:
                one_run(url, addr, Workload(2, 2, 0, w.prompt_words, w.question_words, w.max_tokens, 999))
                for u in others:
                    runs = [figures(one_run(url, addr, replace(w, others=u, seed=100 * u + i)))
                            for i in range(RUNS)]
                    rows.append({"workers": n, "others": u, "policy": policy,
                                 **{k: spread([r[k] for r in runs]) for k in SUMMARY}})
                    print(line(rows[-1]), flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(120)
    return rows


def choice_cost(workers: int = 64, prompt_tokens: int = 8000, cached_workers: int = 8,
                calls: int = 200) -> dict:
    """Microseconds one routing choice takes: a fresh request's hashes (once) and ``workers`` block
    managers walked, ``cached_workers`` of them holding all but the last block of its prompt."""
    from fusedserve.coordinator.engine.block_manager import BlockManager
    from fusedserve.coordinator.engine.sequence import Sequence
    from fusedserve.coordinator.sampling_params import SamplingParams
    from fusedserve.coordinator.server.routing_policy import RoutingConfig, RoutingPolicy

    @dataclass
    class _Scheduler:
        blocks: BlockManager
        load: int
        tokens_scheduled: int = 0

    @dataclass
    class _Worker:
        worker_id: str
        scheduler: _Scheduler

    rng = random.Random(0)
    prompt = [rng.randrange(1, 150_000) for _ in range(prompt_tokens)]
    blocks = prompt_tokens // BLOCK + 2
    pool = [_Worker(f"w{i}", _Scheduler(BlockManager(blocks, BLOCK), load=i % 5)) for i in range(workers)]
    held = prompt[: (prompt_tokens // BLOCK - 1) * BLOCK]
    for w in pool[:cached_workers]:
        w.scheduler.blocks.allocate("warm", held)
        w.scheduler.blocks.commit("warm", held, len(held))
        w.scheduler.blocks.free("warm")
    policy = RoutingPolicy(RoutingConfig())
    per_call = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        for _ in range(calls):  # a new Sequence each call: its hashes are computed inside the timing
            policy.choose(Sequence("q", prompt, SamplingParams()), pool)
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    hashing = []
    from fusedserve.coordinator.engine.block_manager import prefix_hashes
    for _ in range(RUNS):
        t0 = time.perf_counter()
        for _ in range(calls):
            prefix_hashes(prompt, BLOCK)
        hashing.append((time.perf_counter() - t0) / calls * 1e6)
    return {"workers": workers, "prompt_tokens": prompt_tokens, "cached_workers": cached_workers,
            "choice_us": spread(per_call), "hashing_us": spread(hashing)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--others", default="0,4", help="unrelated clients, comma-separated cases")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker")
    ap.add_argument("--threads", type=int, default=1, help="threads per worker")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--serve-args", default="", help="more serve flags, e.g. '--routing-balance-abs 8'")
    ap.add_argument("--choice-only", action="store_true", help="only time the routing choice")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    out: dict = {"machine": machine(), "model": str(default_model_dir()), "choice": choice_cost()}
    c = out["choice"]
    print(out["machine"])
    print(f"routing choice at {c['workers']} workers, {c['prompt_tokens']}-token prompt: "
          f"{fmt(c['choice_us'], '.0f')} us per request ({fmt(c['hashing_us'], '.0f')} us of it hashing)")
    if not args.choice_only:
        w = Workload(args.sessions, args.turns, 0, args.prompt_words, max_tokens=args.max_tokens)
        print(f"{args.sessions} sessions x {args.turns} turns, median (min-max) of {RUNS} runs:")
        workers, others = [int(x) for x in args.workers.split(",")], [int(x) for x in args.others.split(",")]
        policies = tuple(args.policies.split(","))
        out["rows"] = bench(workers, others, w, args.num_blocks, args.threads, policies,
                            tuple(args.serve_args.split()))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
