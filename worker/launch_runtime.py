"""The launch runtime: moves exactly the HOST_SHARED bytes around each launch, and counts them.

A launch copies its HOST_SHARED inputs from the arena bank the coordinator wrote into the
scratch pool's device twins, runs the step on pool views, then copies back exactly the
HOST_SHARED outputs into the same bank, counting bytes each way. Nothing else crosses: the
DEVICE_RESIDENT slots never leave the device.

On CUDA the banks are page-locked in place (``HostPinning``): every copy is issued
non-blocking on the launch's stream, and the launch ends by waiting on one event recorded
after its last copy (not ``torch.cuda.synchronize``, which would wait for every stream).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.contract import LaunchReply, launch_kind
from fusedserve.shared_memory.slots import SlotError, SlotTable
from fusedserve.worker.host_pinning import HostPinning
from fusedserve.worker.scratch_pool import DeviceScratchPool


@dataclass
class LaunchRecord:
    dims: dict[str, int]
    num_decode: int  # leading rows of one token each; the rest are prompt chunks
    h2d_bytes: int
    d2h_bytes: int
    seconds: float
    idle_s: float = 0.0  # since the previous launch ended: time the device had nothing to run

    @property
    def kind(self) -> str:
        """``decode`` (decode rows only), ``prefill`` (prompt chunks only) or ``mixed``."""
        return launch_kind(self.num_decode, self.dims["B"])

    def reply(self) -> LaunchReply:
        """The coordinator's view of it (in-process: the whole gap was a wait for the coordinator)."""
        return LaunchReply(True, self.h2d_bytes, self.d2h_bytes, self.seconds, idle=self.idle_s,
                           wait=self.idle_s)


@dataclass
class TrafficCounters:
    """Per-kind totals of launches and bytes moved; ``last`` is the latest launch."""

    launches: dict[str, int] = field(default_factory=dict)
    h2d_bytes: dict[str, int] = field(default_factory=dict)
    d2h_bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    last: LaunchRecord | None = None

    def record(self, rec: LaunchRecord) -> None:
        t = rec.kind
        self.launches[t] = self.launches.get(t, 0) + 1
        self.h2d_bytes[t] = self.h2d_bytes.get(t, 0) + rec.h2d_bytes
        self.d2h_bytes[t] = self.d2h_bytes.get(t, 0) + rec.d2h_bytes
        self.seconds[t] = self.seconds.get(t, 0.0) + rec.seconds
        self.last = rec

    def as_dict(self) -> dict:
        return {
            "launches": dict(self.launches),
            "h2d_bytes": dict(self.h2d_bytes),
            "d2h_bytes": dict(self.d2h_bytes),
            "seconds": dict(self.seconds),
            "last": None if self.last is None else vars(self.last).copy(),
        }


StepFn = Callable[[dict[str, torch.Tensor]], None]


@dataclass(frozen=True)
class CopyPlan:
    """What a launch of one set of dims on one bank moves: the pool views its step gets, the
    (destination, source) pairs of its non-empty HOST_SHARED inputs and outputs, and their bytes.
    Views alias the pool's and the arena's fixed tensors, so one plan serves every launch of the
    same dims and bank."""

    views: dict[str, torch.Tensor]
    inputs: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    outputs: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    h2d_bytes: int
    d2h_bytes: int


class LaunchRuntime:
    """Runs launches against the declared slot table, moving and counting HOST_SHARED bytes.

    ``arenas`` are the banks a launch may name (one per launch the coordinator keeps in
    flight); each has every HOST_SHARED slot. ``writes_outputs`` False: the launch reads its
    inputs but copies nothing back (a tensor-parallel rank other than 0; rank 0 writes them).
    """

    def __init__(self, table: SlotTable, arenas: HostArena | list[HostArena], pool: DeviceScratchPool,
                 writes_outputs: bool = True, unread: tuple[str, ...] = ()):
        """``unread``: output slots this worker's launches never fill (a pooling runner samples no
        ids), so none of their bytes cross."""
        self.writes_outputs = writes_outputs
        self.unread = frozenset(unread)
        self.table = table
        self.arenas = arenas if isinstance(arenas, list) else [arenas]
        self.pool = pool
        self.counters = TrafficCounters()
        self.history: list[LaunchRecord] = []
        self.keep_history = 0  # > 0 keeps the latest N records (tests, benchmarks)
        self._last_end: float | None = None
        self.pinning = HostPinning(self.arenas, pool.device)
        self._done = torch.cuda.Event() if pool.device.type == "cuda" else None
        # Copy plans by (bank, dims), newest last: decode launches repeat a handful of dims, and
        # building the views and checks is ~0.4 ms of Python a launch (more than a GPU step).
        self._plans: dict[tuple, CopyPlan] = {}
        self._dim_names = tuple(sorted(pool.max_dims))
        for slot in table:  # declarations vs. what was allocated, before any launch
            slot.check(pool.full(slot.name), pool.max_dims)
            for arena in self.arenas:
                if slot.host_shared:
                    slot.check(arena.full(slot.name), pool.max_dims)

    def check_dims(self, dims: dict[str, int]) -> None:
        for slot in self.table:
            for d, m in zip(slot.concrete(dims), slot.concrete(self.pool.max_dims)):
                if d > m or d < 0:
                    raise SlotError(
                        f"launch: slot {slot.name!r} shape {slot.concrete(dims)} "
                        f"outside the allocated {slot.concrete(self.pool.max_dims)}"
                    )

    def plan(self, dims: dict[str, int], bank: int) -> CopyPlan:
        """The copy plan of ``dims`` on ``bank``: checked and built once, then looked up."""
        key = (bank, *(dims.get(d, -1) for d in self._dim_names))
        plan = self._plans.pop(key, None)
        if plan is None:
            self.check_dims(dims)
            if not 0 <= bank < len(self.arenas):
                raise SlotError(f"launch: arena bank {bank} of {len(self.arenas)}")
            arena, table = self.arenas[bank], self.table
            views = {s.name: self.pool.view(s.name, s.concrete(dims)) for s in table}
            ins = [s for s in table.host_inputs() if s.nbytes(dims)]
            outs = ([s for s in table.host_outputs() if s.nbytes(dims) and s.name not in self.unread]
                    if self.writes_outputs else [])
            plan = CopyPlan(views, tuple((views[s.name], arena.view(s.name, s.concrete(dims))) for s in ins),
                            tuple((arena.view(s.name, s.concrete(dims)), views[s.name]) for s in outs),
                            sum(s.nbytes(dims) for s in ins), sum(s.nbytes(dims) for s in outs))
            if len(self._plans) >= 256:
                del self._plans[next(iter(self._plans))]  # the least recently used
        self._plans[key] = plan
        return plan

    def launch(self, dims: dict[str, int], step: StepFn, bank: int = 0, num_decode: int = 0,
               extra_h2d: int = 0) -> LaunchRecord:
        """Copy inputs in from arena ``bank``, run ``step(views)``, copy HOST_SHARED outputs out
        to the same bank. ``num_decode`` is recorded (``LaunchRecord.kind``). Empty slots move
        nothing (a copy of zero bytes would still cost a dispatch). ``extra_h2d``: bytes the launch
        had copied to the device besides its slots (LoRA adapters read into their slots), counted
        with them."""
        plan = self.plan(dims, bank)
        t0 = time.perf_counter()
        idle = t0 - self._last_end if self._last_end is not None else 0.0
        for dst, src in plan.inputs:
            dst.copy_(src, non_blocking=True)
        step(plan.views)
        for dst, src in plan.outputs:
            dst.copy_(src, non_blocking=True)
        self._wait()
        self._last_end = time.perf_counter()
        rec = LaunchRecord(dict(dims), num_decode, plan.h2d_bytes + extra_h2d, plan.d2h_bytes,
                           self._last_end - t0, idle)
        self.counters.record(rec)
        if self.keep_history:
            self.history.append(rec)
            del self.history[: -self.keep_history]
        return rec

    def _wait(self) -> None:
        """Until the launch's copies into the bank have landed: one event on its stream (CUDA)."""
        if self._done is not None:
            self._done.record(torch.cuda.current_stream(self.pool.device))
            self._done.synchronize()
        elif self.pool.device.type == "npu":  # pragma: no cover - needs Ascend hardware
            torch.npu.synchronize(self.pool.device)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Unpin the banks (before they unmap)."""
        self.pinning.release()
