"""The gateway's state, shared by every HTTP handler, and the record it is built from."""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from fusedserve.coordinator.client import MAX_CLIENT_CHARS, AsyncClient
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.openai import protocol as oa
from fusedserve.coordinator.openai.chat_template import ChatTemplate
from fusedserve.coordinator.openai.metrics import Metrics

if TYPE_CHECKING:
    from fusedserve.coordinator.server.server import Server

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    """What the gateway is built with: the coordinator it talks to, the model it serves under
    which name and limits, and how it reads chat (``for_server`` fills the first part from a
    running coordinator)."""

    coordinator: str  # the coordinator's ZeroMQ address
    model_dir: str  # chat template, tokenizer files, generation_config.json
    model_name: str  # what requests name in ``model`` and /v1/models lists
    max_model_len: int
    max_tokens: int  # a request's max_tokens at most (the coordinator's limit)
    token: str | None = None  # bearer token of /v1/* (the coordinator's ZeroMQ auth token)
    reasoning_parser: str = "auto"  # auto | qwen3 | none
    tool_call_parser: str = "auto"  # auto | hermes | none
    max_prompt_chars: int = oa.MAX_PROMPT_CHARS
    curve_server_key: str | None = None  # the coordinator's public key, where its socket is encrypted
    chat_template: str | None = None  # a file or inline template replacing the model's
    trust_request_template: bool = False  # a request's own chat_template runs
    # Sampling defaults a request's own fields override (``generation_defaults.py``).
    defaults: dict = field(default_factory=dict)

    @classmethod
    def for_server(cls, server: Server, model_name: str, **settings: object) -> GatewayConfig:
        """For a coordinator running in this process: its loopback address, model and limits."""
        local = server.address.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
        return cls(local, str(server.model_dir), model_name, server.max_model_len,
                   server.admission.max_tokens, curve_server_key=server.curve_public_key, **settings)


class Gateway:
    """What the HTTP handlers share: the coordinator client, tokenizer, template, metrics."""

    def __init__(self, config: GatewayConfig, tokenizer: TextTokenizer | None):
        self.config = config
        self.coordinator = config.coordinator
        self.tokenizer = tokenizer  # the server's: loaded once per process
        self.template = ChatTemplate.from_dir(config.model_dir, config.chat_template)
        self.trust_request_template = config.trust_request_template
        self.defaults = config.defaults
        self.model_name = config.model_name
        self.max_model_len = config.max_model_len
        self.max_tokens = config.max_tokens
        self.max_prompt_chars = config.max_prompt_chars
        self.curve_server_key = config.curve_server_key
        self.token = config.token
        self.metrics = Metrics(config.model_name)
        self.client: AsyncClient | None = None
        # Qwen3's <think> split and Hermes tool calls: on where the chat template speaks them.
        source = self.template.source if self.template is not None else ""
        auto_reasoning, auto_tools = "<think>" in source, "<tool_call>" in source
        reasoning, tools = config.reasoning_parser, config.tool_call_parser
        self.reasoning = reasoning == "qwen3" or (reasoning == "auto" and auto_reasoning)
        self.tool_parser = tools == "hermes" or (tools == "auto" and auto_tools)

    def check_auth(self, request: Request) -> None:
        if self.token is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self.token.encode()):
            raise oa.ApiError(401, "missing or wrong bearer token (Authorization: Bearer ...)",
                              code="unauthorized")

    def admit(self, prepared: oa.Prepared, request: Request) -> oa.Prepared:
        """The request for this server's model, named for its end client (whom the coordinator's
        per-client limits count it for)."""
        if prepared.model and prepared.model != self.model_name:
            raise oa.ApiError(404, f"model {prepared.model!r} does not exist; this server has "
                              f"{self.model_name!r}", param="model", code="model_not_found")
        prepared.model = self.model_name
        prepared.params["client"] = end_client(request)
        session = request.headers.get("x-session-id") or prepared.user
        if session is not None:
            if not 0 < len(session) <= MAX_CLIENT_CHARS:
                raise oa.ApiError(400, f"a session id (X-Session-Id, or user) has 1-{MAX_CLIENT_CHARS} "
                                  "characters", param="user", code="bad_field")
            prepared.params["session_id"] = session
        if prepared.user is not None:
            log.info("request for user %r from %s", prepared.user, prepared.params["client"])
        return prepared


def end_client(request: Request) -> str:
    """Who a request counts for: its API key (a hash: never the key) and its address. A client can
    open many connections, but not be many addresses; one that fills its share of the server's
    capacity gets 429s while the others are served."""
    auth = request.headers.get("authorization", "")
    key = hashlib.sha256(auth.encode()).hexdigest()[:12] if auth else "-"
    host = request.client.host if request.client is not None else "unknown"
    return f"{key}@{host}"
