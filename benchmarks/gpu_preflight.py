"""What a device image has, before any GPU minute is spent: every import the GPU check needs,
with its version, and the GPU itself. Exits 3 with the list of what is missing.

    python -m fusedserve.benchmarks.gpu_preflight [--no-gpu] [--json OUT]

``REQUIRED`` is what the GPU tests and benchmarks import (the offline engine, transformers as
the reference, pytest); ``OPTIONAL`` is what only other paths need (the served path's ZeroMQ
and Ray, structured outputs' llguidance): reported, not required.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from pathlib import Path

REQUIRED = ("torch", "triton", "numpy", "safetensors", "tokenizers", "transformers", "jinja2", "httpx",
            "tqdm", "huggingface_hub", "pytest", "hypothesis")
OPTIONAL = ("zmq", "msgpack", "llguidance", "ray")


def version(name: str) -> str | None:
    """The module's version, or None where it does not import."""
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure to import is "missing" here
        return None
    return str(getattr(mod, "__version__", None) or getattr(mod, "VERSION", None) or "unknown")


def check(gpu: bool) -> dict:
    found = {"python": platform.python_version()}
    found.update({name: version(name) for name in (*REQUIRED, *OPTIONAL)})
    missing = [name for name in REQUIRED if found[name] is None]
    report = {"modules": found, "missing": missing, "optional_missing": [n for n in OPTIONAL if not found[n]]}
    if gpu and found["torch"]:
        import torch

        report["cuda"] = torch.cuda.is_available()
        if report["cuda"]:
            report["gpu"] = torch.cuda.get_device_name()
            report["capability"] = list(torch.cuda.get_device_capability())
            report["cuda_version"] = torch.version.cuda
        else:
            missing.append("a CUDA device (torch.cuda.is_available() is False)")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-gpu", action="store_true", help="do not require a CUDA device (--dry-run)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    report = check(gpu=not args.no_gpu)
    for name, ver in report["modules"].items():
        print(f"{name:>16} {ver or 'MISSING'}")
    if "gpu" in report:
        print(f"{'gpu':>16} {report['gpu']} (sm_{''.join(map(str, report['capability']))}, "
              f"CUDA {report['cuda_version']})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if report["missing"]:
        print(f"preflight: missing {', '.join(report['missing'])}: carry them as wheels (README, "
              "'CUDA'), nothing else runs", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
