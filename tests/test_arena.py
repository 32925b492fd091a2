"""The host arena across processes, and its cleanup on close, SIGTERM and after SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from shared_memory.arena import SHM_DIR, HostArena, list_segments, remove_stale
from shared_memory.slots import step_table

ROOT = Path(__file__).resolve().parents[1]
DIMS = {"B": 4, "B1": 5, "W": 3, "T": 16, "NL": 4, "N": 2, "TL": 16, "NP": 2, "V": 32, "G": 4, "VW": 1}
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
            from shared_memory.arena import HostArena
            from shared_memory.slots import step_table
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


def _creator(extra: str = "") -> tuple[subprocess.Popen, str]:
    proc = _python(f"""
        import sys, time
        from shared_memory.arena import HostArena
        from shared_memory.slots import step_table
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
