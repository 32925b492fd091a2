"""The device scratch pool: one persistent device tensor per slot, allocated once per worker.

Every slot of the table gets one, at the largest dims: the DEVICE_RESIDENT ones, and device
twins of the HOST_SHARED ones, which the launch runtime fills from the arena before a launch
and reads back after it. A launch works on views of them and allocates nothing. A launch's view
is the tensor's leading corner (``full[:b, :w]``), so row r of a slot sits at one address for
every launch: the decode graphs capture the pool's own tensors and replay over whatever a
launch wrote there, with no copies of their own.
"""

from __future__ import annotations

import torch

from fusedserve.shared_memory.slots import SlotError, SlotTable


class DeviceScratchPool:
    """Persistent device tensors for every slot of ``table`` at ``max_dims``."""

    def __init__(self, table: SlotTable, max_dims: dict[str, int], device: torch.device | str = "cpu"):
        self.max_dims = dict(max_dims)
        self.device = torch.device(device)
        self._tensors: dict[str, torch.Tensor] = {
            slot.name: torch.zeros(slot.concrete(max_dims), dtype=slot.dtype, device=self.device)
            for slot in table
        }

    def full(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise SlotError(f"scratch pool has no slot {name!r}") from None

    def view(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The leading ``shape`` corner of the slot's tensor (strided where a trailing dim is below
        its maximum, as a block table narrower than the widest is)."""
        full = self.full(name)
        if len(shape) != full.dim() or any(d > m for d, m in zip(shape, full.shape)):
            raise SlotError(f"slot {name!r}: shape {shape} exceeds the allocated {tuple(full.shape)}")
        return full[tuple(slice(0, d) for d in shape)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())
