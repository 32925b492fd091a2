"""What the coordinator and a worker agree on for every launch.

The coordinator writes a step's HOST_SHARED inputs into the arena and sends a
``LaunchDescriptor``; the worker runs it and answers a ``LaunchReply``. Both sides size
their buffers from the same ``EngineConfig.max_dims`` (``engine_config.py``, the start-time
half). With the slot table these are the whole contract between the two packages: the
coordinator never imports ``worker/`` for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The step socket's ZMTP heartbeats, on both ends: a peer silent this long (a host that vanished, a
# link that dropped) is gone, and since the coordinator never reconnects to a worker's endpoint, a
# worker whose coordinator connection is gone retires itself.
HEARTBEAT_IVL_MS = 200
HEARTBEAT_TIMEOUT_MS = 600


def heartbeat_interval_ms(timeout_ms: int) -> int:
    """The ping interval for a heartbeat bound: at least three pings inside it."""
    return min(HEARTBEAT_IVL_MS, timeout_ms // 3)


def launch_kind(num_decode: int, rows: int) -> str:
    """``decode`` (decode rows only), ``prefill`` (prompt chunks only) or ``mixed``."""
    if num_decode == rows:
        return "decode"
    return "mixed" if num_decode else "prefill"


@dataclass(frozen=True)
class LaunchDescriptor:
    """The per-launch control message: small, msgpack-able; tensors stay in the arena.

    ``prompt_query_lens`` and ``prompt_seq_lens`` are host copies of the prompt chunks' new
    tokens and contexts (rows ``num_decode``..B-1), so the worker plans their attention without
    reading the device. ``sampling`` names the sampler stages the launch's rows need
    (``fusedserve.kernels.sampler.SamplingPlan``), known here from their settings.
    """

    dims: dict[str, int]
    step: int
    bank: int  # the arena bank holding its inputs and outputs (async scheduling alternates)
    num_decode: int = 0  # leading rows of one token each
    prompt_query_lens: list[int] = field(default_factory=list)
    prompt_seq_lens: list[int] = field(default_factory=list)
    sampling: list[str] = field(default_factory=list)
    # Each speculating request's (first row, rows): a hybrid model runs their rows in order.
    spec_groups: list[list[int]] = field(default_factory=list)
    # The worker incarnation it is for (set by the step socket's executor): a reply echoes it and
    # ``step``, and the coordinator accepts none from an incarnation it has replaced.
    epoch: int = 0
    # LoRA: adapters to read into the worker's slots before the launch runs, as [slot, key, path]
    # (``key`` names one load of an adapter: a name reloaded from another path is another key).
    lora_loads: list[list] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """``decode`` (decode rows only), ``prefill`` (prompt chunks only) or ``mixed``."""
        return launch_kind(self.num_decode, self.dims["B"])

    def to_wire(self) -> dict:
        return {"dims": self.dims, "step": self.step, "num_decode": self.num_decode,
                "prompt_query_lens": self.prompt_query_lens, "prompt_seq_lens": self.prompt_seq_lens,
                "sampling": self.sampling, "bank": self.bank, "spec_groups": self.spec_groups,
                "epoch": self.epoch, "lora_loads": self.lora_loads}

    @classmethod
    def from_wire(cls, d: dict) -> LaunchDescriptor:
        return cls(dict(d["dims"]), d["step"], d.get("bank", 0), d.get("num_decode", 0),
                   list(d.get("prompt_query_lens", [])), list(d.get("prompt_seq_lens", [])),
                   list(d.get("sampling", [])), [list(g) for g in d.get("spec_groups", [])],
                   d.get("epoch", 0), [list(x) for x in d.get("lora_loads", [])])


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
    epoch: int = 0  # the descriptor's, echoed: which incarnation and launch this answers
    step: int = -1

    @classmethod
    def failed(cls, exc: BaseException) -> LaunchReply:
        return cls(False, error=f"{type(exc).__name__}: {exc}")

    def to_wire(self) -> dict:
        msg = {"ok": self.ok, "h2d": self.h2d, "d2h": self.d2h, "seconds": self.seconds, "idle": self.idle,
               "wait": self.wait, "epoch": self.epoch, "step": self.step}
        if self.error:
            msg["error"] = self.error
        if self.outputs is not None:
            msg["outputs"] = self.outputs
        return msg

    @classmethod
    def from_wire(cls, d: dict) -> LaunchReply:
        return cls(bool(d.get("ok")), d.get("h2d", 0), d.get("d2h", 0), d.get("seconds", 0.0),
                   d.get("error", "" if d.get("ok") else "launch failed"), d.get("outputs"),
                   d.get("idle", 0.0), d.get("wait", 0.0), d.get("epoch", 0), d.get("step", -1))
