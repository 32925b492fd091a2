"""The gateway's state, shared by every HTTP handler, and the record it is built from."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from fastapi import Request

from fusedserve.coordinator.client import MAX_CLIENT_CHARS, AsyncClient, ServerError
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.openai import protocol as oa
from fusedserve.coordinator.openai.chat_template import ChatTemplate
from fusedserve.coordinator.openai.generation_defaults import generation_defaults
from fusedserve.coordinator.openai.http_config import HttpConfig
from fusedserve.coordinator.openai.metrics import Metrics

if TYPE_CHECKING:
    from fusedserve.coordinator.server.server import Server

log = logging.getLogger(__name__)
HEALTH_STALE_S = 2.0  # /health answers from the watcher's last reply while it is younger than this
# --enable-log-requests: one INFO line per request, whatever FUSEDSERVE_LOG says of the rest.
REQUEST_LOG = logging.getLogger("fusedserve.requests")


@dataclass(frozen=True)
class GatewayConfig:
    """What the gateway is built with: the coordinator it talks to, the model it serves under which
    names and limits, and the HTTP API's settings (``for_server`` fills the first part from a
    running coordinator)."""

    coordinator: str  # the coordinator's ZeroMQ address
    model_dir: str  # chat template, tokenizer files, generation_config.json
    model_names: tuple[str, ...]  # what requests may name in ``model``: the first names responses
    max_model_len: int
    max_tokens: int  # a request's max_tokens at most (the coordinator's limit)
    token: str | None = None  # the coordinator's ZeroMQ auth token (and the bearer token without an API key)
    max_prompt_chars: int = oa.MAX_PROMPT_CHARS
    curve_server_key: str | None = None  # the coordinator's public key, where its socket is encrypted
    http: HttpConfig = field(default_factory=HttpConfig)
    # Sampling defaults a request's own fields override (``generation_defaults.py``).
    defaults: dict = field(default_factory=dict)
    # A pooling model's task (embed, score) and floats per pooled row; None: the model generates.
    pooling_task: str | None = None
    pooled_width: int = 0
    # The coordinator's caps (--max-queued-requests, --max-requests-per-client): the gateway refuses
    # what would pass them at once, before tokenizing, instead of after a round trip.
    max_inflight: int = 4096
    max_requests_per_client: int = 256
    # LoRA: a ``model`` other than the base's names an adapter (the coordinator knows which exist);
    # the coordinator's admin token, which /v1/load_lora_adapter and /v1/unload_lora_adapter need.
    lora: bool = False
    admin_token: str | None = None

    @classmethod
    def for_server(cls, server: Server, http: HttpConfig | None = None, **settings: object) -> GatewayConfig:
        """For a coordinator running in this process: its loopback address, model, token and limits
        (``settings``: ``HttpConfig`` or this class's fields to set)."""
        own = {f.name for f in fields(cls)}
        http = dataclasses.replace(http or HttpConfig(),
                                   **{k: v for k, v in settings.items() if k not in own})
        settings = {k: v for k, v in settings.items() if k in own}
        local = server.address.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
        given = server.server_config.engine.model.model
        settings.setdefault("defaults", generation_defaults(server.model_dir, http.generation_config))
        settings.setdefault("max_prompt_chars", server.server_config.limits.max_prompt_chars)
        settings.setdefault("token", server.server_config.auth_token)
        settings.setdefault("max_inflight", server.server_config.limits.max_queued_requests)
        settings.setdefault("max_requests_per_client", server.server_config.limits.max_requests_per_client)
        settings.setdefault("lora", server.engine_config.lora.enable_lora)
        settings.setdefault("admin_token", server.server_config.admin_token)
        engine = server.engine_config
        if engine.pooling:
            settings.setdefault("pooling_task", engine.model.pooling_task)
            settings.setdefault("pooled_width", engine.model.pooled_width)
        return cls(local, str(server.model_dir), http.served_model_name or (given,), server.max_model_len,
                   server.admission.max_tokens, curve_server_key=server.curve_public_key, http=http,
                   **settings)


class Gateway:
    """What the HTTP handlers share: the coordinator client, tokenizer, template, metrics."""

    def __init__(self, config: GatewayConfig, tokenizer: TextTokenizer | None):
        self.config = config
        http = config.http
        self.coordinator = config.coordinator
        self.tokenizer = tokenizer  # the server's: loaded once per process
        self.template = ChatTemplate.from_dir(config.model_dir, http.chat_template)
        self.trust_request_template = http.trust_request_chat_template
        self.defaults = config.defaults
        self.model_name = config.model_names[0]
        self.model_names = config.model_names
        self.max_model_len = config.max_model_len
        self.max_tokens = config.max_tokens
        self.max_prompt_chars = config.max_prompt_chars
        self.curve_server_key = config.curve_server_key
        self.bearer = http.api_key or config.token  # what every /v1 request must carry, if any
        self.metrics = Metrics(self.model_name, config.max_model_len)
        self.client: AsyncClient | None = None
        self.health: tuple[float, dict] | None = None  # (monotonic time, the coordinator's health reply)
        # Qwen3's <think> split and its tool calls: on where the chat template speaks them, in the
        # format it renders (Qwen3-Coder's and Qwen3.5's templates write <function=...> XML).
        source = self.template.source if self.template is not None else ""
        reasoning = http.reasoning_parser
        self.reasoning = reasoning in ("qwen3", "deepseek_r1") or (
            reasoning == "auto" and "<think>" in source)
        self.tool_format = call_format(http.tool_call_parser, source)
        self.tool_parser = self.tool_format is not None
        self.auto_tools = http.enable_auto_tool_choice and self.tool_parser
        self.token_ids_as_tokens = http.return_tokens_as_token_ids
        self.log_requests = http.enable_log_requests
        if self.log_requests:
            REQUEST_LOG.setLevel(logging.INFO)

    def shed(self, request: Request, n: int = 1) -> None:
        """A 429 at once where ``n`` more requests would pass the server's or this client's cap on
        requests in flight (the coordinator would refuse them too, but only after the request was
        read, rendered, tokenized and had waited its turn on the coordinator's loop)."""
        c = self.client
        if c is None:
            return
        if c.in_flight + n > self.config.max_inflight:
            reason, why = "server_busy", f"{c.in_flight} requests in flight; retry later"
        elif c.per_client[end_client(request)] + n > self.config.max_requests_per_client:
            reason = "too_many_requests"
            why = (f"this client has {self.config.max_requests_per_client} requests in flight "
                   "(max_requests_per_client); wait for one to finish")
        else:
            return
        self.metrics.shed.labels(self.model_name, reason).inc()
        raise oa.ApiError(429, why, code=reason)

    async def watch_health(self, every_s: float = 0.25) -> None:
        """Keep the coordinator's health fresh, so that ``/health`` answers from here at once however
        busy the coordinator's loop is (a stale answer, over ``HEALTH_STALE_S``, reads as down)."""
        while True:
            try:
                self.health = (time.monotonic(), await asyncio.wait_for(self.client.health(), 5))
            except (TimeoutError, ServerError):
                pass
            await asyncio.sleep(every_s)

    def need_task(self, task: str | None, endpoint: str) -> None:
        """A 400 where the model does not serve ``endpoint`` (``task``: embed, score, or None for
        generation)."""
        have = self.config.pooling_task
        if have == task:
            return
        what = f"a pooling model ({have})" if have else "a generating model"
        wants = {None: "a generating model", "embed": "an embedding model (--pooling-task embed)",
                 "score": "a scoring model"}[task]
        raise oa.ApiError(400, f"{endpoint} needs {wants}; this server runs {what}", code="wrong_task")

    @property
    def token(self) -> str | None:
        """The coordinator's ZeroMQ auth token (the gateway's own client carries it)."""
        return self.config.token

    def check_auth(self, request: Request) -> None:
        if self.bearer is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        right = hmac.compare_digest(value.strip().encode(), self.bearer.encode())
        if scheme.lower() != "bearer" or not right:
            raise oa.ApiError(401, "missing or wrong bearer token (Authorization: Bearer ...)",
                              code="unauthorized")

    def admit(self, prepared: oa.Prepared, request: Request) -> oa.Prepared:
        """The request for this server's model, named for its end client (whom the coordinator's
        per-client limits count it for)."""
        if prepared.model and prepared.model not in self.model_names and self.config.lora:
            prepared.params["lora"] = prepared.model  # an adapter: the coordinator 404s an unknown one
        elif prepared.model and prepared.model not in self.model_names:
            raise oa.ApiError(404, f"model {prepared.model!r} does not exist; this server has "
                              f"{', '.join(map(repr, self.model_names))}", param="model",
                              code="model_not_found")
        else:
            prepared.model = self.model_name
        prepared.params["client"] = end_client(request)
        self.metrics.admitted(prepared.n, prepared.params["max_tokens"])
        session = request.headers.get("x-session-id") or prepared.user
        if session is not None:
            if not 0 < len(session) <= MAX_CLIENT_CHARS:
                raise oa.ApiError(400, f"a session id (X-Session-Id, or user) has 1-{MAX_CLIENT_CHARS} "
                                  "characters", param="user", code="bad_field")
            prepared.params["session_id"] = session
        if prepared.user is not None:
            log.info("request for user %r from %s", prepared.user, prepared.params["client"])
        if self.log_requests:
            REQUEST_LOG.info("request %s from %s: %d prompt tokens, %s", prepared.request_id or "-",
                             prepared.params["client"], len(prepared.prompt_ids),
                             {k: v for k, v in prepared.params.items() if k not in ("client", "structured")})
        return prepared


def call_format(parser: str, template: str) -> str | None:
    """How the model's tool calls are read: ``hermes`` (JSON), ``qwen3_coder`` (Qwen's XML), or
    None (not parsed); ``auto`` reads the chat template."""
    if parser in ("qwen3_coder", "qwen3_xml"):
        return "qwen3_coder"
    if parser == "hermes":
        return "hermes"
    if parser == "auto" and "<function=" in template:
        return "qwen3_coder"
    if parser == "auto" and "<tool_call>" in template:
        return "hermes"
    return None


def end_client(request: Request) -> str:
    """Who a request counts for: its API key (a hash: never the key) and its address. A client can
    open many connections, but not be many addresses; one that fills its share of the server's
    capacity gets 429s while the others are served."""
    auth = request.headers.get("authorization", "")
    key = hashlib.sha256(auth.encode()).hexdigest()[:12] if auth else "-"
    host = request.client.host if request.client is not None else "unknown"
    return f"{key}@{host}"
