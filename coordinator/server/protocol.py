"""The wire protocol: msgpack maps with a ``type`` and a client-chosen ``id``.

Parsing is total: any frame either becomes a typed request or raises
``RequestError`` with a code, a message and (when it could be read) the id, so
the server can answer it and go on serving everyone else.

Authentication: a server started with a token refuses (``unauthorized``) every frame
whose ``auth`` field does not carry it, before reading anything else in the frame.
Server-to-client frames are ``token``, ``done``, ``error``, the control replies, and
``ping`` (no id): a liveness probe that clients ignore.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

import msgpack

from fusedserve.coordinator.client import ADMIN_TYPES, MAX_CLIENT_CHARS
from fusedserve.coordinator.engine.sequence import Sequence, TokenEvent
from fusedserve.coordinator.errors import RequestError
from fusedserve.coordinator.sampling_params import ZMQ, SamplingError, SamplingParams, is_kind
from fusedserve.coordinator.structured.structured_spec import StructuredError, StructuredSpec

MAX_FRAME_BYTES = 4 << 20
REQUEST_TYPES = ("generate", "abort", "stats", "health", "workers", "scale", "loras", "load_lora",
                 "unload_lora")
# The generate frame's sampling fields, each as SamplingParams declares it.
SAMPLING_FIELDS = SamplingParams.front_end_fields(ZMQ)


@dataclass
class GenerateRequest:
    id: Any
    prompt: str | None
    prompt_ids: list[int] | None
    params: SamplingParams
    stream: bool
    # The end client a gateway serves this for (its key or address): limits count per end client.
    client: str | None = None
    session: str | None = None  # the client's session: routing may keep it on one worker
    seeded: bool = True  # the request named its seed (else the server's --seed may give it one)
    lora: str | None = None  # the LoRA adapter it runs under (None: the base model)


@dataclass
class ControlRequest:
    type: str  # abort | stats | health | workers | scale | loras | load_lora | unload_lora
    id: Any
    target: Any = None  # abort: the generate id to stop; scale: the worker count; load_lora: (name, path)


def unpack(frame: bytes) -> Any:
    if len(frame) > MAX_FRAME_BYTES:
        raise RequestError("frame_too_large", f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return msgpack.unpackb(
            frame, raw=False, strict_map_key=False,
            max_str_len=1 << 20, max_bin_len=1 << 20, max_array_len=1 << 18, max_map_len=64,
            max_ext_len=0,
        )
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types for bad input
        raise RequestError("bad_frame", f"frame is not valid msgpack: {type(exc).__name__}") from None


def _valid_id(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= 256
    return is_kind(value, int) and -(2**63) <= value < 2**64


def check_token(expected: str | None, given: Any) -> bool:
    """Constant-time comparison: a wrong token takes as long to refuse as a right one to pass."""
    if expected is None:
        return True
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def parse(frame: bytes, token: str | None = None,
          admin_token: str | None = None) -> GenerateRequest | ControlRequest:
    """``admin_token``: what admin frames must carry as "admin". A server without one refuses them
    once it has a client token (beyond loopback), and takes them from anyone on loopback without."""
    msg = unpack(frame)
    if not isinstance(msg, dict):
        raise RequestError("bad_frame", f"frame must be a msgpack map, got {type(msg).__name__}")
    rid = msg.get("id")
    if not check_token(token, msg.get("auth")):
        raise RequestError("unauthorized", "missing or wrong auth token (field 'auth')",
                            rid if _valid_id(rid) else None)
    if not _valid_id(rid):
        raise RequestError("bad_field", "field 'id' must be a string (<= 256 chars) or an integer",
                            rid if _valid_id(rid) else None)
    kind = msg.get("type")
    if kind not in REQUEST_TYPES:
        raise RequestError("unknown_type", f"unknown request type {kind!r}; one of {REQUEST_TYPES}", rid)
    if kind in ADMIN_TYPES:
        if admin_token is None and token is not None:
            raise RequestError("unauthorized", f"{kind!r} is an admin frame; this server takes none (start "
                               "it with --admin-token-file)", rid)
        if not check_token(admin_token, msg.get("admin")):
            raise RequestError("unauthorized", "missing or wrong admin token (field 'admin')", rid)
    if kind == "generate":
        return _parse_generate(msg, rid)
    if kind == "abort":
        target = msg.get("target", rid)
        if not _valid_id(target):
            raise RequestError("bad_field", "field 'target' must be a request id", rid)
        return ControlRequest("abort", rid, target)
    if kind == "scale":
        n = msg.get("workers")
        if not is_kind(n, int) or n < 1:
            raise RequestError("bad_field", "field 'workers' must be an integer >= 1", rid)
        return ControlRequest("scale", rid, n)
    if kind in ("load_lora", "unload_lora"):
        name, path = msg.get("name"), msg.get("path")
        if not isinstance(name, str) or (kind == "load_lora" and not isinstance(path, str)):
            what = "'name' and 'path' must be strings" if kind == "load_lora" else "'name' must be a string"
            raise RequestError("bad_field", f"{kind}: {what}", rid)
        return ControlRequest(kind, rid, (name, path))
    return ControlRequest(kind, rid)


def _parse_generate(msg: dict, rid: Any) -> GenerateRequest:
    prompt, prompt_ids = msg.get("prompt"), msg.get("prompt_ids")
    if (prompt is None) == (prompt_ids is None):
        raise RequestError("bad_field", "give exactly one of 'prompt' (text) or 'prompt_ids'", rid)
    if prompt is not None and not isinstance(prompt, str):
        raise RequestError("bad_field", "field 'prompt' must be a string", rid)
    if prompt_ids is not None and not (is_kind(prompt_ids, list)
                                       and all(is_kind(t, int) for t in prompt_ids)):
        raise RequestError("bad_field", "field 'prompt_ids' must be a list of integers", rid)
    kwargs = {}
    for key, field_spec in SAMPLING_FIELDS.items():
        if msg.get(key) is None:
            continue
        wrong = field_spec.wrong_kind(msg[key])
        if wrong is not None:
            raise RequestError("bad_field", f"field {key!r} {wrong}", rid)
        kwargs[key] = msg[key]
    stream = msg.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("bad_field", "field 'stream' must be a boolean", rid)
    client, session, lora = msg.get("client"), msg.get("session_id"), msg.get("lora")
    for key, value in (("client", client), ("session_id", session), ("lora", lora)):
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_CLIENT_CHARS):
            raise RequestError("bad_field",
                               f"field {key!r} must be a string of 1-{MAX_CLIENT_CHARS} characters", rid)
    if msg.get("structured") is not None:
        try:
            kwargs["structured"] = StructuredSpec.from_wire(msg["structured"])
        except StructuredError as exc:
            raise RequestError("bad_structured_output", str(exc), rid) from None
    try:
        params = SamplingParams(**kwargs)
    except SamplingError as exc:
        raise RequestError("bad_param", str(exc), rid) from None
    return GenerateRequest(rid, prompt, prompt_ids, params, stream, client, session, "seed" in kwargs, lora)


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def token(rid: Any, ev: TokenEvent) -> dict:
    """A streamed token: its id, the text it completed (may be empty) and its index."""
    seq = ev.seq
    i = ev.index if ev.index >= 0 else len(seq.output_ids) - 1
    msg = {"type": "token", "id": rid, "token": ev.token, "text": ev.text, "index": i}
    if seq.params.logprobs:
        msg["logprob"] = seq.logprobs[i]
        if seq.params.top_logprobs:
            msg["top_logprobs"] = [list(p) for p in seq.top_logprobs[i]]
    if seq.params.prompt_logprobs is not None and msg["index"] == 0:  # known once the prompt is done
        _prompt_logprobs(msg, seq)
    return msg


def _prompt_logprobs(msg: dict, seq: Sequence) -> None:
    msg["prompt_token_ids"] = list(seq.prompt_ids)
    msg["prompt_logprobs"] = list(seq.prompt_logprobs) or [None] * len(seq.prompt_ids)
    msg["prompt_top_logprobs"] = [[list(p) for p in step] for step in seq.prompt_top_logprobs]


def done(rid: Any, seq: Sequence, timings: dict) -> dict:
    msg = {
        "type": "done", "id": rid, "text": seq.text, "token_ids": list(seq.output_ids),
        "finish_reason": seq.finish_reason or "abort",
        "usage": {"prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.output_ids),
                  "cached_tokens": seq.cached_tokens or 0},
        "timings": timings,
    }
    if seq.pooled is not None:  # a pooling model's result: float32, little-endian
        msg["pooled"] = seq.pooled.astype("<f4").tobytes()
    if seq.params.logprobs:
        msg["logprobs"] = list(seq.logprobs)
        if seq.params.top_logprobs:
            msg["top_logprobs"] = [[list(p) for p in step] for step in seq.top_logprobs]
    if seq.params.prompt_logprobs is not None:
        _prompt_logprobs(msg, seq)
    return msg


def error(rid: Any, code: str, message: str) -> dict:
    return {"type": "error", "id": rid, "code": code, "message": message}
