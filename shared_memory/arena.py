"""The host arena: one POSIX shared-memory segment holding a worker's HOST_SHARED slots.

The coordinator creates it (unique name: prefix + owner pid + random suffix; mode 0600,
``O_EXCL``) and the worker attaches by name; both map every slot as a torch tensor over the
same bytes, so neither side copies to hand data across. Every process that maps a segment
holds a shared ``flock`` on it from its first moment (the creator takes it before the segment
has a size). The creator unlinks the segment on ``close``, at interpreter exit and on
SIGTERM/SIGINT; ``remove_stale`` deletes leftovers of a killed run: this user's segments whose
owner pid is dead here and that no process holds locked (a live owner in another PID namespace
sharing /dev/shm still holds its lock).
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import secrets
import signal
import threading
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np
import torch

from fusedserve.shared_memory.slots import SlotError, SlotTable, front_view

log = logging.getLogger(__name__)

PREFIX = "fusedserve"
SHM_DIR = Path("/dev/shm")
_ALIGN = 64


@dataclass(frozen=True)
class SlotLayout:
    offset: int
    nbytes: int
    shape: tuple[int, ...]  # at the maximum dims
    dtype: torch.dtype


def plan_layout(table: SlotTable, max_dims: dict[str, int]) -> tuple[dict[str, SlotLayout], int]:
    """Byte offsets for every HOST_SHARED slot of ``table`` at ``max_dims``, 64-byte aligned."""
    layout: dict[str, SlotLayout] = {}
    offset = 0
    for slot in table:
        if not slot.host_shared:
            continue
        nbytes = slot.nbytes(max_dims)
        layout[slot.name] = SlotLayout(offset, nbytes, slot.concrete(max_dims), slot.dtype)
        offset += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    return layout, max(offset, _ALIGN)


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Keep multiprocessing's resource tracker out: this module owns unlinking
    (close, exit and signal hooks, ``remove_stale``), and an attached worker must
    never unlink the coordinator's segment when it exits."""
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - tracker internals differ across versions
        pass


def _owner_pid(name: str) -> int | None:
    parts = name.split("_")
    if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit():
        return int(parts[1])
    return None


def pid_alive(pid: int) -> bool:
    """Whether a process exists (owned by anyone): segment names carry their owner's pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink this user's arena segments whose owner is gone; returns their names. Another user's
    files, and segments some process still holds locked, are left alone; nothing here raises."""
    removed = []
    if not shm_dir.is_dir():
        return removed
    for entry in shm_dir.iterdir():
        pid = _owner_pid(entry.name)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        if _unlink_if_unheld(entry):
            removed.append(entry.name)
    if removed:
        log.warning("removed %d stale shared-memory segments (their owner died): %s",
                    len(removed), removed)
    return removed


def remove_owned_by(pid: int, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the segments ``pid`` created that no process holds any more (a watchdog's cleanup
    once that process is gone, even while it is still an unreaped zombie); returns their names."""
    if not shm_dir.is_dir():
        return []
    return [e.name for e in shm_dir.glob(f"{PREFIX}_{pid}_*") if _unlink_if_unheld(e)]


def _unlink_if_unheld(path: Path) -> bool:
    """Unlink ``path`` if it is this user's and no process holds its lock (taken here first, so
    nobody can attach to it meanwhile)."""
    try:
        if path.stat().st_uid != os.getuid():
            return False
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink()
        return True
    except OSError:  # held (a live owner or worker), or already gone
        return False
    finally:
        os.close(fd)


def _lock_shared(path: Path, flags: int, mode: int = 0o600) -> int:
    """An fd of ``path`` holding a shared lock: the mark of a live user of the segment."""
    fd = os.open(path, flags, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def list_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Names of every fusedserve segment present (for tests and diagnostics)."""
    if not shm_dir.is_dir():
        return []
    return sorted(e.name for e in shm_dir.iterdir() if _owner_pid(e.name) is not None)


class HostArena:
    """Typed tensor views over one shared-memory segment."""

    def __init__(self, shm: shared_memory.SharedMemory, layout: dict[str, SlotLayout], owner: bool,
                 lock_fd: int):
        self._shm = shm
        self._lock_fd = lock_fd  # held while mapped: remove_stale leaves a held segment alone
        self.layout = layout
        self.owner = owner
        self.name = shm.name
        self._closed = False
        self._tensors = {
            name: torch.frombuffer(shm.buf, dtype=torch.uint8, count=lay.nbytes, offset=lay.offset)
            .view(lay.dtype)
            .view(lay.shape)
            if lay.nbytes
            else torch.empty(lay.shape, dtype=lay.dtype)
            for name, lay in layout.items()
        }
        # The last shape asked of each slot, as a tensor and as a numpy array: a steady decode asks
        # the same shapes every launch, and making the views again (three tensor ops a slot, ~40
        # slots) cost ~1 ms a step on a slow core, a twentieth of a batch-1 step.
        self._views: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._arrays: dict[str, tuple[tuple[int, ...], np.ndarray]] = {}
        if owner:
            _register_owned(self)

    @classmethod
    def create(cls, table: SlotTable, max_dims: dict[str, int], tag: str = "w") -> HostArena:
        layout, size = plan_layout(table, max_dims)
        name = f"{PREFIX}_{os.getpid()}_{tag}_{secrets.token_hex(4)}"
        # Created here, exclusive and private, and locked before it has a size: never an existing
        # file, never another user's, never unheld while it exists.
        fd = _lock_shared(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR)
        try:
            os.ftruncate(fd, size)
            shm = shared_memory.SharedMemory(name=name, create=False)
        except BaseException:
            os.close(fd)
            (SHM_DIR / name).unlink(missing_ok=True)
            raise
        _untrack(shm)
        log.debug("created arena %s (%d bytes)", name, size)
        return cls(shm, layout, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str, table: SlotTable, max_dims: dict[str, int]) -> HostArena:
        """Map an existing arena; the layout is recomputed from the same declarations."""
        layout, size = plan_layout(table, max_dims)
        fd = _lock_shared(SHM_DIR / name, os.O_RDONLY)
        try:
            shm = shared_memory.SharedMemory(name=name, create=False)
        except BaseException:
            os.close(fd)
            raise
        _untrack(shm)
        if shm.size < size:
            shm.close()
            os.close(fd)
            raise SlotError(f"arena {name}: {shm.size} bytes, the slot table needs {size}")
        return cls(shm, layout, owner=False, lock_fd=fd)

    def full(self, name: str) -> torch.Tensor:
        """The slot's tensor at its maximum shape."""
        try:
            return self._tensors[name]
        except KeyError:
            raise SlotError(f"arena {self.name} has no HOST_SHARED slot {name!r}") from None

    def span(self) -> tuple[int, int]:
        """(address, bytes) of the whole mapped segment (a worker page-locks it for DMA)."""
        name, lay = min(((n, lay) for n, lay in self.layout.items() if lay.nbytes), key=lambda x: x[1].offset)
        return self._tensors[name].data_ptr() - lay.offset, self._shm.size

    def view(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The slot's first ``prod(shape)`` elements, shaped ``shape`` (contiguous, no copy)."""
        last = self._views.get(name)
        if last is not None and last[0] == shape:
            return last[1]
        view = front_view(self.full(name), shape, name)
        self._views[name] = (tuple(shape), view)
        return view

    def array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """``view(name, shape)`` as a numpy array over the same memory (numpy's dtypes only): what
        the coordinator writes a launch's inputs into, at a fraction of a tensor copy's cost."""
        last = self._arrays.get(name)
        if last is not None and last[0] == shape:
            return last[1]
        array = self.view(name, shape).numpy()
        self._arrays[name] = (tuple(shape), array)
        return array

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._tensors.clear()
        self._views.clear()
        self._arrays.clear()
        try:
            self._shm.close()
        except BufferError:
            log.warning("arena %s: views still alive at close; unmapping later", self.name)
        if self.owner:
            try:  # the module call, not shm.unlink(): that would re-notify the tracker
                shared_memory._posixshmem.shm_unlink(self._shm._name)  # type: ignore[attr-defined]
            except FileNotFoundError:
                pass
            _OWNED.pop(self.name, None)
        os.close(self._lock_fd)

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- cleanup hooks

_OWNED: dict[str, HostArena] = {}
_hooks_installed = False
_hooks_lock = threading.Lock()


def close_all() -> None:
    """Unlink every arena this process created (exit and signal handlers call it)."""
    for arena in list(_OWNED.values()):
        arena.close()


def _on_signal(signum: int, frame: object) -> None:
    close_all()
    previous = _PREVIOUS.get(signum)
    if callable(previous):
        previous(signum, frame)
    else:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


_PREVIOUS: dict[int, object] = {}


def _register_owned(arena: HostArena) -> None:
    global _hooks_installed
    _OWNED[arena.name] = arena
    with _hooks_lock:
        if _hooks_installed:
            return
        _hooks_installed = True
        atexit.register(close_all)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                prev = signal.getsignal(sig)
                _PREVIOUS[sig] = prev if prev not in (signal.SIG_DFL, signal.SIG_IGN) else None
                signal.signal(sig, _on_signal)
