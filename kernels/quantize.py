"""Weight-only int8: per-output-channel symmetric quantization of a linear layer's weight.

``w ~= q * scale[:, None]`` with ``q`` in [-127, 127] and ``scale = max|w_row| / 127``, so
each output row keeps its own range. Activations stay in the model's dtype.
"""

from __future__ import annotations

import torch


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [out, in], float32 scales [out]) for a [out, in] weight."""
    w32 = w.float()
    scale = w32.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)
