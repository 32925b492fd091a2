"""A pooled row as the API serves it: an embedding (Matryoshka-truncated, L2-normalised) or a
relevance score. The worker hands back raw float32 rows; what a request asks of them is applied
here, on the host, per request."""

from __future__ import annotations

import numpy as np

from fusedserve.coordinator.errors import RequestError


def embedding(pooled: np.ndarray, dimensions: int | None = None, normalize: bool = True) -> np.ndarray:
    """The first ``dimensions`` values (all when None), renormalised to unit length: Qwen3-Embedding
    is trained Matryoshka-style, so a prefix of its vector is itself an embedding."""
    if dimensions is not None and not 1 <= dimensions <= pooled.shape[-1]:
        raise RequestError("bad_param", f"dimensions must be in [1, {pooled.shape[-1]}] for this model, got "
                           f"{dimensions}")
    v = np.asarray(pooled[:dimensions] if dimensions is not None else pooled, dtype=np.float32)
    if not normalize:
        return v.copy()
    norm = float(np.linalg.norm(v.astype(np.float64)))
    return (v / max(norm, 1e-12)).astype(np.float32)


def score(pooled: np.ndarray) -> float:
    """A relevance in [0, 1]: sigmoid of a one-label head (a reranker's yes/no logit difference),
    else the softmax probability of the last label (a binary classifier's positive one)."""
    x = np.asarray(pooled, dtype=np.float64)
    if x.shape[-1] == 1:
        return float(1.0 / (1.0 + np.exp(-x[0])))
    e = np.exp(x - x.max())
    return float(e[-1] / e.sum())
