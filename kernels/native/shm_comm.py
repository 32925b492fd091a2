"""Collectives of tensor-parallel CPU ranks on one host, through one shared-memory file.

gloo's all-reduce of a few kilobytes costs about a millisecond on a 2-core host (its I/O threads
wake the caller), and a decode step makes two per layer. Here each rank copies its tensor into its
own slot of a shared buffer, publishes a sequence number, waits for every rank's
(``group_arrive_wait``, native: release/acquire flags, spin then yield), and reads the others'
slots. Every rank sums the slots in rank order, so all hold the same bits. Slots alternate between
two banks, so a rank that races ahead to the next collective never overwrites a slot a slower rank
still reads: it cannot pass the next wait before that rank arrived there. Tensors larger than a
slot go through in slot-sized pieces.

The layout: ``size`` flags of a 64-byte line each, then ``2 x size`` slots of ``slot_bytes``.
Rank 0 creates the file, the others map it, and rank 0 unlinks it once all have (the group's
rendezvous does that: ``worker/tensor_group.py``), so nothing is left behind even after a kill.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import torch

FLAG_BYTES = 64
SLOT_BYTES = 4 << 20
WAIT_US = 20_000  # between checks that every peer is still alive


class PeerGone(RuntimeError):
    """A rank the others wait for is no longer alive."""


def segment_bytes(size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return size * FLAG_BYTES + 2 * size * slot_bytes


class ShmComm:
    def __init__(self, path: str | Path, rank: int, size: int, native, alive: Callable[[], bool],
                 slot_bytes: int = SLOT_BYTES, create: bool = False):
        """``alive()``: False once a peer is gone (checked while a wait runs long)."""
        nbytes = segment_bytes(size, slot_bytes)
        self._lock_fd: int | None = None
        if create:  # private to this user (the ranks run as the coordinator does), never an existing file,
            # and held locked until unlinked (a stale-segment sweep leaves a held file alone)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, nbytes)
            self._lock_fd = fd
        self.buf = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.native, self.alive = native, alive
        self.flags = self.buf[: size * FLAG_BYTES].view(torch.int64)
        self.seq = 0

    def unlink(self, path: str | Path) -> None:
        os.unlink(path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _slot(self, bank: int, rank: int, nbytes: int) -> torch.Tensor:
        start = self.size * FLAG_BYTES + (bank * self.size + rank) * self.slot_bytes
        return self.buf[start : start + nbytes]

    def _meet(self) -> None:
        """Publish the next sequence number, wait for every rank's."""
        self.seq += 1
        while not self.native.group_arrive_wait(self.flags, self.rank, self.seq, WAIT_US):
            if not self.alive():
                raise PeerGone(f"rank {self.rank}: a peer of the tensor-parallel group is gone")

    def _pieces(self, t: torch.Tensor):
        """(start, stop) element ranges of ``t`` that fit a slot."""
        per = self.slot_bytes // t.element_size()
        return ((s, min(s + per, t.numel())) for s in range(0, t.numel(), per))

    def _exchange(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """Publish this rank's ``piece`` (fits a slot), meet, and return every rank's, in rank order."""
        nbytes = piece.numel() * piece.element_size()
        bank = (self.seq + 1) % 2  # the round _meet completes next
        self._slot(bank, self.rank, nbytes).view(piece.dtype).copy_(piece)
        self._meet()
        return [self._slot(bank, j, nbytes).view(piece.dtype) for j in range(self.size)]

    def all_reduce(self, t: torch.Tensor) -> None:
        """``t`` = the sum of every rank's ``t`` (in rank order), in place."""
        flat = t.view(-1)
        for s, e in self._pieces(flat):
            parts = self._exchange(flat[s:e])
            torch.add(parts[0], parts[1], out=flat[s:e])
            for p in parts[2:]:
                flat[s:e].add_(p)

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor) -> None:
        """``out[j]`` = rank j's ``t``."""
        flat = t.reshape(-1)
        for s, e in self._pieces(flat):
            for j, part in enumerate(self._exchange(flat[s:e])):
                out[j].view(-1)[s:e].copy_(part)
