"""LoRA adapters over HTTP, as vLLM serves them: ``/v1/models`` lists each adapter with its parent,
and ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` change them while the server runs.

The coordinator holds the registry (a ``loras``, ``load_lora`` or ``unload_lora`` frame); the
gateway only asks. Loading and unloading are admin actions: where the server has an admin token
(--admin-token-file), these two routes need it as the bearer token; where it has only a client
token, the coordinator refuses them, as it refuses its other admin frames.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from fusedserve.coordinator.client import ServerError
from fusedserve.coordinator.openai.api_error import ApiError
from fusedserve.coordinator.openai.gateway import Gateway


async def adapters(gw: Gateway) -> list[dict]:
    """``/v1/models``' rows for the adapters the coordinator serves (none without --enable-lora)."""
    if not gw.config.lora:
        return []
    reply = await gw.client.control("loras")
    return [{"id": a["id"], "object": "model", "created": 0, "owned_by": "fusedserve", "root": a["path"],
             "parent": a["parent"] or gw.model_name, "max_model_len": gw.max_model_len}
            for a in reply["adapters"]]


def _check_admin(gw: Gateway, request: Request) -> None:
    token = gw.config.admin_token
    if token is None:
        gw.check_auth(request)
        return
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
        raise ApiError(401, "loading and unloading adapters needs the admin token (Authorization: "
                       "Bearer ...)", code="unauthorized")


def _name(gw: Gateway, body: dict) -> str:
    if not gw.config.lora:
        raise ApiError(400, "this server serves no LoRA adapters (start it with --enable-lora)",
                       code="lora_disabled")
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "'lora_name' must be a non-empty string", param="lora_name", code="bad_field")
    if name in gw.model_names:
        raise ApiError(400, f"{name!r} is the base model's name", param="lora_name", code="bad_lora")
    return name


def add_lora_routes(app: FastAPI, gw: Gateway, read_body: Callable[[Request], Awaitable[dict]]) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        _check_admin(gw, request)
        body = await read_body(request)
        name, path = _name(gw, body), body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise ApiError(400, "'lora_path' must be a non-empty string", param="lora_path", code="bad_field")
        try:
            await gw.client.control("load_lora", name=name, path=path)
        except ServerError as exc:
            raise ApiError.from_reply(exc.reply) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        _check_admin(gw, request)
        name = _name(gw, await read_body(request))
        try:
            await gw.client.control("unload_lora", name=name)
        except ServerError as exc:
            raise ApiError.from_reply(exc.reply) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
