"""The matmul of every projection, chosen once per model from the device and the weights.

A weight is a 16/32-bit tensor ``[out, in]`` or an ``Int8Weight`` (weight-only int8,
per-output-channel scales). On the CPU the native kernels (``kernels/native.py``)
stream 16-bit and int8 weights with fp32 accumulation; fp32 weights and CPUs
without the native build use ATen. CUDA and Ascend use their vendor int8 ops.
Every path writes into the caller's ``out``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels.quantize import quantize_int8

log = logging.getLogger(__name__)


@dataclass
class Int8Weight:
    """``w ~= q * scale[:, None]``; ``scale_act`` is ``scale`` in the activations' dtype
    (what ATen's and the vendors' int8 matmuls take); ``q_t`` is ``q.T`` where an op wants
    [in, out] (Ascend)."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] float32
    scale_act: torch.Tensor  # [out], activation dtype
    q_t: torch.Tensor | None = None

    @classmethod
    def quantize(cls, w: torch.Tensor, act_dtype: torch.dtype, device: torch.device) -> Int8Weight:
        q, scale = quantize_int8(w)
        q, scale = q.to(device), scale.to(device)
        q_t = q.t().contiguous() if device.type == "npu" else None
        return cls(q, scale, scale.to(act_dtype), q_t)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@dataclass
class PackedWeight:
    """A bf16 or int8 weight in the native GEMM's layout ``[ceil(out/16), in/2, 16, 2]`` (one
    64-byte vector = 16 output channels x one pair of inputs), packed once at load."""

    packed: torch.Tensor
    scale: torch.Tensor | None  # [out] float32 for int8
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, w: Weight) -> PackedWeight:
        q, scale = (w.q, w.scale) if isinstance(w, Int8Weight) else (w, None)
        n, k = q.shape
        if n % 16:
            q = torch.cat([q, q.new_zeros(16 - n % 16, k)])
        return cls(q.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous(), scale, n, k)

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (0 if self.scale is None else self.scale.nbytes)


Weight = torch.Tensor | Int8Weight | PackedWeight


class LinearOp:
    """``out = x @ w.T`` for whichever kind of weight, through the kernel this device has."""

    def __init__(self, device: torch.device, native: ModuleType | None, act_dtype: torch.dtype):
        self.device = device
        self.native = native if device.type == "cpu" else None
        # The packed GEMM: AVX-512 BF16 builds, bf16 activations.
        self.packs = self.native is not None and self.native.has_packed() and act_dtype == torch.bfloat16
        # Probed once, before any graph capture could hit a missing op: ATen's int8 matmul, or
        # dequantizing per call where this build lacks it for the device and dtype.
        self.int8_op = "native" if self.native is not None else _probe_int8(device, act_dtype)

    def prepare(self, w: Weight) -> Weight:
        """The weight in the layout its kernel reads (packed where the packed GEMM runs it)."""
        if self.packs and w.shape[1] % 2 == 0 and (isinstance(w, Int8Weight) or w.dtype == torch.bfloat16):
            return PackedWeight.pack(w)
        return w

    def describe(self, weight_dtype: torch.dtype | str) -> str:
        """Which kernel runs a weight of this kind (stats and the startup log)."""
        if self.native is not None and weight_dtype != torch.float32:
            packed = "-packed" if self.packs and weight_dtype in ("int8", torch.bfloat16) else ""
            return f"native-{self.native.isa()}{packed}"
        if weight_dtype == "int8":
            return {"int8pack": "aten-int8pack", "npu": "npu-weight-quant"}.get(self.int8_op, "dequantize")
        return "aten-mm"

    def __call__(self, x: torch.Tensor, w: Weight, out: torch.Tensor) -> torch.Tensor:
        if isinstance(w, PackedWeight):
            self.native.linear_packed(x, w.packed, w.scale, out)
            return out
        if isinstance(w, Int8Weight):
            return self._int8(x, w, out)
        if self.native is not None and w.dtype != torch.float32:
            self.native.linear(x, w, None, out)
            return out
        return torch.mm(x, w.t(), out=out)

    def _int8(self, x: torch.Tensor, w: Int8Weight, out: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            self.native.linear(x, w.q, w.scale, out)
            return out
        if self.int8_op == "npu":  # pragma: no cover - needs Ascend hardware
            import torch_npu

            out.copy_(torch_npu.npu_weight_quant_batchmatmul(x, w.q_t, w.scale_act))
        elif self.int8_op == "int8pack":
            out.copy_(torch._weight_int8pack_mm(x, w.q, w.scale_act))
        else:
            torch.mm(x, (w.q.to(x.dtype) * w.scale_act[:, None]).t(), out=out)
        return out


def _probe_int8(device: torch.device, dtype: torch.dtype) -> str:
    """Which int8 matmul this device and build run: ``npu``, ``int8pack`` or ``dequantize``."""
    if device.type == "npu":
        return "npu"
    x = torch.ones(1, 64, dtype=dtype, device=device)
    q = torch.ones(8, 64, dtype=torch.int8, device=device)
    try:
        torch._weight_int8pack_mm(x, q, torch.ones(8, dtype=dtype, device=device))
        return "int8pack"
    except (RuntimeError, NotImplementedError) as exc:
        log.warning("int8 matmul unavailable on %s for %s (%s): int8 weights are dequantized per call",
                    device, dtype, exc)
        return "dequantize"
