"""A chat request's ``tools`` and ``tool_choice`` -> what the template renders, whether the
output is parsed for calls, and the constraint that forces a call.

- ``none``: the tools are not rendered and nothing is parsed.
- ``auto`` (the default with tools): the template renders them; calls in the output become
  ``tool_calls``: Hermes JSON (``tool_parser``) or Qwen's XML (``xml_tool_parser``), as the
  model writes them.
- ``required``: the output is held (constrained decoding) to one or more Hermes calls of the
  given functions, each ``{"name", "arguments"}`` JSON matching its function's schema; a named
  function: to one call of it. The calls are written in the model's own format (so a Qwen3
  model can end after its last call, as it was trained to) and parsed as in ``auto``. Even a
  model never trained on tools returns a valid call.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fusedserve.coordinator.openai.api_error import ApiError
from fusedserve.coordinator.openai.tool_parser import ToolCall, parse_call
from fusedserve.coordinator.openai.xml_tool_parser import parse_xml_call, xml_call_grammar

# Calls' JSON as json.dumps writes it (free whitespace could run on until max_tokens).
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict] = field(default_factory=list)  # as the template gets them
    name: str | None = None  # named: the function
    grammar: str | None = None  # required / named: the output's grammar (llguidance Lark)
    format: str = "hermes"  # how calls are written: hermes (JSON) | qwen3_coder (Qwen's XML)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def parsed(self) -> bool:
        """The output is parsed for calls."""
        return self.mode != "none"

    def parser(self) -> Callable[[str], ToolCall | None]:
        """What reads one ``<tool_call>`` body of this plan's format."""
        if self.format == "qwen3_coder":
            return functools.partial(parse_xml_call, tools=self.tools)
        return parse_call


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


def _grammar(functions: dict[str, dict], several: bool, marker_tokens: bool) -> str:
    """Lark for Hermes calls of ``functions``; the markers as the model's own tokens where its
    tokenizer has them (``<tool_call>``), else as text."""
    one_of = [{"type": "object", "properties": {"name": {"const": n}, "arguments": f["parameters"]},
               "required": ["name", "arguments"], "additionalProperties": False}
              for n, f in functions.items()]
    schema = {**(one_of[0] if len(one_of) == 1 else {"anyOf": one_of}), "x-guidance": LAYOUT}
    start, end = ("<tool_call>", "</tool_call>") if marker_tokens else ('"<tool_call>"', '"</tool_call>"')
    head = 'start: call ("\\n" call)*' if several else "start: call"
    return f'{head}\ncall: {start} "\\n" body "\\n" {end}\nbody: %json {json.dumps(schema)}'


def plan(body: dict, parser_on: bool, marker_tokens: bool = False, auto_on: bool = True,
         call_format: str = "hermes") -> ToolPlan:
    """The request's tool plan; ``parser_on``: the server parses tool calls for this model;
    ``marker_tokens``: ``<tool_call>`` and ``</tool_call>`` are tokens of its vocabulary;
    ``auto_on``: the model may choose (``--enable-auto-tool-choice``, as vLLM asks for it);
    ``call_format``: how this model writes calls (hermes JSON, or qwen3_coder XML)."""
    grammar = xml_call_grammar if call_format == "qwen3_coder" else _grammar
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
        if not auto_on:
            raise _bad('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                       "set (tools without tool_choice mean auto); or use tool_choice 'required' or a named "
                       "function", "tool_choice")
        return ToolPlan("auto", rendered, format=call_format)
    if choice == "none":
        return ToolPlan("none")
    if choice == "required":
        return ToolPlan("required", rendered, grammar=grammar(by_name, True, marker_tokens),
                        format=call_format)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in by_name:
            raise _bad(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan("named", rendered, name=name,
                        grammar=grammar({name: by_name[name]}, False, marker_tokens), format=call_format)
    raise _bad("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
               "{'name': ...}}", "tool_choice")
