"""torch_npu's fused ops in the kernel roles (issue: the decode step at the bandwidth limit).

Importable without torch_npu: nothing here imports it at module level, and ``available()`` says
whether an NPU is usable. Chosen on Ascend with ``FUSEDSERVE_ASCEND_FUSED=1``
(``kernels/backend_table.py``) until an NPU run has checked them; ATen's ops stay the default there.
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """Whether torch_npu is installed and sees an NPU (its import needs CANN: guarded)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except (ImportError, RuntimeError, OSError, AttributeError):
        return False
