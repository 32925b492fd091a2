"""``fusedserve bench serve``: a load client for the OpenAI API, as vLLM's serving benchmark.

Requests arrive as a Poisson process at ``--request-rate`` (or all at once), at most
``--max-concurrency`` in flight; prompts are random words (fixed or random lengths,
from ``--seed``), outputs have a fixed token count (``ignore_eos``). Every request
streams, so time to first token and each inter-token gap are measured at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

WORDS = ("the of and to in is was he for it with as his on be at by had are but from or have an they which "
         "one you were all her she there would their we him been has when who will no more if out so up said "
         "what its about than into them can only other time new some could these two may first then do any "
         "like my now over such our man me even most made after also did many off before must well back "
         "through years much where your way down should because long each just state people those too how "
         "little good world very still own see men work day get here between both life being under "
         "never").split()


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the server's first model
    num_prompts: int = 100
    request_rate: float = math.inf  # requests per second; inf: all at once
    max_concurrency: int | None = None
    input_len: int = 32  # words
    output_len: int = 32  # tokens
    range_ratio: float = 0.0  # lengths drawn from [len * (1 - r), len * (1 + r)]
    seed: int = 0
    api_key: str | None = None
    progress: bool = True
    # False: a connection per request (llama-server's HTTP closes a kept-alive connection after 5
    # requests, and the request sent on it then fails).
    keepalive: bool = True


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


async def _one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    import httpx

    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    chunks = 0  # token chunks: the output's length where a server streams no usage
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                choice = (chunk.get("choices") or [{}])[0]
                if choice and choice.get("finish_reason") is None:  # a token's chunk
                    now = time.perf_counter()
                    chunks += 1
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or chunks
    res.ok = True
    return res


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [g for r in ok for g in r.itl]
    summary = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
               "request_throughput": len(ok) / duration, "output_throughput": out / duration,
               "total_token_throughput": (out + sum(r.prompt_tokens for r in ok)) / duration,
               "output_tokens": out, "errors": sorted({r.error for r in results if not r.ok})[:5]}
    summary["total_input_tokens"] = sum(r.prompt_tokens for r in ok)
    summary["total_output_tokens"] = out
    e2el = [r.latency for r in ok]
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        ms = [v * 1e3 for v in values]
        for q in (50, 90, 99):
            summary[f"{name}_ms_p{q}"] = _pct(values, q) * 1e3
            summary[f"p{q}_{name}_ms"] = summary[f"{name}_ms_p{q}"]  # vLLM bench serve's name
        summary[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        summary[f"median_{name}_ms"] = statistics.median(ms) if ms else 0.0
        summary[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else 0.0
    return summary


async def run(cfg: BenchConfig) -> dict:
    import httpx
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    work = [(" ".join(rng.choice(WORDS) for _ in range(_lengths(rng, cfg.input_len, cfg.range_ratio))),
             _lengths(rng, cfg.output_len, cfg.range_ratio)) for _ in range(cfg.num_prompts)]
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_concurrency or cfg.num_prompts,
                          max_keepalive_connections=None if cfg.keepalive else 0)
    # The server's root, or its OpenAI base URL as `serve` prints it and OpenAI clients take it.
    base_url = cfg.base_url.rstrip("/").removesuffix("/v1")
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600,
                                 limits=limits) as client:
        model = cfg.model
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(cfg.max_concurrency or cfg.num_prompts)
        bar = tqdm(total=cfg.num_prompts, disable=not cfg.progress, desc="requests")

        async def limited(prompt: str, n: int) -> RequestResult:
            async with gate:
                res = await _one(client, model, prompt, n)
            bar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = []
        for prompt, n in work:
            tasks.append(asyncio.ensure_future(limited(prompt, n)))
            if math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = await asyncio.gather(*tasks)
        bar.close()
    return {"config": {k: v for k, v in asdict(cfg).items() if k != "api_key"},
            **summarize(results, time.perf_counter() - t0)}


def report(s: dict) -> str:
    lines = [f"{'Successful requests':<28}{s['completed']:>12}", f"{'Failed requests':<28}{s['failed']:>12}",
             f"{'Duration (s)':<28}{s['duration_s']:>12.2f}",
             f"{'Request throughput (req/s)':<28}{s['request_throughput']:>12.2f}",
             f"{'Output throughput (tok/s)':<28}{s['output_throughput']:>12.2f}",
             f"{'Total throughput (tok/s)':<28}{s['total_token_throughput']:>12.2f}"]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL")):
        lines.append(f"{label + ' p50/p90/p99 (ms)':<28}" + "/".join(
            f"{s[f'{name}_ms_p{q}']:.1f}" for q in (50, 90, 99)).rjust(12))
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    p.add_argument("--base-url", default=d.base_url)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--request-rate", type=float, default=d.request_rate, help="requests/s (default: inf)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", "--random-input-len", type=int, default=d.input_len,
                   help="prompt length in words (vLLM's --random-input-len counts tokens)")
    p.add_argument("--output-len", "--random-output-len", type=int, default=d.output_len,
                   help="output length in tokens")
    p.add_argument("--range-ratio", "--random-range-ratio", type=float, default=d.range_ratio,
                   help="0: fixed lengths")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", "--result-filename", default=None,
                   help="also write the summary to this file (vLLM's key names beside ours)")
    p.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    cfg = BenchConfig(args.base_url, args.model, args.num_prompts, args.request_rate, args.max_concurrency,
                      args.input_len, args.output_len, args.range_ratio, args.seed, args.api_key,
                      not args.no_progress)
    summary = asyncio.run(run(cfg))
    print(report(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1
