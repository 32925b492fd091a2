"""OpenAI's Responses API: ``POST /v1/responses`` (whole or streamed), ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A request runs as the chat completion it is (``responses_protocol.chat_body``), through the
same template, tool choice, parsers and structured outputs as ``/v1/chat/completions``; its output
becomes items. With ``store`` (the default) the response and its conversation are kept
(``responses_store.py``) for retrieval and for ``previous_response_id``, which continues it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fusedserve.coordinator.openai import event_stream
from fusedserve.coordinator.openai import protocol as oa
from fusedserve.coordinator.openai import responses_protocol as rp
from fusedserve.coordinator.openai.api_error import ApiError
from fusedserve.coordinator.openai.gateway import Gateway
from fusedserve.coordinator.openai.responses_store import ResponseStore, StoredResponse
from fusedserve.coordinator.openai.responses_stream import ResponseStream

ReadBody = Callable[[Request], Awaitable[dict]]
Prepare = Callable[[Request, dict], Awaitable[oa.Prepared]]
Complete = Callable[[Request, oa.Prepared], Awaitable["dict | Response"]]


def _input_ids(items: list[dict]) -> list[dict]:
    """Input items as listed back: each with an id (OpenAI names them too)."""
    return [{**item, "id": item.get("id") or rp.new_id("msg" if item.get("type", "message") == "message"
                                                      else "item")} for item in items]


def add_responses_routes(app: FastAPI, gw: Gateway, read_body: ReadBody, prepare: Prepare,
                         complete: Complete) -> None:
    http = gw.config.http
    store = ResponseStore(http.responses_store_size, http.responses_store_bytes)
    app.state.responses = store

    def stored(response_id: str) -> StoredResponse:
        found = store.get(response_id)
        if found is None:
            raise ApiError(404, f"no stored response {response_id!r} (never stored, deleted, or dropped from "
                           "the store)", param="response_id", code="response_not_found")
        return found

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        gw.check_auth(request)
        body = await read_body(request)
        gw.need_task(None, "/v1/responses")
        gw.shed(request)
        history: list[dict] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            found = store.get(previous) if isinstance(previous, str) else None
            if found is None:
                raise ApiError(400, f"previous_response_id {previous!r} is not a stored response",
                               param="previous_response_id", code="previous_response_not_found")
            history = found.conversation
        chat, conversation, items = rp.chat_body(body, history)
        prep = await prepare(request, chat)
        rid, created = rp.new_id("resp"), int(time.time())

        def keep(response: dict) -> None:
            if body.get("store", True) is not False:
                replay = conversation + rp.assistant_messages(response["output"])
                store.put(response, replay, _input_ids(items))

        if prep.stream:
            gen = event_stream.stream(gw, prep, chat=True)
            first = await gen.__anext__()  # errors before the first token are a plain HTTP error
            events = _events(ResponseStream(rid, body, prep.model, created), first, gen, keep)
            return StreamingResponse(events, media_type="text/event-stream")
        out = await complete(request, prep)
        if isinstance(out, Response):
            return out
        choice = out["choices"][0]
        response = rp.response_object(rid, body, prep.model, rp.output_items(choice["message"]), "completed",
                                      out["usage"], created, choice["finish_reason"])
        keep(response)
        return JSONResponse(response)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> dict:
        gw.check_auth(request)
        return stored(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> dict:
        gw.check_auth(request)
        stored(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> dict:
        gw.check_auth(request)
        items = stored(response_id).input_items
        return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None, "has_more": False}


async def _events(stream: ResponseStream, first: str, rest: AsyncIterator[str],
                  keep: Callable[[dict], object]) -> AsyncIterator[str]:
    """The chat chunks as Responses events; the completed response is stored (when asked)."""
    for event in stream.start():
        yield event
    async for line in event_stream.chain(first, rest):
        for event in stream.push(line):
            yield event
    if stream.response is not None:
        keep(stream.response)
