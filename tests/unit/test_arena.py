"""The host arena across processes, and its cleanup on close, SIGTERM and after SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fusedserve.shared_memory.arena import SHM_DIR, HostArena, list_segments, remove_stale
from fusedserve.shared_memory.slots import SlotError, step_table

ROOT = Path(__file__).resolve().parents[2]
DIMS = {"B": 4, "B1": 5, "W": 3, "T": 16, "NL": 4, "N": 2, "TL": 16, "NP": 2, "V": 32, "G": 4, "VW": 1,
        "PR": 4, "PT": 16, "PB": 4, "LB": 8, "S": 4, "K1": 5, "BD": 4, "RS": 4, "SR": 4, "SRS": 4, "SSV": 4,
        "PL": 4, "H": 8, "LT": 16}
TABLE = step_table()


def _python(code: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_second_process_attaches_writes_and_reads_without_copies():
    with HostArena.create(TABLE, DIMS, tag="t") as arena:
        arena.view("sampled_ids", (4,)).copy_(torch.tensor([7, 8, 9, 10], dtype=torch.int32))
        child = _python(f"""
            import ctypes, torch
            from fusedserve.shared_memory.arena import HostArena
            from fusedserve.shared_memory.slots import SlotError, step_table
            a = HostArena.attach({arena.name!r}, step_table(), {DIMS!r})
            ids = a.view("sampled_ids", (4,))
            print("read", ids.tolist())
            a.view("token_ids", (4,)).copy_(ids * 2)
            base = ctypes.addressof(ctypes.c_char.from_buffer(a._shm.buf))
            ptr = a.full("token_ids").data_ptr()
            print("inside", base <= ptr < base + a._shm.size)
            del ids
            a.close()
        """)
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        assert "read [7, 8, 9, 10]" in out
        assert "inside True" in out  # the tensor is the shared mapping itself
        assert arena.view("token_ids", (4,)).tolist() == [14, 16, 18, 20]
        assert (SHM_DIR / arena.name).exists()  # the child's close did not unlink it
        name = arena.name
    assert not (SHM_DIR / name).exists()


def test_views_kept_per_shape_map_the_slot_front_whichever_shape_came_last():
    """The arena keeps each slot's last view (tensor and numpy): a shape asked again after another
    is the same memory, numpy writes land in the tensors, and an oversized shape is still refused."""
    with HostArena.create(TABLE, DIMS, tag="t") as arena:
        arena.array("block_tables", (2, 3))[...] = [[1, 2, 3], [4, 5, 6]]
        assert arena.view("block_tables", (2, 3)).tolist() == [[1, 2, 3], [4, 5, 6]]
        wide = arena.view("block_tables", (1, 3))
        wide[0, 0] = 9
        again = arena.array("block_tables", (2, 3))
        assert again.tolist() == [[9, 2, 3], [4, 5, 6]]
        assert again.ctypes.data == arena.full("block_tables").data_ptr()
        arena.array("block_tables", (3, 1))[...] = 0  # the first 3 elements, whatever the shape
        assert arena.view("block_tables", (2, 3)).tolist() == [[0, 0, 0], [4, 5, 6]]
        with pytest.raises(SlotError):
            arena.view("block_tables", (DIMS["B"] + 1, DIMS["W"]))
        del wide, again


def _creator(extra: str = "") -> tuple[subprocess.Popen, str]:
    proc = _python(f"""
        import sys, time
        from fusedserve.shared_memory.arena import HostArena
        from fusedserve.shared_memory.slots import SlotError, step_table
        a = HostArena.create(step_table(), {DIMS!r}, tag="kill")
        print(a.name, flush=True)
        {extra}
        time.sleep(120)
    """)
    name = proc.stdout.readline().strip()
    assert name, proc.stderr.read()
    assert (SHM_DIR / name).exists()
    return proc, name


def test_sigterm_unlinks_segments():
    proc, name = _creator()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode != 0
    assert not (SHM_DIR / name).exists()


def test_sigkill_leftovers_are_removed_by_the_next_start():
    proc, name = _creator()
    proc.kill()
    proc.wait(timeout=30)
    time.sleep(0.2)
    assert (SHM_DIR / name).exists(), "SIGKILL cannot run handlers; the segment stays"
    assert name in list_segments()
    removed = remove_stale()
    assert name in removed
    assert not (SHM_DIR / name).exists()


def test_remove_stale_spares_live_owners():
    with HostArena.create(TABLE, DIMS, tag="live") as arena:
        assert arena.name not in remove_stale()
        assert (SHM_DIR / arena.name).exists()


def _dead_pid() -> int:
    """A pid that names no process here (the first free one above a finished child's)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
    return int(child.stdout)


def test_segments_are_private_to_their_owner():
    with HostArena.create(TABLE, DIMS, tag="mode") as arena:
        st = (SHM_DIR / arena.name).stat()
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()


def test_another_users_file_is_left_alone_and_nothing_raises():
    """A file planted under the segment naming scheme by someone else (here: chowned to another
    uid) is never unlinked, and the sweep does not fail on it."""
    if os.getuid() != 0:
        pytest.skip("planting another user's file needs root")
    path = SHM_DIR / f"fusedserve_{_dead_pid()}_w0_planted"
    path.write_bytes(b"x")
    try:
        os.chown(path, 54321, 54321)
        assert path.name not in remove_stale() and path.exists()
    finally:
        path.unlink()


def test_a_live_owner_in_another_pid_namespace_keeps_its_segment():
    """Its pid means nothing here (it looks dead), but it holds the segment's lock: spared, and
    swept once the holder is gone."""
    pid = _dead_pid()
    path = SHM_DIR / f"fusedserve_{pid}_w0_{os.urandom(4).hex()}"
    holder = _python(f"""
        import fcntl, os, sys, time
        fd = os.open({str(path)!r}, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        print("held", flush=True)
        time.sleep(120)
    """)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        assert path.name not in remove_stale() and path.exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert path.name in remove_stale() and not path.exists()


def test_the_span_covers_every_slot_and_pinning_is_cuda_only():
    """``span`` is the whole mapping a CUDA worker page-locks: every slot's bytes lie inside it.
    Off CUDA nothing is registered (and releasing is a no-op)."""
    from fusedserve.worker.host_pinning import HostPinning

    with HostArena.create(TABLE, DIMS, tag="t") as arena:
        address, size = arena.span()
        assert size >= max(lay.offset + lay.nbytes for lay in arena.layout.values())
        for name, lay in arena.layout.items():
            if lay.nbytes:
                t = arena.full(name)
                assert address <= t.data_ptr() and t.data_ptr() + lay.nbytes <= address + size, name
                assert t.data_ptr() - address == lay.offset
        pinning = HostPinning([arena], torch.device("cpu"))
        assert pinning.pinned == 0 and pinning.unpinned == []
        pinning.release()
