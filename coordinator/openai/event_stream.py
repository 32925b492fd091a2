"""A streamed completion as server-sent events: every choice's chunks interleaved as they come,
logprobs and usage as the request asked, an error event if the coordinator fails mid-stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import anyio

from fusedserve.coordinator.client import ServerError
from fusedserve.coordinator.openai import chat_output
from fusedserve.coordinator.openai import protocol as oa
from fusedserve.coordinator.openai import response_fields as rf
from fusedserve.coordinator.openai.gateway import Gateway


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def names_as_ids(gw: Gateway, prep: oa.Prepared) -> bool:
    """Logprobs name tokens ``token_id:N``: the request's return_tokens_as_token_ids, else the server's."""
    return gw.token_ids_as_tokens if prep.token_ids_as_tokens is None else prep.token_ids_as_tokens


async def chain(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for item in rest:
        yield item


async def _merged(gw: Gateway, prep: oa.Prepared, rids: list[str]) -> AsyncIterator[tuple[int, dict]]:
    """The frames of every choice, as they come, tagged with the choice's index."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, rid: str) -> None:
        try:
            async for frame in gw.client.stream(prep.prompt(i)[0], request_id=rid, **prep.choice_params(i)):
                await queue.put((i, frame, None))
        except Exception as exc:  # noqa: BLE001 - a ServerError or a bug: handed to the consumer
            await queue.put((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, rid)) for i, rid in enumerate(rids)]
    try:
        left = len(rids)
        while left:
            i, frame, exc = await queue.get()
            if exc is not None:
                raise exc
            if frame["type"] == "done":
                left -= 1
            yield i, frame
    finally:
        for t in tasks:
            t.cancel()


async def stream(gw: Gateway, prep: oa.Prepared, chat: bool) -> AsyncIterator[str]:
    """Server-sent events, every choice's chunks interleaved as they come; a client that
    disconnects cancels this and the requests are aborted."""
    rids = [gw.client.new_id() for _ in range(prep.choices)]
    finished: set[int] = set()
    cid = prep.request_id or rf.new_id("chatcmpl" if chat else "cmpl")
    head = {"id": cid, "created": prep.created, "model": prep.model,
            "object": "chat.completion.chunk" if chat else "text_completion"}
    frames = _merged(gw, prep, rids)
    as_ids = names_as_ids(gw, prep)
    prompt_tokens = sum(len(prep.prompt(i)[0]) for i in range(0, len(rids), prep.n))
    generated = [0]

    def chunk(choices: list[dict]) -> str:
        """One chunk; with continuous_usage_stats, the usage so far rides on it (as vLLM does)."""
        body = {**head, "choices": choices}
        if prep.continuous_usage:
            body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": generated[0],
                             "total_tokens": prompt_tokens + generated[0]}
        return sse(body)
    states = [chat_output.ChatStream(prep.reasoning, prep.thinking_opened, prep.tools) for _ in rids]
    offsets, last, dones, started = [0] * len(rids), None, [None] * len(rids), set()
    try:
        try:
            i, frame = await frames.__anext__()
        except ServerError as exc:
            finished.update(range(len(rids)))
            gw.metrics.refused(exc.reply)
            raise oa.ApiError.from_reply(exc.reply) from None
        while True:
            if i not in started:  # a choice's first chunk: the role, or the echoed prompt
                started.add(i)
                first: dict = {"index": i, "logprobs": None, "finish_reason": None}
                if chat:
                    first["delta"] = {"role": "assistant", "content": ""}
                    yield chunk([first])
                elif prep.echo:
                    first["text"] = prep.prompt(i)[1]
                    if prep.logprobs is not None and "prompt_logprobs" in frame:
                        first["logprobs"] = rf.echo_logprobs(gw.tokenizer, frame, None, as_ids)
                    offsets[i] = len(first["text"])
                    yield chunk([first])
            if frame["type"] == "done":
                finished.add(i)
                dones[i] = frame
                gw.metrics.finished(frame, prep.params["max_tokens"])
                reason = "length" if prep.echo_only else frame["finish_reason"]
                tail: list[dict] = []
                if chat:
                    tail, reason = states[i].finish(reason)
                for delta in tail:
                    yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
                fin = {"index": i, "finish_reason": reason, "logprobs": None}
                fin.update({"delta": {}} if chat else {"text": ""})
                yield chunk([fin])
                if len(finished) == len(rids):
                    if prep.include_usage:
                        yield sse({**head, "choices": [], "usage": rf.usage(dones, prep.n, prep.echo_only)})
                    yield sse("[DONE]")
                    return
            elif not prep.echo_only:
                generated[0] += 1
                now = time.perf_counter()
                if last is not None:
                    gw.metrics.itl.observe(now - last)
                last = now
                lp = [frame["logprob"]] if "logprob" in frame else None
                tops = [frame["top_logprobs"]] if "top_logprobs" in frame else None
                if chat:
                    deltas = states[i].push(frame["text"]) or [{"content": ""}]
                    for k, delta in enumerate(deltas):
                        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                        if k == 0 and prep.logprobs is not None and lp:
                            choice["logprobs"] = rf.chat_logprobs(gw.tokenizer, [frame["token"]], lp, tops,
                                                                  as_ids)
                        yield chunk([choice])
                else:
                    choice = {"index": i, "text": frame["text"], "logprobs": None, "finish_reason": None}
                    if prep.logprobs is not None and lp:
                        choice["logprobs"] = rf.completion_logprobs(gw.tokenizer, [frame["token"]], lp, tops,
                                                                    offsets[i], as_ids)
                    offsets[i] += len(frame["text"])
                    yield chunk([choice])  # one chunk a token, even mid-character
            try:
                i, frame = await frames.__anext__()
            except ServerError as exc:  # failed mid-stream: an error event, then the end
                finished.update(range(len(rids)))
                gw.metrics.failed()
                yield sse(oa.ApiError.from_reply(exc.reply).body())
                yield sse("[DONE]")
                return
    finally:  # shielded: a cancelled scope would cancel these awaits too
        with anyio.CancelScope(shield=True):
            await frames.aclose()
            for i, rid in enumerate(rids):
                if i not in finished:  # cancelled (the client disconnected) or failed
                    await gw.client.abort(rid)
            if len(finished) < len(rids):
                gw.metrics.failed("abort")
