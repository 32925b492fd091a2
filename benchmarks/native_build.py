"""A cold build of the native CPU kernels: what a fresh machine's first run waits for.

    python -m fusedserve.benchmarks.native_build [--baseline REV] [--runs 3]

Each run builds in an empty extension cache of its own (a subprocess, so nothing is loaded or
cached from an earlier run), for this CPU's best instruction set; ``--baseline REV`` builds the
``kernels/native/csrc`` of a git revision the same way, interleaved, so both are measured on the
same machine in the same minutes. Figures: wall seconds, median (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fusedserve.benchmarks.common import fmt, machine, spread

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "kernels" / "native" / "csrc"
BUILD = ("import sys; from pathlib import Path; from fusedserve.kernels.native import build as b; "
         "m = b.build(b.chosen_isa(), Path(sys.argv[1]), 'fusedserve_cold'); print(m.isa())")


def cold_build(csrc: Path) -> float:
    """Seconds to build ``csrc`` into an empty cache."""
    with tempfile.TemporaryDirectory(prefix="fusedserve_cold_") as cache:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": cache, "MAX_JOBS": str(os.cpu_count() or 1)}
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD, str(csrc)], env=env, check=True, capture_output=True,
                       text=True)
        return time.perf_counter() - t0


def checkout(rev: str, out: Path) -> Path:
    """``kernels/native/csrc`` as it was at ``rev``."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:kernels/native/csrc"],
                           check=True, capture_output=True, text=True).stdout.split()
    out.mkdir(parents=True, exist_ok=True)
    for name in files:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kernels/native/csrc/{name}"],
                              check=True, capture_output=True).stdout
        (out / name).write_bytes(blob)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline", default=None, help="a git revision whose csrc is built beside this one")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"this tree": CSRC}
        if args.baseline:
            variants[f"baseline {args.baseline}"] = checkout(args.baseline, Path(tmp) / "baseline")
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.runs):
            for name, csrc in variants.items():
                times[name].append(cold_build(csrc))
    result = {name: spread(ts) for name, ts in times.items()}
    for name, s in result.items():
        print(f"{name:>24}: cold build {fmt(s)} s")
    print(json.dumps({k: v for k, v in result.items()}))
    return result


if __name__ == "__main__":
    main()
