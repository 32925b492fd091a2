"""OpenAI request bodies -> the coordinator's ``generate`` fields; its replies -> OpenAI responses.

Types are checked here, with the offending field named; ranges are the coordinator's
(``SamplingParams``), so the HTTP and ZeroMQ fronts refuse the same values. Unknown
fields are ignored. Every error is an ``ApiError`` in OpenAI's shape with its status.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.openai import output_constraint, response_options, tool_choice
from fusedserve.coordinator.openai.api_error import ApiError
from fusedserve.coordinator.openai.chat_template import ChatTemplate, ChatTemplateError
from fusedserve.coordinator.openai.request_fields import get as _get
from fusedserve.coordinator.openai.request_fields import wire_int as _wire_int
from fusedserve.coordinator.openai.tool_choice import ToolPlan
from fusedserve.coordinator.sampling_params import OPENAI, SamplingError, SamplingParams, check_stops, is_kind
from fusedserve.coordinator.structured.structured_spec import StructuredError, StructuredSpec

MAX_BODY_BYTES = 4 << 20  # the ZeroMQ front end's frame limit
MAX_PROMPT_CHARS = 1 << 19  # text a request may ask to tokenize (the server's --max-prompt-chars)
MAX_JSON_DEPTH = 64  # nesting of a request body: more is refused before anything reads it
# chat_template_kwargs that would replace what the server renders with.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt"})
MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # choices per request: prompts x n


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
    except RecursionError:
        raise ApiError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep",
                       code="bad_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="bad_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="bad_json")
    _check_tree(body)
    return body


def _check_tree(body: dict) -> None:
    """Every value within ``MAX_JSON_DEPTH`` levels, and every string (key or value) text a tokenizer
    and a ZeroMQ frame can carry (JSON's \ud800 escapes make lone surrogates, which UTF-8 cannot
    encode). One pass, no recursion."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep",
                           code="bad_json")
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k)
                stack.append((v, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str):
            _check_text(value)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"a string in the request is not valid Unicode text: {exc.reason} at character "
                       f"{exc.start}", code="bad_text") from None


@dataclass
class Prepared:
    """One OpenAI request, ready for the coordinator."""

    model: str
    prompt_ids: list[int]  # the (first) prompt
    params: dict  # the generate frame's sampling fields
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # None: not asked; else how many top alternatives per token
    created: int = field(default_factory=lambda: int(time.time()))
    n: int = 1  # choices: n requests of one prompt (its blocks shared), seeds seed, seed + 1, ...
    echo: bool = False  # completions: the prompt (and its logprobs) before the output
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (one token drawn, dropped)
    prompt_text: str = ""  # echo: the prompt as text
    # Completions may send several prompts: choice i is prompt i // n's choice i % n.
    more_prompts: list[tuple[list[int], str]] = field(default_factory=list)

    @property
    def choices(self) -> int:
        return self.n * (1 + len(self.more_prompts))

    def prompt(self, i: int) -> tuple[list[int], str]:
        """Choice ``i``'s prompt: its ids and (echo) its text."""
        k = i // self.n
        return (self.prompt_ids, self.prompt_text) if k == 0 else self.more_prompts[k - 1]
    request_id: str | None = None  # vLLM's request_id: the response's id
    user: str | None = None  # OpenAI's end-user id: logged, and the session routing keeps together
    reasoning: bool = False  # chat: split <think> blocks into reasoning_content
    thinking_opened: bool = False  # the prompt opened a think block: the output starts in it
    tools: ToolPlan = field(default_factory=lambda: ToolPlan("none"))
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many top ones
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    token_ids_as_tokens: bool | None = None  # return_tokens_as_token_ids (None: the server's default)

    def choice_params(self, i: int) -> dict:
        """Choice ``i``'s generate fields: its own seed stream when a seed is given (prompt k's
        choices draw from seed, seed + 1, ..., as if each prompt came alone)."""
        j = i % self.n
        if j == 0 or "seed" not in self.params:
            return self.params
        return {**self.params, "seed": (self.params["seed"] + j) % (1 << 64)}


def _choices(body: dict) -> int:
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", param="n", code="bad_field")
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise ApiError(400, "best_of is not supported (it would rank choices by logprob on the server); "
                       "ask for n choices and pick on the client", param="best_of", code="unsupported")
    return n


def _constrain(params: dict, body: dict, thinking: str = "none",
               forced: tuple[str, Any] | None = None) -> None:
    found = output_constraint.constraint(body)
    if forced is not None and found is not None:
        raise ApiError(400, "a required or named tool_choice already constrains the output; drop "
                       "response_format / structured_outputs", param="tool_choice", code="bad_field")
    found = forced or found
    if found is not None:
        try:
            params["structured"] = StructuredSpec(found[0], found[1], thinking).to_wire()
        except StructuredError as exc:
            raise ApiError(400, str(exc), code="bad_structured_output") from None


# Documented request fields (OpenAI's, and vLLM's extra ones) this server does not do, with the
# values that ask nothing of it: anything else is refused (400 "unsupported"), never ignored.
UNSUPPORTED: dict[str, tuple] = {
    "suffix": (None, ""), "audio": (None,), "prediction": (None,), "web_search_options": (None,),
    "functions": (None,), "function_call": (None,), "reasoning_effort": (None,), "documents": (None,),
    "logits_processors": (None,), "cache_salt": (None,), "kv_transfer_params": (None,),
    "vllm_xargs": (None,), "mm_processor_kwargs": (None,),
    "modalities": (None, ["text"]), "parallel_tool_calls": (None, True), "store": (None, False),
    "metadata": (None, {}), "service_tier": (None, "auto", "default"), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "continue_final_message": (None, False),
    "add_special_tokens": (None, False), "priority": (None, 0),
}
# vLLM's extra sampling fields, passed to the coordinator as they are (SamplingParams declares them).
PASSED = SamplingParams.front_end_fields(OPENAI)


def refuse_unsupported(body: dict, also: dict[str, tuple] | None = None) -> None:
    for key, fine in {**UNSUPPORTED, **(also or {})}.items():
        if key in body and body[key] not in fine:
            raise ApiError(400, f"'{key}' is not supported by this server", param=key, code="unsupported")


def _sampling(body: dict, default_max: int, defaults: dict | None = None) -> dict:
    """The generate frame's sampling fields: the request's, else ``defaults`` (generation_config),
    else OpenAI's."""
    refuse_unsupported(body)
    body = {**(defaults or {}), **{k: v for k, v in body.items() if v is not None}}
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
        if SamplingParams.specs()["stop"].wrong_kind(stops):
            raise ApiError(400, "'stop' must be a string or a list of strings", param="stop",
                           code="bad_field")
        try:
            check_stops(stops)
        except SamplingError as exc:
            raise ApiError(400, str(exc), param="stop", code="bad_param") from None
        params["stop"] = [s for s in stops if s]
    for key, field_spec in PASSED.items():
        value = _get(body, key, field_spec.kind)
        if value is not None:
            wrong = field_spec.wrong_kind(value)
            if wrong is not None:
                raise ApiError(400, f"'{key}' {wrong}", param=key, code="bad_field")
            params[key] = value
    return params


def _truncate(ids: list[int], body: dict) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the prompt's last k tokens."""
    k = _get(body, "truncate_prompt_tokens", int)
    if k is None:
        return ids
    if k < 1:
        raise ApiError(400, "truncate_prompt_tokens must be >= 1", param="truncate_prompt_tokens",
                       code="bad_field")
    return ids[-k:]


def _identity(body: dict) -> dict:
    return {"request_id": _get(body, "request_id", str), "user": _get(body, "user", str)}


def _prompt_ids(prompt: Any, tok: TextTokenizer | None) -> list[int]:
    if isinstance(prompt, str):
        if tok is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return tok.encode(prompt)
    if isinstance(prompt, list) and all(is_kind(t, int) for t in prompt):
        if not all(_wire_int(t) for t in prompt):
            raise ApiError(400, "a prompt token id is beyond any vocabulary", param="prompt",
                           code="token_out_of_range")
        return list(prompt)
    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of either", param="prompt",
                   code="bad_field")


def _check_chars(n: int, limit: int) -> None:
    if n > limit:
        raise ApiError(413, f"the prompt has {n} characters; the limit is {limit} (--max-prompt-chars)",
                       param="prompt", code="prompt_too_long")


def completion_request(body: dict, tok: TextTokenizer | None, default_max: int = 16,
                       max_prompt_chars: int = MAX_PROMPT_CHARS, defaults: dict | None = None) -> Prepared:
    prompt = body.get("prompt")
    batch = [prompt] if isinstance(prompt, str) or (
        isinstance(prompt, list) and all(is_kind(t, int) for t in prompt)
        and prompt) else prompt
    if not isinstance(batch, list) or not batch:
        raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of either",
                       param="prompt", code="bad_field")
    _check_chars(sum(len(p) for p in batch if isinstance(p, str)), max_prompt_chars)  # before tokenizing
    ids = [_truncate(_prompt_ids(p, tok), body) for p in batch]
    n, echo = _choices(body), _get(body, "echo", bool, False)
    if n * len(ids) > MAX_CHOICES:
        raise ApiError(400, f"{len(ids)} prompts x n={n} exceeds {MAX_CHOICES} choices", param="prompt",
                       code="bad_field")
    echo_only = echo and body.get("max_tokens") == 0
    params = _sampling({**body, "max_tokens": 1} if echo_only else body, default_max, defaults)
    logprobs = _get(body, "logprobs", int)
    if logprobs is not None:
        params["logprobs"], params["top_logprobs"] = True, logprobs
        if echo:  # the prompt's own logprobs: what lm-eval's loglikelihood reads
            params["prompt_logprobs"] = logprobs
    _constrain(params, body)
    stream, usage = response_options.stream_options(body)
    texts = [p if isinstance(p, str) else (tok.decode(i) if tok is not None and echo else "")
             for p, i in zip(batch, ids)]
    return Prepared(_get(body, "model", str, ""), ids[0], params, stream, usage, logprobs, n=n, echo=echo,
                    echo_only=echo_only, prompt_text=texts[0], more_prompts=list(zip(ids[1:], texts[1:])),
                    **_identity(body), **response_options.vllm_extras(body, params, stream, usage))


# OpenAI's and vLLM's non-text content parts: refused with the reason, not as a malformed message.
MEDIA_PARTS = ("image_url", "input_image", "image", "video_url", "video", "input_audio", "audio_url")


def _message_text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    media = [p.get("type") for p in content if isinstance(p, dict)] if isinstance(content, list) else []
    if any(t in MEDIA_PARTS for t in media):
        kind = next(t for t in media if t in MEDIA_PARTS)
        raise ApiError(400, f"messages[{i}].content has a {kind!r} part: this server runs the model as a "
                       "text model (a Qwen3.5 checkpoint's vision tower is not loaded); send text parts only",
                       param="messages", code="unsupported_modality")
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param="messages", code="bad_field")


def _message(m: Any, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param="messages",
                       code="bad_field")
    out = {**m, "content": _message_text(m.get("content"), i)}
    if "reasoning_content" not in out and isinstance(m.get("reasoning"), str):
        out["reasoning_content"] = m["reasoning"]  # vLLM's newer name for it
    calls = m.get("tool_calls")
    if calls is not None and (not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str) for c in calls)):
        raise ApiError(400, f"messages[{i}].tool_calls must be a list of {{'function': {{'name', "
                       "'arguments'}}}", param="messages", code="bad_field")
    return out


def thinking_state(prompt: str, reasoning: bool) -> str:
    """Where the output starts relative to a think block: "open" (the prompt opened one),
    "none" (no reasoning, or the prompt already closed this turn's block: enable_thinking=false)
    or "may" (the model may open one)."""
    turn = prompt.rfind("<|im_start|>")
    opened, closed = prompt.rfind("<think>"), prompt.rfind("</think>")
    if opened > closed and opened > turn:
        return "open"
    if not reasoning or closed > turn:
        return "none"
    return "may"


def chat_request(body: dict, tok: TextTokenizer | None, template: ChatTemplate | None,
                 default_max: int, reasoning: bool = False, tool_parser: bool = False,
                 max_prompt_chars: int = MAX_PROMPT_CHARS, trust_request_template: bool = False,
                 defaults: dict | None = None, auto_tools: bool = True,
                 tool_format: str = "hermes") -> Prepared:
    """``auto_tools``: the model may choose to call a tool (``--enable-auto-tool-choice``);
    ``tool_format``: how the model writes calls (hermes JSON, qwen3_coder XML)."""
    refuse_unsupported(body, {"echo": (None, False)})
    own = _get(body, "chat_template", str)
    if own is not None:
        if not trust_request_template:
            raise ApiError(400, "a request's own chat_template runs only on a server started with "
                           "--trust-request-chat-template", param="chat_template", code="unsupported")
        try:
            template = (template or ChatTemplate(own, {})).replaced(own)
        except Exception as exc:  # noqa: BLE001 - Jinja's syntax errors have many types
            raise ApiError(400, f"chat_template does not parse: {exc}", param="chat_template",
                           code="bad_field") from None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages", code="bad_field")
    clean = [_message(m, i) for i, m in enumerate(messages)]
    _check_chars(sum(len(m["content"]) for m in clean), max_prompt_chars)
    if template is None or tok is None:
        raise ApiError(400, "this model has no chat template (tokenizer_config.json)",
                       code="no_chat_template")
    markers = tok.token_id("<tool_call>") is not None
    tools = tool_choice.plan(body, tool_parser, markers, auto_tools, tool_format)
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {reserved}: the server renders those",
                       param="chat_template_kwargs", code="bad_field")
    if tools.tools:
        kwargs = {**kwargs, "tools": tools.tools}
    try:
        text = template.render(clean, _get(body, "add_generation_prompt", bool, True), **kwargs)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages", code="bad_field") from None
    _check_chars(len(text), max_prompt_chars)  # the rendered turn (tools and all), before tokenizing
    ids = _truncate(tok.encode(text), body)
    n = _choices(body)
    params = _sampling(body, default_max, defaults)
    thinking = thinking_state(text, reasoning)
    _constrain(params, body, thinking, ("grammar", tools.grammar) if tools.forced else None)
    eos = tok.token_id(template.eos_token) if template.eos_token else None
    if eos is not None and not params["ignore_eos"]:
        params["stop_token_ids"] = [*params.get("stop_token_ids", []), eos]
    logprobs = None
    if _get(body, "logprobs", bool, False):
        logprobs = _get(body, "top_logprobs", int, 0)
        params["logprobs"], params["top_logprobs"] = True, logprobs
    stream, usage = response_options.stream_options(body)
    return Prepared(_get(body, "model", str, ""), ids, params, stream, usage, logprobs, n=n,
                    reasoning=reasoning, thinking_opened=thinking == "open", tools=tools, **_identity(body),
                    **response_options.vllm_extras(body, params, stream, usage))
