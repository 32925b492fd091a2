"""What a server leaves when it dies without stopping (SIGKILL, the OOM killer): a watchdog
process, started with the server's Ray connection, that waits for the server to be gone and then
ends its embedded head's whole session if it had one (GCS, raylet, agents, the worker actors;
in a joined cluster the actors die with their owner) and unlinks the server's shared-memory
segments once no worker holds them.

A clean shutdown stops the head itself and then this watchdog; a killed server cannot, and
before this its head's processes and both arena segments stayed on the machine (issue 57
measured six processes and two segments 30 s after a SIGKILL under load).

    python -m fusedserve.coordinator.server.head_reaper --parent PID --temp-dir DIR --session S

(``ray_cluster.EmbeddedHead.start``, or ``connect`` for a joined cluster, starts it;
``FUSEDSERVE_HEAD_REAPER=0`` does without.)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from fusedserve.coordinator.server.ray_cluster import stop_head

log = logging.getLogger(__name__)


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks (``/proc/PID/stat``): with its pid, who it is (a pid
    is reused; the pair is not). None once it is gone or a zombie (dead, not yet reaped)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def watch(parent: int, temp_dir: str | None, session: int | None, poll_s: float = 0.2,
          shm_wait_s: float = 30.0) -> bool:
    """Wait for ``parent`` to end; then end its head if it left one up (``temp_dir``, ``session``:
    an embedded head) and unlink the segments it left once no worker holds them (a joined
    cluster's actors die with their owner, within seconds). True when there was something to
    clean (the parent did not stop cleanly)."""
    from fusedserve.shared_memory.arena import PREFIX, SHM_DIR, remove_owned_by

    born = start_time(parent)
    while born is not None and start_time(parent) == born:
        time.sleep(poll_s)

    def left() -> bool:
        return SHM_DIR.is_dir() and any(SHM_DIR.glob(f"{PREFIX}_{parent}_*"))

    head_up = temp_dir is not None and Path(temp_dir).exists()  # a clean stop removed it
    if not head_up and not left():
        return False
    if head_up:
        log.warning("server %d is gone without stopping its Ray head (session %s): ending it", parent,
                    session)
        stop_head(temp_dir, grace_s=1.0, session=session)
    deadline = time.monotonic() + shm_wait_s  # a worker may hold a segment until it is reaped
    while left() and time.monotonic() < deadline:
        removed = remove_owned_by(parent)
        if removed:
            log.warning("unlinked server %d's shared-memory segments %s", parent, removed)
        time.sleep(0.2)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--temp-dir", default=None, help="its embedded head's (none: it joined a cluster)")
    ap.add_argument("--session", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    watch(args.parent, args.temp_dir, args.session)
    return 0


if __name__ == "__main__":
    sys.exit(main())
