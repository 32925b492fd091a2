"""What the OpenAI HTTP API is started with: where it listens, who may call it, under which model
names, and how it reads chat. The ``serve`` flags of these settings are built from this class
(vLLM's spellings)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from fusedserve.shared_memory.setting import parse_size, setting

API_KEY_ENV = "FUSEDSERVE_API_KEY"
# vLLM's parser names: the ones built here, and the others (refused by name, with why).
REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1", "none")
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen3_coder", "qwen3_xml", "none")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def parse_list(value: str) -> tuple[str, ...]:
    """A list flag as vLLM takes it: JSON (``'["https://a.example"]'``), or comma-separated."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError("a JSON list of strings")
        return tuple(items)
    return tuple(i.strip() for i in text.split(",") if i.strip())


@dataclass(frozen=True)
class HttpConfig:
    http: bool = setting(True, "serve the OpenAI-compatible HTTP API (--no-http: ZeroMQ alone)")
    host: str = setting(
        "127.0.0.1",
        "the HTTP API's address; beyond loopback it needs --api-key (or --auth-token-file, whose token is "
        "then the bearer token)")
    port: int = setting(
        8000,
        "the HTTP API's port, as vLLM's --port (0: a free one)",
        aliases=("--http-port",))
    ssl_keyfile: str | None = setting(None, "serve the HTTP API over TLS: the key (PEM)")
    ssl_certfile: str | None = setting(None, "serve the HTTP API over TLS: the certificate (PEM)")
    api_key: str | None = setting(None, f"the HTTP API's bearer token (or ${API_KEY_ENV}); default: the "
                                  "--auth-token-file token, if any")
    served_model_name: tuple[str, ...] = setting(
        (),
        "the model ids of the HTTP API: the first names responses, requests may name any (default: the "
        "model as given)")
    allowed_origins: tuple[str, ...] = setting(
        ("*",),
        "CORS: origins allowed (JSON list or comma-separated)",
        parse=parse_list)
    allowed_methods: tuple[str, ...] = setting(("*",), "CORS: methods allowed", parse=parse_list)
    allowed_headers: tuple[str, ...] = setting(("*",), "CORS: headers allowed", parse=parse_list)
    allow_credentials: bool = setting(False, "CORS: allow credentials")
    uvicorn_log_level: str = setting(
        "warning",
        "uvicorn's log level (info: one access line per request)",
        choices=LOG_LEVELS)
    enable_log_requests: bool = setting(
        False,
        "log each request's id, client and sampling settings (INFO)",
        negations=("--disable-log-requests",))
    generation_config: str = setting(
        "auto",
        "default sampling values: auto (the model's generation_config.json), none or vllm (OpenAI's), or a "
        "directory holding one",
        aliases=("--generation-config-dir",))
    reasoning_parser: str = setting(
        "auto",
        "split <think> blocks into reasoning_content: qwen3 or deepseek_r1 (the same split here: the prompt "
        "tells whether the output starts inside a block), none; auto: where the chat template has them",
        choices=REASONING_PARSERS)
    tool_call_parser: str = setting(
        "auto",
        "how tool calls in the output are read: hermes (Qwen3's <tool_call> JSON), qwen3_coder or qwen3_xml "
        "(Qwen3-Coder's and Qwen3.5's <function=...> XML), none; auto: as the chat template renders tools",
        parse=str)
    enable_auto_tool_choice: bool = setting(
        False,
        "let the model choose whether to call a tool (tool_choice auto, the default with tools); without it "
        "such a request gets 400, as in vLLM; required and named tool choices work either way")
    return_tokens_as_token_ids: bool = setting(
        False,
        "logprobs name their tokens as token_id:N (for tokens that are not whole UTF-8); a request's own "
        "return_tokens_as_token_ids overrides it")
    chat_template: str | None = setting(
        None,
        "the chat template (a file, or its text); default: the model directory's chat_template.jinja, else "
        "its tokenizer_config.json's")
    trust_request_chat_template: bool = setting(
        False,
        "let a request's own chat_template render its prompt (Jinja, sandboxed); without it such a request "
        "gets 400")
    responses_store_size: int = setting(
        1000,
        "responses /v1/responses keeps (store true: retrieved by id, continued with previous_response_id), "
        "oldest dropped first; 0 keeps none")
    responses_store_bytes: int = setting(
        64 << 20,
        "the most bytes of JSON those kept responses (and their conversations) take together, oldest dropped "
        "first", parse=parse_size)

    def check(self) -> None:
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser}: vLLM's parser for another model "
                             f"family; fusedserve serves Qwen3 models, whose calls are "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
