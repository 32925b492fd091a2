"""Ray job entry point.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        exec python -m fusedserve.deploy.serve --model default --workers auto

Connects to the running cluster, places one worker per device it reports (every
NPU/GPU, or one CPU worker per node), serves the ZeroMQ front end and logs the
address clients should use. ``ray job stop`` sends SIGTERM: in-flight requests get
an error, workers stop and every shared-memory segment is unlinked. ``exec`` matters: Ray
runs the entrypoint under ``/bin/sh -c``, which dies at once on SIGTERM and leaves this
process an orphan whose exit the job supervisor sees only once it is reaped.
"""

from __future__ import annotations

import logging
import os
import sys

from fusedserve.coordinator import cli
from fusedserve.shared_memory.arena import close_all


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--ray-address" not in args:
        args = ["--ray-address", "auto", *args]
    return cli.main(["serve", *args])


def exit_now(rc: int) -> None:
    """Exit without the interpreter's teardown, once the server has released everything.

    After Ray and torch, that teardown took 0.9-2.5 s here (their C++ runtimes; every
    atexit handler was instant). Under ``ray job stop`` it overran the job supervisor's
    3 s SIGTERM grace, and the job was SIGKILLed with a warning.
    """
    close_all()  # nothing left after a clean shutdown; the atexit handler would do the same
    _stop_resource_tracker()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _stop_resource_tracker() -> None:
    """End (and reap) the ``multiprocessing`` resource tracker that the arenas' shared memory
    started: it ignores SIGTERM and would outlive this process as an orphan the job
    supervisor waits on."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        stop()


if __name__ == "__main__":
    exit_now(main())
