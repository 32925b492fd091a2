"""Page-locks the arena banks where they lie, so a launch's h2d and d2h are DMA on its stream.

An arena is POSIX shared memory the coordinator writes: pageable, so each CUDA copy would be
staged by the driver through a pinned bounce buffer, synchronously. ``cudaHostRegister`` pins
the mapped segment in place instead: no staging copy of our own, no extra host memcpy, and the
copies run asynchronously on the launch's stream (the runtime waits on one event at the end).
Where registration fails (a container's locked-memory limit, an old driver), the bank stays
pageable, the copies stay correct, and a warning says so. Nothing happens off CUDA.
"""

from __future__ import annotations

import logging

import torch

from fusedserve.shared_memory.arena import HostArena

log = logging.getLogger(__name__)


class HostPinning:
    """The arenas of one runtime, registered with CUDA for their lifetime (``release`` undoes it)."""

    def __init__(self, arenas: list[HostArena], device: torch.device):
        self._addresses: list[int] = []
        self.unpinned: list[str] = []  # arenas left pageable (registration refused)
        if device.type != "cuda":
            return
        cudart = torch.cuda.cudart()
        with torch.cuda.device(device):
            for arena in arenas:
                address, size = arena.span()
                err = int(cudart.cudaHostRegister(address, size, 1))  # 1: cudaHostRegisterPortable
                if err:
                    log.warning("arena %s (%d bytes) could not be page-locked (cudaError %d): its "
                                "copies are staged by the driver", arena.name, size, err)
                    self.unpinned.append(arena.name)
                    _absorb_last_error(device)
                    continue
                self._addresses.append(address)

    @property
    def pinned(self) -> int:
        """How many arenas are page-locked."""
        return len(self._addresses)

    def release(self) -> None:
        """Unregister every pinned arena (before the arenas unmap). Idempotent."""
        if self._addresses:
            cudart = torch.cuda.cudart()
            for address in self._addresses:
                cudart.cudaHostUnregister(address)
            self._addresses = []


def _absorb_last_error(device: torch.device) -> None:
    """A failed ``cudaHostRegister`` leaves its code as the runtime's last error, which torch's
    next kernel-launch check would raise as that kernel's: one throwaway kernel takes it here."""
    try:
        torch.zeros(1, device=device).add_(1)
    except RuntimeError as exc:
        log.debug("cleared the registration's error: %s", exc)
