"""The OpenAI-compatible HTTP API: a gateway that is a ZeroMQ client of the coordinator.

It runs in the ``serve`` process, on a thread of its own with its own event loop, and
talks to the coordinator like any other client (one DEALER connection, requests
multiplexed by id), so ZeroMQ stays the coordinator's only protocol. A client that
disconnects has its request aborted over ZeroMQ: its KV blocks are freed at once.
``/v1/*`` requires ``Authorization: Bearer TOKEN`` when the server has a token (the
same token as the ZeroMQ ``auth`` field); ``/health`` and ``/metrics`` do not.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time

import anyio
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fusedserve.coordinator.client import ServerError
from fusedserve.coordinator.openai import chat_output, event_stream
from fusedserve.coordinator.openai import protocol as oa
from fusedserve.coordinator.openai import response_fields as rf
from fusedserve.coordinator.openai.gateway import HEALTH_STALE_S, Gateway
from fusedserve.coordinator.openai.lora_api import adapters, add_lora_routes
from fusedserve.coordinator.openai.pooling_api import add_pooling_routes
from fusedserve.coordinator.openai.responses_api import add_responses_routes
from fusedserve.coordinator.sampling_params import is_kind

log = logging.getLogger(__name__)


def _version() -> str:
    try:
        return importlib.metadata.version("fusedserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "0+unknown"


VERSION = _version()


async def _read_body(request: Request) -> dict:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > oa.MAX_BODY_BYTES:
        raise oa.ApiError(413, f"request body of {declared} bytes exceeds {oa.MAX_BODY_BYTES}",
                          code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > oa.MAX_BODY_BYTES:
            raise oa.ApiError(413, f"request body exceeds {oa.MAX_BODY_BYTES} bytes", code="body_too_large")
        chunks.append(chunk)
    return oa.parse_body(b"".join(chunks))


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(gw: Gateway) -> FastAPI:
    app = FastAPI(title="fusedserve", docs_url=None, redoc_url=None, openapi_url=None)
    http = gw.config.http
    app.add_middleware(CORSMiddleware, allow_origins=list(http.allowed_origins),
                       allow_methods=list(http.allowed_methods), allow_headers=list(http.allowed_headers),
                       allow_credentials=http.allow_credentials)

    @app.exception_handler(oa.ApiError)
    async def _api_error(request: Request, exc: oa.ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        gw.metrics.internal_errors.inc()
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        err = oa.ApiError(500, f"internal error: {type(exc).__name__}", code="internal")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        """The coordinator's health as the gateway's watcher last heard it (at most HEALTH_STALE_S
        old): answered at once, however busy the coordinator is; asked directly before the first."""
        if gw.health is not None and time.monotonic() - gw.health[0] < HEALTH_STALE_S:
            h = gw.health[1]
        else:
            try:
                h = await asyncio.wait_for(gw.client.health(), HEALTH_STALE_S)
            except (TimeoutError, ServerError):
                return JSONResponse({"ok": False}, status_code=503)
        body = {"ok": h["ok"], "workers": h["workers"], "starting": h["starting"]}
        return JSONResponse(body, status_code=200 if h["ok"] else 503)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        """SageMaker's health probe (vLLM serves it too): /health's answer."""
        return await health()

    @app.get("/load")
    async def load(request: Request) -> Response:
        """vLLM's: how many requests the server holds now (queued or in a worker's batch)."""
        gw.check_auth(request)
        try:
            stats = await asyncio.wait_for(gw.client.stats(), 5)
        except (TimeoutError, ServerError):
            return JSONResponse({"server_load": None}, status_code=503)
        return JSONResponse({"server_load": stats["coordinator"]["pending"]})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await asyncio.wait_for(gw.client.stats(), 5)
        except (TimeoutError, ServerError):
            stats = None
        return Response(gw.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        """vLLM's: a prompt, or chat messages rendered as the chat endpoint renders them."""
        gw.check_auth(request)
        body = await _read_body(request)
        if gw.tokenizer is None:
            raise oa.ApiError(400, "this model has no tokenizer", code="no_tokenizer")
        if "messages" in body:
            prep = await anyio.to_thread.run_sync(oa.chat_request, {**body, "max_tokens": 1}, gw.tokenizer,
                                                  gw.template, gw.max_tokens, gw.reasoning, gw.tool_parser,
                                                  gw.max_prompt_chars, gw.trust_request_template)
            ids = prep.prompt_ids
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise oa.ApiError(400, "'prompt' must be a string (or give 'messages')", param="prompt",
                                  code="bad_field")
            if len(prompt) > gw.max_prompt_chars:
                raise oa.ApiError(413, f"the prompt has {len(prompt)} characters; the limit is "
                                  f"{gw.max_prompt_chars}", param="prompt", code="prompt_too_long")
            ids = await anyio.to_thread.run_sync(gw.tokenizer.encode, prompt)
        strs = body.get("return_token_strs", False)
        if not isinstance(strs, bool | None):
            raise oa.ApiError(400, "'return_token_strs' must be a boolean", param="return_token_strs",
                              code="bad_field")
        token_strs = [gw.tokenizer.token_piece(t) for t in ids] if strs else None
        return {"count": len(ids), "max_model_len": gw.max_model_len, "tokens": ids, "token_strs": token_strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        gw.check_auth(request)
        body = await _read_body(request)
        tokens = body.get("tokens")
        vocab = gw.tokenizer.vocab_size if gw.tokenizer is not None else 0
        if not isinstance(tokens, list) or not all(
                is_kind(t, int) and 0 <= t < vocab for t in tokens):
            raise oa.ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens",
                              code="bad_field")
        return {"prompt": await anyio.to_thread.run_sync(gw.tokenizer.decode, tokens)}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gw.check_auth(request)
        try:
            loras = await adapters(gw)
        except ServerError as exc:
            raise oa.ApiError.from_reply(exc.reply) from None
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "fusedserve", "root": gw.model_name,
             "max_model_len": gw.max_model_len} for name in gw.model_names] + loras}

    async def as_completion(request: Request, body: dict) -> Response:
        gw.need_task(None, "/v1/completions")
        gw.shed(request, _choices(body))
        # Tokenizing (and, for chat, rendering the template) runs on a thread: never on this loop.
        prep = await anyio.to_thread.run_sync(oa.completion_request, body, gw.tokenizer, 16,
                                              gw.max_prompt_chars, gw.defaults)
        return await _run(gw, request, gw.admit(prep, request), chat=False)

    async def prepare_chat(request: Request, body: dict) -> oa.Prepared:
        """A chat body rendered, tokenized (on a thread: never on this loop) and admitted."""
        prep = await anyio.to_thread.run_sync(oa.chat_request, body, gw.tokenizer, gw.template, gw.max_tokens,
                                              gw.reasoning, gw.tool_parser, gw.max_prompt_chars,
                                              gw.trust_request_template, gw.defaults, gw.auto_tools,
                                              gw.tool_format)
        return gw.admit(prep, request)

    async def as_chat(request: Request, body: dict) -> Response:
        gw.need_task(None, "/v1/chat/completions")
        gw.shed(request, _choices(body))
        return await _run(gw, request, await prepare_chat(request, body), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        gw.check_auth(request)
        return await as_completion(request, await _read_body(request))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        gw.check_auth(request)
        return await as_chat(request, await _read_body(request))

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's one endpoint (as vLLM routes it): a body with ``messages`` is a chat
        completion, one with ``prompt`` a completion. It takes the same bearer token as /v1/*."""
        gw.check_auth(request)
        body = await _read_body(request)
        if "messages" in body:
            return await as_chat(request, body)
        if "prompt" in body:
            return await as_completion(request, body)
        raise oa.ApiError(400, "an /invocations body has 'messages' (a chat completion) or 'prompt' (a "
                          "completion)", code="bad_field")

    add_pooling_routes(app, gw, _read_body)
    add_lora_routes(app, gw, _read_body)
    add_responses_routes(app, gw, _read_body, prepare_chat,
                         lambda request, prep: _complete(gw, request, prep, True))
    return app


def _choices(body: dict) -> int:
    """The requests a body will send (its ``n``; a bad one is refused later, by field)."""
    n = body.get("n")
    return n if is_kind(n, int) and 1 <= n <= 64 else 1


async def _run(gw: Gateway, request: Request, prep: oa.Prepared, chat: bool) -> Response:
    if prep.stream:
        gen = event_stream.stream(gw, prep, chat)
        first = await gen.__anext__()  # errors before the first token become a plain HTTP error
        return StreamingResponse(event_stream.chain(first, gen), media_type="text/event-stream")
    out = await _complete(gw, request, prep, chat)
    return out if isinstance(out, Response) else JSONResponse(out)


async def _complete(gw: Gateway, request: Request, prep: oa.Prepared, chat: bool) -> dict | Response:
    """A whole (not streamed) completion's body, or the 499 of a client that left."""
    rids = [gw.client.new_id() for _ in range(prep.choices)]
    tasks = [asyncio.ensure_future(gw.client.generate(prep.prompt(i)[0], request_id=rid,
                                                      **prep.choice_params(i))) for i, rid in enumerate(rids)]
    gone = asyncio.ensure_future(_until_disconnect(request))
    everything = asyncio.ensure_future(asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION))
    try:
        await asyncio.wait({everything, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
    if failed or not all(t.done() for t in tasks):  # an error, or the client left: stop every choice
        for t, rid in zip(tasks, rids):
            if not t.done():
                t.cancel()
                await gw.client.abort(rid)
        everything.cancel()
        if not failed:
            gw.metrics.failed("abort")
            return Response(status_code=499)
        exc = failed[0].exception()
        if isinstance(exc, ServerError):
            gw.metrics.refused(exc.reply)
            raise oa.ApiError.from_reply(exc.reply) from None
        gw.metrics.failed()
        raise exc
    dones = [t.result() for t in tasks]
    for done in dones:
        gw.metrics.finished(done, prep.params["max_tokens"])
    return _final(gw, prep, dones, chat)


def _final(gw: Gateway, prep: oa.Prepared, dones: list[dict], chat: bool) -> dict:
    choices, as_ids = [], event_stream.names_as_ids(gw, prep)
    for i, done in enumerate(dones):
        ids, lps, tops = done["token_ids"], done.get("logprobs"), done.get("top_logprobs")
        choice: dict = {"index": i, "finish_reason": done["finish_reason"], "logprobs": None}
        if chat:
            choice["message"], choice["finish_reason"] = chat_output.message(
                done["text"], done["finish_reason"], prep.reasoning, prep.thinking_opened, prep.tools)
            if prep.logprobs is not None and lps is not None:
                choice["logprobs"] = rf.chat_logprobs(gw.tokenizer, ids, lps, tops, as_ids)
        else:
            text = "" if prep.echo_only else done["text"]
            if prep.echo_only:
                ids, lps, tops, choice["finish_reason"] = [], [], [], "length"
            choice["text"] = (prep.prompt(i)[1] if prep.echo else "") + text
            if prep.logprobs is not None and lps is not None:
                choice["logprobs"] = rf.completion_logprobs(gw.tokenizer, ids, lps, tops, as_ids=as_ids)
                if prep.echo:
                    choice["logprobs"] = rf.echo_logprobs(gw.tokenizer, done, choice["logprobs"], as_ids)
            if prep.prompt_logprobs is not None:  # vLLM puts a completion's in each choice
                choice["prompt_logprobs"] = rf.prompt_logprobs(gw.tokenizer, done, as_ids)
        choices.append(choice)
    out = {"id": prep.request_id or rf.new_id("chatcmpl" if chat else "cmpl"), "created": prep.created,
           "model": prep.model, "object": "chat.completion" if chat else "text_completion",
           "choices": choices, "usage": rf.usage(dones, prep.n, prep.echo_only)}
    if chat and prep.prompt_logprobs is not None:  # ... and a chat completion's beside its choices
        out["prompt_logprobs"] = rf.prompt_logprobs(gw.tokenizer, dones[0], as_ids)
    return out

