"""Weight quantization at load, from a 16-bit checkpoint.

- int8: per output channel, symmetric: ``w ~= q * scale[:, None]`` with ``q`` in [-127, 127] and
  ``scale = max|w_row| / 127``, so each output row keeps its own range.
- int4: per group of 32 inputs of an output channel (llama.cpp's Q4_0 scheme): the group's
  value of largest magnitude ``m`` sets ``d = m / -8`` and ``q = clamp(round(w / d), -8, 7)``, so
  the extreme value is exact and 16 levels are used; stored as ``u = q + 8`` in [0, 15].

The kernels quantize activations themselves, per token, when they multiply.
"""

from __future__ import annotations

import torch

INT4_GROUP = 32


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [out, in], float32 scales [out]) for a [out, in] weight."""
    w32 = w.float()
    scale = w32.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 ``u`` [out, G * 32] in [0, 15], fp16 scales [out, G]) for a [out, in] weight; the
    inputs are padded with zeros to whole groups (G = ceil(in / 32))."""
    n, k = w.shape
    w32 = w.float()
    if k % INT4_GROUP:
        w32 = torch.cat([w32, w32.new_zeros(n, INT4_GROUP - k % INT4_GROUP)], 1)
    g = w32.view(n, -1, INT4_GROUP)
    extreme = g.gather(2, g.abs().argmax(2, keepdim=True))  # signed value of largest magnitude
    d = (extreme / -8.0).to(torch.float16).float()  # as stored: the kernels read fp16 scales
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(g / safe).clamp_(-8, 7)
    return (q + 8).to(torch.uint8).view(n, -1), d.squeeze(2).to(torch.float16)


def dequantize_int4(u: torch.Tensor, d: torch.Tensor, in_features: int, dtype: torch.dtype,
                    z: torch.Tensor | None = None) -> torch.Tensor:
    """``(u - z) * d`` per group (``z`` 8 where None), the padding cut."""
    n = u.shape[0]
    zero = 8.0 if z is None else z.float()[:, :, None]
    w = (u.float().view(n, -1, INT4_GROUP) - zero) * d.float()[:, :, None]
    return w.view(n, -1)[:, :in_features].to(dtype)
