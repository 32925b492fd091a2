"""What one token's K/V row holds, per cache dtype: what the KV cache is sized from, in the
coordinator (``coordinator/engine/kv_sizing.py``) and on the worker (``kernels/kv_cache.py``)."""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype
KV8_SCALE_BYTES = 4  # an int8 row's float32 scale, after its values


def kv_element(dtype: torch.dtype, kv_cache_dtype: str) -> tuple[torch.dtype, int]:
    """The cache's element type and the extra elements per head row (an int8 row's scale)."""
    if kv_cache_dtype == "int8":
        return torch.int8, KV8_SCALE_BYTES
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    return dtype, 0
