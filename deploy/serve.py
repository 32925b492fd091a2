"""Ray job entry point.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m deploy.serve --model default --workers auto

Connects to the running cluster, places one worker per device it reports (every
NPU/GPU, or one CPU worker per node), serves the ZeroMQ front end and logs the
address clients should use. ``ray job stop`` sends SIGTERM: in-flight requests get
an error, workers stop and every shared-memory segment is unlinked.
"""

from __future__ import annotations

import sys

from coordinator import cli


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--ray-address" not in args:
        args = ["--ray-address", "auto", *args]
    return cli.main(["serve", *args])


if __name__ == "__main__":
    sys.exit(main())
