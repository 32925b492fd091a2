"""Explicit, probed device choice: Ascend NPU, CUDA, else CPU.

torch-npu is imported lazily and only here: without the CANN toolkit its import
fails (or breaks torch's backend autoload), which must read as "no NPU".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class DeviceUnavailable(RuntimeError):
    """The requested device kind is not present on this machine."""


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "npu" | "cuda" | "cpu"
    count: int

    def ray_resources(self, cpus_per_worker: int = 1) -> dict:
        """Ray actor options that reserve one device of this kind."""
        if self.kind == "npu":
            return {"resources": {"NPU": 1}, "num_cpus": cpus_per_worker}
        if self.kind == "cuda":
            return {"num_gpus": 1, "num_cpus": cpus_per_worker}
        return {"num_cpus": cpus_per_worker}


def npu_count() -> int:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)

        return int(torch.npu.device_count()) if torch.npu.is_available() else 0  # type: ignore[attr-defined]
    except (ImportError, RuntimeError, OSError, AttributeError) as exc:
        log.debug("no NPU: %s", exc)
        return 0


def cuda_count() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:
        return 0


def probe(kind: str = "auto") -> DeviceInfo:
    """Resolve ``auto|npu|cuda|cpu`` to a present device, or raise DeviceUnavailable."""
    if kind not in ("auto", "npu", "cuda", "cpu"):
        raise ValueError(f"unknown device {kind!r}; use auto, npu, cuda or cpu")
    if kind in ("auto", "npu"):
        n = npu_count()
        if n:
            return DeviceInfo("npu", n)
        if kind == "npu":
            raise DeviceUnavailable("device 'npu' requested but torch_npu is not importable or sees no NPU "
                                    "(install the CANN toolkit and fusedserve[npu])")
    if kind in ("auto", "cuda"):
        n = cuda_count()
        if n:
            return DeviceInfo("cuda", n)
        if kind == "cuda":
            raise DeviceUnavailable("device 'cuda' requested but torch sees no CUDA GPU")
    return DeviceInfo("cpu", 1)


def torch_device(kind: str) -> torch.device:
    """The device a worker actor uses: Ray sets *_VISIBLE_DEVICES, so index 0 is its own."""
    return torch.device("cpu" if kind == "cpu" else f"{kind}:0")
