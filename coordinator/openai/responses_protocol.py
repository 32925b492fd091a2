"""The Responses API (``/v1/responses``) as chat: a request becomes a chat-completion body (so it
runs through the same template, tool choice, reasoning and tool-call parsers and structured
outputs), and a chat message becomes the response's output items.

Pure functions of dicts: no tokenizer and no coordinator. Input items are OpenAI's: messages
(``role`` with text or ``input_text``/``output_text`` parts), ``function_call`` and
``function_call_output``; ``reasoning`` items are dropped (Qwen3's template drops past thinking).
"""

from __future__ import annotations

import time
import uuid

from fusedserve.coordinator.openai.api_error import ApiError

# The Responses API's own fields, mapped here; every other field (sampling settings, model, user, ...)
# goes to the chat body as it is, where the chat endpoint checks it.
OWN_FIELDS = frozenset({"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
                        "stream", "store", "previous_response_id", "metadata", "reasoning", "background",
                        "include", "truncation", "service_tier", "prompt_cache_key", "safety_identifier"})
ROLES = ("user", "assistant", "system", "developer")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(message: str, param: str, code: str = "bad_field") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _text(content: object, where: str) -> str:
    """A message's content: a string, or its text parts joined (images and files are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _bad(f"{where}.content[{j}] is {kind}: this server serves text models", "input",
                       "unsupported")
        else:
            raise _bad(f"{where}.content[{j}] must be an input_text or output_text part", "input")
    return "".join(parts)


def input_messages(value: object) -> tuple[list[dict], list[dict]]:
    """(chat messages, the input as items) of a request's ``input``."""
    if isinstance(value, str):
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}
        return [{"role": "user", "content": value}], [item]
    if not isinstance(value, list) or not value:
        raise _bad("'input' must be a string or a non-empty list of items", "input")
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{where}.role must be one of {', '.join(ROLES)}", "input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if not all(isinstance(v, str) for v in (call["id"], call["function"]["name"],
                                                    call["function"]["arguments"])):
                raise _bad(f"{where}: a function_call has string call_id, name and arguments", "input")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise _bad(f"{where}: a function_call_output has string call_id and output", "input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise _bad(f"{where}.type {kind!r} is not served (message, function_call, function_call_output, "
                       "reasoning)", "input", "unsupported")
    return messages, [dict(item) for item in value]


def _tools(value: object) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("'tools' must be a list", "tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"tools[{i}]: only function tools (type function, with a name) are served, got "
                       f"{kind!r}", "tools", "unsupported")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(value: object) -> object:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise _bad("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
               "tool_choice")


def _format(text: object) -> dict | None:
    """``text.format`` as chat's ``response_format`` (structured outputs)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise _bad("'text.format.type' must be text, json_object or json_schema", "text")


def chat_body(body: dict, history: list[dict]) -> tuple[dict, list[dict], list[dict]]:
    """(the chat-completion body, the conversation so far without instructions: ``history`` and
    this input, this input as items). ``instructions`` lead as a system message, this request's
    only: a continued response does not inherit them (OpenAI's rule)."""
    if body.get("background"):
        raise _bad("background responses are not served: send the request and wait", "background",
                   "unsupported")
    messages, items = input_messages(body.get("input"))
    conversation = [*history, *messages]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions")
    lead = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict = {"messages": lead + conversation, "stream": bool(body.get("stream", False))}
    chat.update({k: v for k, v in body.items() if k not in OWN_FIELDS and v is not None})
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    return chat, conversation, items


def output_items(message: dict) -> list[dict]:
    """A chat message as output items: reasoning, then the text, then each function call."""
    items: list[dict] = []
    thought = message.get("reasoning_content")
    if thought:
        items.append(reasoning_item(thought))
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    done = status == "completed"
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": content}


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
              status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def assistant_messages(items: list[dict]) -> list[dict]:
    """The output as the chat messages a continued conversation replays (thinking dropped)."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def response_object(response_id: str, body: dict, model: str, output: list[dict], status: str,
                    chat_usage: dict | None, created: int | None = None,
                    finish_reason: str | None = None) -> dict:
    """The response as OpenAI returns it (the request's settings echoed)."""
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    return {
        "id": response_id, "object": "response", "created_at": created or int(time.time()),
        "status": "incomplete" if incomplete and status == "completed" else status,
        "incomplete_details": incomplete, "error": None, "model": model, "output": output,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
        "text": {"format": fmt or {"type": "text"}}, "reasoning": body.get("reasoning"),
        "metadata": body.get("metadata") or {}, "store": body.get("store", True), "truncation": "disabled",
        "user": body.get("user"), "usage": usage(chat_usage),
    }
