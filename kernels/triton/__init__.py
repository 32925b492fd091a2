"""Triton kernels for CUDA: the layer ops, paged decode and prompt attention, and the sampler.

Importable without triton: ``available()`` says whether it is installed. Tested on the CPU
under ``TRITON_INTERPRET=1`` and compiled ahead of time for sm_90 (tests/kernels/test_triton_kernels.py).
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """Whether triton is installed here (its kernels need a GPU, or the interpreter)."""
    return importlib.util.find_spec("triton") is not None
