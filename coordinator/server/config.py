"""What a server is started with: the model and workers, the socket, auth, and request limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared_memory.contract import RunnerConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIN_TOKEN_CHARS = 16


@dataclass
class Limits:
    """Bounds on what one request or one client may ask; each refusal has its own code."""

    max_prompt_chars: int = 1 << 16  # text prompts: tokenizing runs on the loop thread
    max_prompt_tokens: int | None = None  # None: max_model_len - 1
    max_tokens: int | None = None  # None: max_model_len
    max_requests_per_client: int = 256  # in flight per connection
    max_queued_requests: int = 4096  # in flight in all


@dataclass
class ServerConfig:
    model: str = "default"
    workers: int = 1  # 0: one per device in the Ray cluster
    device: str = "auto"
    host: str = "127.0.0.1"
    port: int = 5557
    dtype: str | None = None
    # "int8" (per channel) or "int4" (groups of 32), quantized by each worker at load; the native
    # CPU kernels multiply them with int8 activations ("int8-weight-only": 16-bit activations).
    quantization: str | None = None
    max_model_len: int | None = 1024
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    cpus_per_worker: int = 1  # per device: each rank of a tensor-parallel worker reserves these
    threads_per_worker: int = 1
    tensor_parallel_size: int = 1  # devices per worker, one Ray actor each, on one node
    enable_expert_parallel: bool = False  # a MoE model's experts placed whole across the group
    step_timeout_s: float = 60.0  # a launch running longer means a hung worker: replaced
    # "auto": shared memory for workers on this node, serializing for others; "serial" forces it.
    transport: str = "auto"
    max_restarts: int = 8  # worker replacements allowed per minute
    max_workers: int = 64  # the most a scale request may ask for
    send_hwm: int = 4096  # frames queued per client before it counts as not reading
    send_buffer_bytes: int = 0  # kernel send buffer per client (0: the OS default, autotuned)
    # Required for any bind beyond loopback; when set, every frame must carry it as "auth".
    auth_token: str | None = None
    limits: Limits = field(default_factory=Limits)

    def check(self) -> None:
        """Refuse, before anything starts, a configuration that cannot be served safely."""
        self.runner.check()
        if self.quantization not in (None, "none", "int8", "int8-weight-only", "int4"):
            raise ValueError("quantization must be none, int8, int8-weight-only or int4, "
                             f"got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("enable_expert_parallel places experts across a tensor-parallel group: "
                             "it needs tensor_parallel_size > 1")
        if self.transport not in ("auto", "serial"):
            raise ValueError(f"transport must be auto or serial, got {self.transport!r}")
        if self.auth_token is not None and len(self.auth_token) < MIN_TOKEN_CHARS:
            raise ValueError(f"auth token must have at least {MIN_TOKEN_CHARS} characters")
        if self.host not in LOOPBACK and self.auth_token is None:
            raise ValueError(f"binding {self.host} (beyond loopback) requires an auth token")
