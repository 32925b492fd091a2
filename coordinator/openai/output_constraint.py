"""A request's output constraint, from OpenAI's ``response_format`` or vLLM's
``structured_outputs`` (and its older ``guided_*`` fields), on both endpoints. At most one may
be given; the coordinator compiles it (an invalid schema or regex is a 400 from there)."""

from __future__ import annotations

from typing import Any

from fusedserve.coordinator.openai.api_error import ApiError

VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="bad_field")


def _response_format(rf: Any) -> tuple[str, Any] | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", None
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise _bad("response_format json_schema needs {'name': ..., 'schema': {...}}", "response_format")
        return "json", js.get("schema", {})
    raise _bad(f"response_format type {kind!r} is not one of text, json_object, json_schema",
               "response_format")


def constraint(body: dict) -> tuple[str, Any] | None:
    """(kind, value) of the request's constraint, or None."""
    found: list[tuple[str, tuple[str, Any] | None]] = []
    if body.get("response_format") is not None:
        found.append(("response_format", _response_format(body["response_format"])))
    so = body.get("structured_outputs", body.get("guided_decoding"))
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("'structured_outputs' must be an object", "structured_outputs")
        keys = [k for k in VLLM_KINDS if so.get(k) not in (None, False)]
        if len(keys) != 1:
            raise _bad(f"'structured_outputs' needs exactly one of {VLLM_KINDS}", "structured_outputs")
        found.append(("structured_outputs", (keys[0], None if keys[0] == "json_object" else so[keys[0]])))
    for field, kind in GUIDED.items():
        if body.get(field) is not None:
            found.append((field, (kind, body[field])))
    found = [f for f in found if f[1] is not None]
    if len(found) > 1:
        raise _bad(f"give one output constraint, not {[f[0] for f in found]}", found[1][0])
    return found[0][1] if found else None
