"""What a server is started with: the workers' engine, the socket, auth, and request limits."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from fusedserve.coordinator.server.routing_policy import RoutingConfig
from fusedserve.coordinator.structured.grammar_compiler import GrammarLimits
from fusedserve.kernels.model_description.quantization import check_quantization
from fusedserve.shared_memory.engine_config import EngineConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIN_TOKEN_CHARS = 16


@dataclass
class Limits:
    """Bounds on what one request or one client may ask; each refusal has its own code."""

    # Text a request may ask to tokenize (ZeroMQ text prompts are tokenized on the loop thread; the
    # gateway checks its prompts, messages and rendered turns before tokenizing, on a thread).
    max_prompt_chars: int = 1 << 19
    max_prompt_tokens: int | None = None  # None: max_model_len - 1
    max_tokens: int | None = None  # None: max_model_len
    max_requests_per_client: int = 256  # in flight per connection
    max_queued_requests: int = 4096  # in flight in all


@dataclass
class ServerConfig:
    # The workers' engine (model, cache, scheduler, device, parallel), resolved by the server at start.
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 5557
    step_timeout_s: float = 60.0  # a launch running longer means a hung worker: replaced
    # "auto": shared memory for workers on this node, serializing for others; "serial" forces it.
    transport: str = "auto"
    max_restarts: int = 8  # worker replacements allowed per minute
    max_workers: int = 64  # the most a scale request may ask for
    send_hwm: int = 4096  # frames queued per client before it counts as not reading
    send_buffer_bytes: int = 0  # kernel send buffer per client (0: the OS default, autotuned)
    # Required for any bind beyond loopback; when set, every frame must carry it as "auth".
    auth_token: str | None = None
    # Required on admin frames (scale, workers) when set; without it a server with an auth token
    # refuses them, and a loopback server without one takes them from its local clients.
    admin_token: str | None = None
    # The ZeroMQ socket's CURVE secret key (z85): clients then need its public key, and every byte
    # between them is encrypted.
    curve_secret_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # parser limits and compile timeout
    routing: RoutingConfig = field(default_factory=RoutingConfig)  # which worker a request goes to

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
        check_quantization(self.engine.model.quantization)
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
