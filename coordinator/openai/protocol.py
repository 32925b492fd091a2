"""OpenAI request bodies -> the coordinator's ``generate`` fields; its replies -> OpenAI responses.

Types are checked here, with the offending field named; ranges are the coordinator's
(``SamplingParams``), so the HTTP and ZeroMQ fronts refuse the same values. Unknown
fields are ignored. Every error is an ``ApiError`` in OpenAI's shape with its status.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from coordinator.openai.chat_template import ChatTemplate, ChatTemplateError
from kernels.model.tokenizer import TextTokenizer

MAX_BODY_BYTES = 4 << 20  # the ZeroMQ front end's frame limit
# Coordinator error codes that are not a 400 (a bad request).
STATUS = {"unauthorized": 401, "prompt_too_long": 413, "too_many_requests": 429, "server_busy": 429,
          "no_workers": 503, "shutdown": 503, "internal": 500, "sampling_error": 500, "worker_error": 500,
          "slow_client": 500}
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
         503: "service_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    @classmethod
    def from_reply(cls, reply: dict) -> ApiError:
        code = reply.get("code") or "internal"
        return cls(STATUS.get(code, 400), reply.get("message") or code, code=code)


def _no_constant(name: str) -> float:
    raise ApiError(400, f"{name} is not a valid JSON number", code="bad_json")


def parse_body(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {len(raw)} bytes exceeds {MAX_BODY_BYTES}",
                       code="body_too_large")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except ApiError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="bad_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="bad_json")
    return body


def _get(body: dict, key: str, kind: type | tuple, default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    numeric = kind in (float, (int, float))
    ok = isinstance(value, (int, float) if numeric else kind) and not (
        isinstance(value, bool) and kind is not bool)
    if not ok:
        want = "a number" if numeric else f"of type {getattr(kind, '__name__', kind)}"
        raise ApiError(400, f"'{key}' must be {want}, got {type(value).__name__}", param=key,
                       code="bad_field")
    if numeric and not math.isfinite(value):
        raise ApiError(400, f"'{key}' must be finite", param=key, code="bad_field")
    if isinstance(value, int) and not _wire_int(value):
        raise ApiError(400, f"'{key}' is {value}: beyond any accepted value", param=key, code="bad_param")
    return value


def _wire_int(value: int) -> bool:
    """Whether an integer fits the coordinator's frames (msgpack: [-2^63, 2^64))."""
    return -(1 << 63) <= value < 1 << 64


@dataclass
class Prepared:
    """One OpenAI request, ready for the coordinator."""

    model: str
    prompt_ids: list[int]
    params: dict  # the generate frame's sampling fields
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # None: not asked; else how many top alternatives per token
    created: int = field(default_factory=lambda: int(time.time()))


def _sampling(body: dict, default_max: int) -> dict:
    n = _get(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", param="n", code="bad_field")
    max_tokens = _get(body, "max_completion_tokens", int) or _get(body, "max_tokens", int, default_max)
    top_k = _get(body, "top_k", int, 0)
    params = {"max_tokens": max_tokens, "temperature": _get(body, "temperature", float, 1.0),
              "top_p": _get(body, "top_p", float, 1.0), "top_k": 0 if top_k == -1 else top_k,
              "min_p": _get(body, "min_p", float, 0.0), "ignore_eos": _get(body, "ignore_eos", bool, False)}
    seed = _get(body, "seed", int)
    if seed is not None:
        params["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ApiError(400, "'stop' must be a string or a list of strings", param="stop",
                           code="bad_field")
        params["stop"] = [s for s in stops if s]
    return params


def _stream_opts(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict, {})
    return stream, bool(stream and _get(opts, "include_usage", bool, False))


def completion_request(body: dict, tok: TextTokenizer | None, default_max: int = 16) -> Prepared:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if tok is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        ids = tok.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        if not all(_wire_int(t) for t in ids):
            raise ApiError(400, "a prompt token id is beyond any vocabulary", param="prompt",
                           code="token_out_of_range")
    else:
        raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt)", param="prompt",
                       code="bad_field")
    params = _sampling(body, default_max)
    logprobs = _get(body, "logprobs", int)
    if logprobs is not None:
        params["logprobs"], params["top_logprobs"] = True, logprobs
    stream, usage = _stream_opts(body)
    return Prepared(_get(body, "model", str, ""), ids, params, stream, usage, logprobs)


def _message_text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param="messages", code="bad_field")


def chat_request(body: dict, tok: TextTokenizer | None, template: ChatTemplate | None,
                 default_max: int) -> Prepared:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages", code="bad_field")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param="messages",
                           code="bad_field")
        clean.append({**m, "content": _message_text(m.get("content"), i)})
    if template is None or tok is None:
        raise ApiError(400, "this model has no chat template (tokenizer_config.json)",
                       code="no_chat_template")
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    try:
        text = template.render(clean, _get(body, "add_generation_prompt", bool, True), **kwargs)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages", code="bad_field") from None
    ids = tok.encode(text)
    params = _sampling(body, default_max)
    eos = tok.token_id(template.eos_token) if template.eos_token else None
    if eos is not None and not params["ignore_eos"]:
        params["stop_token_ids"] = [eos]
    logprobs = None
    if _get(body, "logprobs", bool, False):
        logprobs = _get(body, "top_logprobs", int, 0)
        params["logprobs"], params["top_logprobs"] = True, logprobs
    stream, usage = _stream_opts(body)
    return Prepared(_get(body, "model", str, ""), ids, params, stream, usage, logprobs)


# --------------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(done: dict) -> dict:
    u = done["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def _token_entry(tok: TextTokenizer, token: int, lp: float) -> dict:
    return {"token": tok.token_text(token), "logprob": lp, "bytes": list(tok.token_bytes(token))}


def chat_logprobs(tok: TextTokenizer, ids: list[int], lps: list[float], tops: list | None) -> dict:
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        entry = _token_entry(tok, t, lp)
        entry["top_logprobs"] = [_token_entry(tok, a, b) for a, b in (tops[i] if tops else [])]
        content.append(entry)
    return {"content": content}


def completion_logprobs(tok: TextTokenizer, ids: list[int], lps: list[float], tops: list | None,
                        offset: int = 0) -> dict:
    tokens = [tok.token_text(t) for t in ids]
    offsets, pos = [], offset
    for t in ids:
        offsets.append(pos)
        pos += len(tok.decode([t]))
    top = [{tok.token_text(a): b for a, b in step} for step in tops] if tops else [None] * len(ids)
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}
