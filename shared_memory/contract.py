"""What the coordinator and a worker agree on for every launch.

The coordinator writes a step's HOST_SHARED inputs into the arena and sends a
``LaunchDescriptor``; the worker runs it and answers a ``LaunchReply``. Both sides
size their buffers from the same ``RunnerConfig.max_dims``. This module is the only
contract between the two packages: the coordinator never imports ``worker/`` for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared_memory.runtime import LaunchRecord
from shared_memory.slots import SlotTable, decode_table, prefill_table

MAX_TOP_LOGPROBS = 20  # coordinator.sampling_params refuses more (this package imports no kernels)


@dataclass(frozen=True)
class RunnerConfig:
    max_batch: int = 16
    block_size: int = 16
    num_blocks: int = 256
    top_k: int = 64  # device-side candidates per stochastic row
    max_prefill_tokens: int = 4096
    # "auto": capture decode graphs per batch bucket where the device has graphs (CUDA, NPU);
    # "padded": the same bucketed, padded decode run eagerly (any device); "off": exact shapes.
    graphs: str = "auto"
    # Keep full KV blocks after their sequence ends, content-hashed, and reuse them as prompt
    # prefixes (coordinator/block_manager.py).
    enable_prefix_caching: bool = True
    # Chunked prefill: the most tokens one launch runs (decode rows count one each); prompts
    # are split to fit and share launches with the running decodes. 0: whole-prompt prefills.
    max_num_batched_tokens: int = 0
    # Sample every row on the device (only ids, and asked-for logprobs, come back); False keeps
    # the host fallback (top-K candidates or the logits row of stochastic rows come back).
    device_sampling: bool = True
    # Two launches in flight: the next is scheduled and sent while one runs, fed the ids it
    # leaves on the device; the coordinator reads ids one launch behind. Needs one arena
    # bank per launch in flight (``banks``). Rows sampled on the host never launch ahead.
    async_scheduling: bool = True

    @property
    def banks(self) -> int:
        """Arena banks per worker: one per launch that may be in flight."""
        return 2 if self.async_scheduling else 1

    def check(self) -> None:
        """Refuse, at start, settings no launch could honour."""
        for name in ("max_batch", "block_size", "num_blocks", "top_k", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        n = self.max_num_batched_tokens
        if n and not self.max_batch < n <= self.max_prefill_tokens:
            raise ValueError(f"max_num_batched_tokens must be 0 (off) or in ({self.max_batch}, "
                             f"{self.max_prefill_tokens}] (more than max_batch decode rows, at most "
                             f"max_prefill_tokens), got {n}")

    @property
    def pad_slot(self) -> int:
        """The KV slot past every allocatable block: padding and warm-up rows write there."""
        return self.num_blocks * self.block_size

    def max_dims(self, vocab: int, hidden: int, max_model_len: int) -> dict[str, int]:
        """The largest dims any launch may use; arena and pool are sized from these."""
        return {
            "B": self.max_batch,
            "W": -(-max_model_len // self.block_size),
            "T": max(self.max_prefill_tokens, max_model_len),
            "TP": self.max_batch * max_model_len,  # cached prefix tokens of one prefill
            "BD": self.max_batch,  # decode rows riding in a prefill launch (chunked prefill)
            "NT": self.max_batch,
            "NF": self.max_batch,
            "NL": self.max_batch,  # rows asking for logprobs (device sampling)
            "N": MAX_TOP_LOGPROBS,  # top logprobs per row
            "K": self.top_k,
            "V": vocab,
            "D": hidden,
        }


def slot_tables(hidden_dtype: torch.dtype = torch.float32) -> list[SlotTable]:
    """Both launch tables. HOST_SHARED layout does not depend on the dtype; only the
    DEVICE_RESIDENT ``next_hidden`` does, so the coordinator may use the default."""
    return [prefill_table(hidden_dtype), decode_table(hidden_dtype)]


@dataclass
class LaunchDescriptor:
    """The per-step control message: small, msgpack-able; tensors stay in the arena."""

    table: str  # "prefill" | "decode"
    dims: dict[str, int]
    step: int
    ctx_len: int = 0
    cu_seqlens: list[int] = field(default_factory=list)  # prefill: the new tokens' boundaries
    prefix_lens: list[int] = field(default_factory=list)  # prefill: cached tokens before them
    num_decode: int = 0  # prefill: its first rows are decode rows (one token, paged attention)
    bank: int = 0  # the arena bank holding its inputs and outputs (async scheduling alternates)

    def to_wire(self) -> dict:
        return {"table": self.table, "dims": self.dims, "step": self.step,
                "ctx_len": self.ctx_len, "cu_seqlens": self.cu_seqlens, "prefix_lens": self.prefix_lens,
                "num_decode": self.num_decode, "bank": self.bank}

    @classmethod
    def from_wire(cls, d: dict) -> LaunchDescriptor:
        return cls(d["table"], dict(d["dims"]), d["step"], d.get("ctx_len", 0),
                   list(d.get("cu_seqlens", [])), list(d.get("prefix_lens", [])), d.get("num_decode", 0),
                   d.get("bank", 0))


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
