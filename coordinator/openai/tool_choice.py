"""A chat request's ``tools`` and ``tool_choice`` -> what the template renders, whether the
output is parsed for calls, and the constraint that forces a call.

- ``none``: the tools are not rendered and nothing is parsed.
- ``auto`` (the default with tools): the template renders them; Hermes calls in the output
  become ``tool_calls`` (``tool_parser``).
- ``required``: the output is held (constrained decoding) to a JSON list of one or more
  ``{"name", "arguments"}`` calls of the given functions; a named function: to an object
  matching its parameters' schema. Even a model never trained on tools returns a valid call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from coordinator.openai.api_error import ApiError
from coordinator.openai.tool_parser import ToolCall


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict] = field(default_factory=list)  # as the template gets them
    name: str | None = None  # named: the function
    schema: dict | None = None  # required / named: the output's JSON schema

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def calls_from(self, text: str) -> list[ToolCall] | None:
        """The calls a forced output holds (None if it is not valid, e.g. cut by max_tokens)."""
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if self.mode == "named":
            return [ToolCall(self.name, text.strip())] if isinstance(obj, dict) else None
        if not isinstance(obj, list):
            return None
        calls = [ToolCall(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False))
                 for c in obj if isinstance(c, dict) and isinstance(c.get("name"), str)]
        return calls or None


def _bad(message: str, param: str = "tools") -> ApiError:
    return ApiError(400, message, param=param, code="bad_field")


def _function(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _bad(f"tools[{i}].function.name must be a non-empty string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise _bad(f"tools[{i}].function.parameters must be a JSON schema object")
    return {**fn, "parameters": params}


def plan(body: dict, parser_on: bool) -> ToolPlan:
    """The request's tool plan; ``parser_on``: the server parses tool calls for this model."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise _bad("tool_choice needs tools", "tool_choice")
        return ToolPlan("none")
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list")
    fns = [_function(t, i) for i, t in enumerate(tools)]
    if not fns:
        return ToolPlan("none")
    rendered = [{"type": "function", "function": f} for f in fns]
    by_name = {f["name"]: f for f in fns}
    if choice is None or choice == "auto":
        if not parser_on:
            raise _bad("this server does not parse tool calls (--tool-call-parser none); "
                       "use tool_choice 'required' or a named function", "tool_choice")
        return ToolPlan("auto", rendered)
    if choice == "none":
        return ToolPlan("none")
    if choice == "required":
        one_of = [{"type": "object", "properties": {"name": {"const": n}, "arguments": f["parameters"]},
                   "required": ["name", "arguments"], "additionalProperties": False}
                  for n, f in by_name.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        return ToolPlan("required", rendered, schema=schema)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in by_name:
            raise _bad(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan("named", rendered, name=name, schema=by_name[name]["parameters"])
    raise _bad("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
               "{'name': ...}}", "tool_choice")
