"""What the coordinator and a worker agree on for every launch.

The coordinator writes a step's HOST_SHARED inputs into the arena and sends a
``LaunchDescriptor``; the worker runs it and answers a ``LaunchReply``. Both sides
size their buffers from the same ``RunnerConfig.max_dims``. This module is the only
contract between the two packages: the coordinator never imports ``worker/`` for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared_memory.runtime import LaunchRecord, launch_kind

MAX_TOP_LOGPROBS = 20  # coordinator.sampling_params refuses more (this package imports no coordinator)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class RunnerConfig:
    max_batch: int = 16  # rows (sequences) a launch may carry
    block_size: int = 16
    num_blocks: int = 256
    # Candidates the sampler sorts per row: a stochastic row whose top_k is 1..this is sampled
    # among them (its whole top-k set); other stochastic rows over the whole vocabulary.
    top_k: int = 64
    # The token budget of one launch: every running stream's decode row first, then prompt
    # chunks in what is left, so a long prompt is split across launches and never stalls the
    # streams. It sizes the arena's token slots.
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # "auto": capture decode graphs per batch bucket where the device has graphs (CUDA, NPU);
    # "padded": the same bucketed, padded decode run eagerly (any device); "off": exact shapes.
    graphs: str = "auto"
    # Keep full KV blocks after their sequence ends, content-hashed, and reuse them as prompt
    # prefixes (coordinator/engine/block_manager.py).
    enable_prefix_caching: bool = True
    # Two launches in flight: the next is scheduled and sent while one runs, fed the ids it
    # leaves on the device; the coordinator reads ids one launch behind. Needs one arena
    # bank per launch in flight (``banks``).
    async_scheduling: bool = True

    @property
    def banks(self) -> int:
        """Arena banks per worker: one per launch that may be in flight."""
        return 2 if self.async_scheduling else 1

    def check(self) -> None:
        """Refuse, at start, settings no launch could honour."""
        for name in ("max_batch", "block_size", "num_blocks", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        n = self.max_num_batched_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n <= self.max_batch:
            raise ValueError(f"max_num_batched_tokens must be more than max_batch ({self.max_batch}): "
                             f"room for every decode row and a prompt token; got {n}")
        if self.graphs not in ("auto", "padded", "off"):
            raise ValueError(f"graphs must be auto, padded or off, got {self.graphs!r}")

    @property
    def pad_slot(self) -> int:
        """The KV slot past every allocatable block: padding and warm-up rows write there."""
        return self.num_blocks * self.block_size

    def max_dims(self, vocab: int, max_model_len: int) -> dict[str, int]:
        """The largest dims any launch may use; arena and pool are sized from these."""
        return {
            "B": self.max_batch,
            "B1": self.max_batch + 1,
            "T": self.max_num_batched_tokens,
            "W": -(-max_model_len // self.block_size),
            "NL": self.max_batch,  # rows asking for logprobs
            "N": MAX_TOP_LOGPROBS,  # top logprobs per row
            "TL": self.max_num_batched_tokens,  # prompt tokens asking for their logprob
            "NP": MAX_TOP_LOGPROBS,
            "V": vocab,
            "G": self.max_batch,  # rows of token bitmask (structured outputs)
            "VW": -(-vocab // 32),
        }


@dataclass
class LaunchDescriptor:
    """The per-launch control message: small, msgpack-able; tensors stay in the arena.

    ``prompt_query_lens`` and ``prompt_seq_lens`` are host copies of the prompt chunks' new
    tokens and contexts (rows ``num_decode``..B-1), so the worker plans their attention without
    reading the device. ``sampling`` names the sampler stages the launch's rows need
    (``kernels.sampler.SamplingPlan``), known here from their settings.
    """

    dims: dict[str, int]
    step: int
    num_decode: int = 0  # leading rows of one token each
    prompt_query_lens: list[int] = field(default_factory=list)
    prompt_seq_lens: list[int] = field(default_factory=list)
    sampling: list[str] = field(default_factory=list)
    bank: int = 0  # the arena bank holding its inputs and outputs (async scheduling alternates)

    @property
    def kind(self) -> str:
        """``decode`` (decode rows only), ``prefill`` (prompt chunks only) or ``mixed``."""
        return launch_kind(self.num_decode, self.dims["B"])

    def to_wire(self) -> dict:
        return {"dims": self.dims, "step": self.step, "num_decode": self.num_decode,
                "prompt_query_lens": self.prompt_query_lens, "prompt_seq_lens": self.prompt_seq_lens,
                "sampling": self.sampling, "bank": self.bank}

    @classmethod
    def from_wire(cls, d: dict) -> LaunchDescriptor:
        return cls(dict(d["dims"]), d["step"], d.get("num_decode", 0), list(d.get("prompt_query_lens", [])),
                   list(d.get("prompt_seq_lens", [])), list(d.get("sampling", [])), d.get("bank", 0))


@dataclass
class LaunchReply:
    """A worker's answer to one launch: the bytes it moved and its time, or its error.

    ``outputs`` carries the HOST_SHARED output bytes on the serializing transport.
    """

    ok: bool
    h2d: int = 0
    d2h: int = 0
    seconds: float = 0.0
    error: str = ""
    outputs: dict[str, bytes] | None = None
    idle: float = 0.0  # the worker's gap since its previous launch ended
    # Of that gap, the time it waited for this launch's descriptor to arrive (for the
    # coordinator); the rest is the worker's own reply and decode. In-process: all of it.
    wait: float = 0.0

    @classmethod
    def from_record(cls, rec: LaunchRecord) -> LaunchReply:
        return cls(True, rec.h2d_bytes, rec.d2h_bytes, rec.seconds, idle=rec.idle_s, wait=rec.idle_s)

    @classmethod
    def failed(cls, exc: BaseException) -> LaunchReply:
        return cls(False, error=f"{type(exc).__name__}: {exc}")

    def to_wire(self) -> dict:
        msg = {"ok": self.ok, "h2d": self.h2d, "d2h": self.d2h, "seconds": self.seconds, "idle": self.idle,
               "wait": self.wait}
        if self.error:
            msg["error"] = self.error
        if self.outputs is not None:
            msg["outputs"] = self.outputs
        return msg

    @classmethod
    def from_wire(cls, d: dict) -> LaunchReply:
        return cls(bool(d.get("ok")), d.get("h2d", 0), d.get("d2h", 0), d.get("seconds", 0.0),
                   d.get("error", "" if d.get("ok") else "launch failed"), d.get("outputs"),
                   d.get("idle", 0.0), d.get("wait", 0.0))
