"""Qwen's XML tool calls (Qwen3-Coder, Qwen3.5), vLLM's ``qwen3_coder`` parser:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Each parameter's text is typed by the tool's JSON schema: a string stays text (one newline
each side dropped, as the template writes them), integers, numbers, booleans, null, objects and
arrays are read as JSON; a parameter the schema does not know is JSON where it parses, else
text. A body that is not such a call stays content (``tool_parser.ToolStream`` keeps it).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fusedserve.coordinator.openai.tool_parser import ToolCall

# JSON values as json.dumps writes them (free whitespace could run on until max_tokens).
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _strip_newlines(text: str) -> str:
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def _typed(text: str, schema: dict | None) -> Any:
    """A parameter's value as its schema types it."""
    kinds = (schema or {}).get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds} if kinds else set()
    if kinds == {"string"}:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        if text.strip().lower() in ("true", "false") and "boolean" in kinds:  # Python's spelling
            return text.strip().lower() == "true"
        return text
    if isinstance(value, str) and kinds and "string" not in kinds:
        return text
    return value


def parse_xml_call(body: str, tools: list[dict]) -> ToolCall | None:
    """One ``<tool_call>`` body in Qwen's XML format, or None when it is not a call."""
    found = FUNCTION.fullmatch(body.strip())
    if found is None:
        return None
    name, inner = found.group(1).strip(), found.group(2)
    if not name:
        return None
    schema = next((t["function"].get("parameters", {}) for t in tools if t["function"]["name"] == name), {})
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    params = PARAMETER.findall(inner)
    if PARAMETER.sub("", inner).strip():  # text outside any parameter: not a call
        return None
    args = {key.strip(): _typed(_strip_newlines(value), props.get(key.strip())) for key, value in params}
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def xml_call_grammar(functions: dict[str, dict], several: bool, marker_tokens: bool) -> str:
    """Lark (llguidance) for XML calls of ``functions``: each function's parameters in its schema's
    order, the required ones always and the others optional; a string parameter's text holds no
    ``<`` (it cannot close its tag early), every other value is JSON matching its schema."""
    start, end = ("<tool_call>", "</tool_call>") if marker_tokens else ('"<tool_call>"', '"</tool_call>"')
    rules, alternatives = [], []
    for k, (name, fn) in enumerate(functions.items()):
        schema = fn.get("parameters") or {}
        required = set(schema.get("required", []))
        parts = []
        for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            sub = sub if isinstance(sub, dict) else {}
            value, rule, tag = f"p{k}_{j}_value", f"p{k}_{j}", json.dumps(f"<parameter={key}>")
            if sub.get("type") == "string" and "enum" in sub:
                rules.append(f"{value}: " + " | ".join(json.dumps(f"\n{v}\n") for v in sub["enum"]))
            elif sub.get("type") == "string" and not {"const", "pattern", "format"} & sub.keys():
                rules.append(f"{value}: /\\n[^<]*\\n/")  # its newlines with it: no split to guess
            else:
                rules.append(f'{value}: "\\n" %json {json.dumps({**sub, "x-guidance": LAYOUT})} "\\n"')
            rules.append(f'{rule}: {tag} {value} "</parameter>" "\\n"')
            parts.append(rule if key in required else f"[{rule}]")
        rules.append(f'f{k}: {json.dumps(f"<function={name}>")} "\\n" {" ".join(parts)} "</function>"')
        alternatives.append(f"f{k}")
    head = 'start: call ("\\n" call)*' if several else "start: call"
    return "\n".join([head, f'call: {start} "\\n" ({" | ".join(alternatives)}) "\\n" {end}', *rules])
