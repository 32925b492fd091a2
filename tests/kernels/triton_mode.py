"""How a Triton test module runs its kernels: compiled on CUDA under ``FUSEDSERVE_TRITON_COMPILED=1``
(``benchmarks/gpu_check.sh``), else on the CPU under Triton's interpreter. Call ``choose()`` at the
top of a test module, before anything imports triton: the interpreter is chosen at that import."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch


def choose() -> bool:
    """True: compiled, on CUDA. Skips the calling module where triton is missing, or was imported
    before the interpreter could be chosen."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed", allow_module_level=True)
    compiled = os.environ.get("FUSEDSERVE_TRITON_COMPILED") == "1" and torch.cuda.is_available()
    if not compiled:
        if "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"
        elif os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton was imported before the interpreter could be chosen", allow_module_level=True)
    return compiled
