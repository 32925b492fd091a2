"""The serializing transport: the same slot semantics for a worker on another node.

Host shared memory spans one node. For a remote worker each side keeps its own
arena with the same layout, and a launch message carries the bytes of the
HOST_SHARED inputs (for that launch's dims) while the reply carries the bytes of
the HOST_SHARED outputs; DEVICE_RESIDENT slots never move.
"""

from __future__ import annotations

import numpy as np
import torch

from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.slots import Slot, SlotError, SlotTable


def _views(arena: HostArena, slots: list[Slot], dims: dict[str, int]):
    for slot in slots:
        yield slot, arena.view(slot.name, slot.concrete(dims))


def pack_inputs(arena: HostArena, table: SlotTable, dims: dict[str, int]) -> dict[str, bytes]:
    return {s.name: v.numpy().tobytes() for s, v in _views(arena, table.host_inputs(), dims)}


def pack_outputs(arena: HostArena, table: SlotTable, dims: dict[str, int]) -> dict[str, bytes]:
    return {s.name: v.numpy().tobytes() for s, v in _views(arena, table.host_outputs(), dims)}


def unpack(arena: HostArena, table: SlotTable, dims: dict[str, int], data: dict[str, bytes],
           outputs: bool) -> int:
    """Write serialized slot bytes into ``arena``; returns the bytes written."""
    slots = table.host_outputs() if outputs else table.host_inputs()
    total = 0
    for slot, view in _views(arena, slots, dims):
        raw = data.get(slot.name)
        if raw is None or len(raw) != slot.nbytes(dims):
            raise SlotError(f"transport: slot {slot.name!r} carried "
                            f"{None if raw is None else len(raw)} bytes, expected {slot.nbytes(dims)}")
        if raw:
            src = np.frombuffer(raw, dtype=view.numpy().dtype).reshape(view.shape)
            view.copy_(torch.from_numpy(src.copy()))
        total += len(raw)
    return total
