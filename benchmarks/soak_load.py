"""The soak's clients: a mixed OpenAI load that a server meets in its first week, as asyncio tasks.

Each client loops until told to stop, drawing its next request from a fixed mix (seeded): chat
and completions, streamed or not, JSON-schema structured outputs, forced tool calls, ``n`` = 2,
prompts from 10 tokens to near the context; a tenth of the streams are dropped after a few chunks
(the client disconnects) and one request in twenty is bad (broken JSON, a bad field, a prompt over
the context, an unknown model), each of which must get its 4xx. Every request's outcome and, for
streams, its time to first token and per output token are recorded.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CAT = {"type": "object", "properties": {"name": {"type": "string"}, "legs": {"type": "integer"}},
       "required": ["name", "legs"]}
WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "far", "away", "into", "night")
# (kind, weight): what one request is.
MIX = (("chat_stream", 28), ("chat", 17), ("completion_stream", 15), ("completion", 10), ("structured", 8),
       ("tool_call", 7), ("n2", 5), ("drop_stream", 5), ("bad", 5))


@dataclass
class Outcome:
    kind: str
    status: int  # HTTP status; 0: a transport error; -1: dropped by the client on purpose
    t_end: float
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass
class LoadLog:
    outcomes: list[Outcome] = field(default_factory=list)

    def window(self, t0: float, t1: float) -> list[Outcome]:
        return [o for o in self.outcomes if t0 <= o.t_end < t1]


def _prompt(rng: random.Random, max_words: int) -> str:
    """``n`` words of text, n log-uniform in [10, max_words]."""
    n = int(10 * (max_words / 10) ** rng.random())
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _body(kind: str, rng: random.Random, prompt_max: int) -> tuple[str, dict | bytes]:
    """(path, body) of one request of ``kind``."""
    text, out = _prompt(rng, prompt_max), rng.randint(8, 48)
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": out, "temperature": 0.7,
            "seed": rng.randrange(1 << 30)}
    if kind in ("chat", "chat_stream", "drop_stream"):
        return "/v1/chat/completions", {**chat, "stream": kind != "chat"}
    if kind in ("completion", "completion_stream", "n2"):
        return "/v1/completions", {"prompt": text, "max_tokens": out, "temperature": 0.8, "stream":
                                   kind == "completion_stream", "n": 2 if kind == "n2" else 1}
    if kind == "structured":
        fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT}}
        return "/v1/chat/completions", {**chat, "response_format": fmt, "max_tokens": 64}
    if kind == "tool_call":
        return "/v1/chat/completions", {**chat, "tools": [WEATHER], "tool_choice": "required",
                                        "max_tokens": 64}
    bad = rng.randrange(4)  # one of four bad requests
    if bad == 0:
        return "/v1/chat/completions", b'{"messages": [}'
    if bad == 1:
        return "/v1/chat/completions", {**chat, "temperature": -1}
    if bad == 2:
        return "/v1/completions", {"prompt": "word " * (4 * prompt_max), "max_tokens": 4}
    return "/v1/chat/completions", {**chat, "model": "no-such-model"}


async def _one(client: httpx.AsyncClient, kind: str, path: str, body: dict | bytes) -> Outcome:
    t0 = time.perf_counter()
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    streaming = isinstance(body, dict) and body.get("stream")
    try:
        if not streaming:
            r = await client.post(path, **kw)
            return Outcome(kind, r.status_code, time.perf_counter())
        first, chunks = None, 0
        async with client.stream("POST", path, **kw) as r:
            if r.status_code != 200:
                await r.aread()
                return Outcome(kind, r.status_code, time.perf_counter())
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                if first is None and json.loads(line[6:]).get("choices"):
                    first = time.perf_counter()
                if kind == "drop_stream" and chunks >= 3:  # leave mid-stream
                    return Outcome(kind, -1, time.perf_counter())
        end = time.perf_counter()
        ttft = None if first is None else first - t0
        tpot = (end - first) / (chunks - 2) if first is not None and chunks > 2 else None
        return Outcome(kind, r.status_code, end, ttft, tpot)
    except httpx.HTTPError:
        return Outcome(kind, 0, time.perf_counter())


async def run_clients(url: str, clients: int, stop: asyncio.Event, log: LoadLog, prompt_max: int,
                      seed: int = 0) -> None:
    """``clients`` loops against ``url`` until ``stop`` is set; outcomes into ``log``."""
    kinds, weights = zip(*MIX)

    async def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            while not stop.is_set():
                kind = rng.choices(kinds, weights)[0]
                path, body = _body(kind, rng, prompt_max)
                log.outcomes.append(await _one(client, kind, path, body))

    await asyncio.gather(*(loop(i) for i in range(clients)))


def expected(o: Outcome) -> bool:
    """A good request served (200) or deliberately dropped; a bad one refused with a 4xx."""
    if o.kind == "bad":
        return 400 <= o.status < 500
    return o.status in (200, -1)
