"""What a server is started with: the workers' engine, the socket, auth, and request limits."""

from __future__ import annotations

from dataclasses import dataclass, fields

from fusedserve.coordinator.server.routing_policy import RoutingConfig
from fusedserve.coordinator.structured.grammar_compiler import GrammarLimits
from fusedserve.kernels.model_description.quantization import check_quantization
from fusedserve.shared_memory.engine_config import EngineConfig
from fusedserve.shared_memory.setting import parse_size, setting
from fusedserve.shared_memory.slots import MAX_TOP_LOGPROBS

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIN_TOKEN_CHARS = 16


def parse_size_or_zero(value: str) -> int:
    """A size, or 0 for the default."""
    return 0 if value.strip() == "0" else parse_size(value)


@dataclass
class Limits:
    """Bounds on what one request or one client may ask; each refusal has its own code."""

    # ZeroMQ text prompts are tokenized on the loop thread; the gateway checks its prompts, messages
    # and rendered turns before tokenizing, on a thread.
    max_prompt_chars: int = setting(
        1 << 19,
        "characters of text one request may ask to tokenize (prompts, chat messages and the rendered turn), "
        "checked before tokenizing; more get 413")
    max_prompt_tokens: int | None = setting(None, "longest prompt in tokens (default: max-model-len - 1)")
    max_tokens: int | None = setting(
        None,
        "largest max_tokens a request may ask for (default: max-model-len)",
        flag="--max-tokens-limit")
    max_requests_per_client: int = setting(
        256,
        "requests one client may have in flight: a ZeroMQ connection, or an HTTP client (its API key and "
        "address); more get 429 with Retry-After")
    max_queued_requests: int = setting(
        4096, "requests in flight on the whole server; more get 429 (server_busy)")
    max_queue_time_s: float = setting(
        0.0,
        "seconds a request may wait for its first launch (0: no bound); one that waits longer is refused "
        "with 429 (server_busy), so an overloaded server's queue holds only what it can start in time",
        flag="--max-queue-time")
    max_logprobs: int = setting(MAX_TOP_LOGPROBS, f"top logprobs a request may ask for, of its output or its "
                                f"prompt (at most {MAX_TOP_LOGPROBS}, the device slots' width)")

    def check(self) -> None:
        if self.max_queue_time_s < 0:
            raise ValueError(f"--max-queue-time must be >= 0 s, got {self.max_queue_time_s}")
        if not 0 <= self.max_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_TOP_LOGPROBS}] (the device slots hold "
                             f"{MAX_TOP_LOGPROBS} per row), got {self.max_logprobs}")


@dataclass
class ServerConfig:
    # The workers' engine (model, cache, scheduler, device, parallel), resolved by the server at start.
    engine: EngineConfig = setting(factory=EngineConfig, cli=False)
    host: str = setting(
        "127.0.0.1",
        "the ZeroMQ front end's address (anything beyond loopback needs --auth-token-file); the HTTP API "
        "binds --host",
        flag="--zmq-host")
    port: int = setting(5557, "the ZeroMQ front end's port (0: a free one)", flag="--zmq-port")
    step_timeout_s: float = setting(60.0, "a launch running longer means a hung worker: it is replaced")
    heartbeat_timeout_s: float = setting(
        0.6,
        "a worker (or its coordinator) silent this long on the step socket is gone: the coordinator re-runs "
        "its requests elsewhere, and the worker retires itself (raise it on a network with long stalls)",
        flag="--worker-heartbeat-timeout")
    transport: str = setting(
        "auto",
        "auto: shared memory for workers on this node, serializing for others; serial forces the "
        "serializing transport",
        choices=("auto", "serial"))
    max_restarts: int = setting(8, "worker replacements allowed per minute")
    max_workers: int = setting(64, "the most workers a scale request may ask for")
    send_hwm: int = setting(4096, "frames queued per ZeroMQ client before it counts as not reading")
    send_buffer_bytes: int = setting(
        0,
        "kernel send buffer per ZeroMQ client (0: the OS default, autotuned)",
        parse=parse_size_or_zero)
    # The server's base seed: a request that names no seed gets the next draw of a generator seeded
    # with it, in arrival order, so a server run's unseeded requests repeat in the next run.
    seed: int | None = setting(
        None,
        "the server's base seed: requests without a seed draw theirs from it in arrival order, so the same "
        "requests in the same order repeat per server run")
    # Required for any bind beyond loopback; when set, every frame must carry it as "auth".
    auth_token: str | None = setting(None, cli=False)
    # Required on admin frames (scale, workers) when set; without it a server with an auth token
    # refuses them, and a loopback server without one takes them from its local clients.
    admin_token: str | None = setting(None, cli=False)
    # The ZeroMQ socket's CURVE secret key (z85): clients then need its public key, and every byte
    # between them is encrypted.
    curve_secret_key: str | None = setting(None, cli=False)
    limits: Limits = setting(factory=Limits, cli=False)
    grammar: GrammarLimits = setting(factory=GrammarLimits, cli=False)  # parser limits, compile timeout
    routing: RoutingConfig = setting(factory=RoutingConfig, cli=False)  # which worker a request goes to

    @classmethod
    def build(cls, **settings: object) -> ServerConfig:
        """From flat names: this class's own fields, and every other one an engine setting
        (``EngineConfig.build``)."""
        own = {f.name for f in fields(cls)} - {"engine"}
        engine = {k: v for k, v in settings.items() if k not in own}
        return cls(engine=EngineConfig.build(**engine), **{k: v for k, v in settings.items() if k in own})

    def check(self) -> None:
        """Refuse, before anything starts, a configuration that cannot be served safely."""
        self.engine.check()
        self.routing.check()
        self.limits.check()
        check_quantization(self.engine.model.quantization)
        if not 0.01 <= self.heartbeat_timeout_s <= 3600:
            raise ValueError(f"--worker-heartbeat-timeout must be in [0.01, 3600] s, "
                             f"got {self.heartbeat_timeout_s}")
        if self.transport not in ("auto", "serial"):
            raise ValueError(f"transport must be auto or serial, got {self.transport!r}")
        if self.auth_token is not None and len(self.auth_token) < MIN_TOKEN_CHARS:
            raise ValueError(f"auth token must have at least {MIN_TOKEN_CHARS} characters")
        if self.admin_token is not None and len(self.admin_token) < MIN_TOKEN_CHARS:
            raise ValueError(f"admin token must have at least {MIN_TOKEN_CHARS} characters")
        if self.admin_token is not None and self.admin_token == self.auth_token:
            raise ValueError("the admin token must differ from the client token")
        if self.curve_secret_key is not None and len(self.curve_secret_key) != 40:
            raise ValueError("a CURVE secret key is 40 z85 characters (fusedserve curve-keygen writes one)")
        if self.host not in LOOPBACK and self.auth_token is None:
            raise ValueError(f"binding {self.host} (beyond loopback) requires an auth token")
