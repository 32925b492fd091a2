"""LoRA updates of a launch's tokens as two Triton kernels (punica's BGMV, per token): every token
reads its own slot's adapter, so one launch of each kernel serves rows of any mix of adapters.

- ``_shrink_kernel``: one program per (token, part): ``u[t, j*R:(j+1)*R] = A_s[j*R:(j+1)*R] @ x[t]``
  in float32, K in tiles.
- ``_expand_kernel``: one program per (token, block of output columns): ``y[t, o] += u[t, j(o)*R +
  c] * Bt_s[c, o]`` summed over c, j(o) the part column o belongs to; accumulated in float32 and
  rounded once into ``y``.

A token whose slot is -1, or whose slot's adapter leaves this projection alone (``active``), is
left bit for bit. The layout is the worker's pool's (``worker/lora_pool.py``): A ``[slots, parts *
R, K]`` with part j at rows j*R, B transposed ``[slots, R, N]``; ``u`` is a float32 scratch
``[tokens, parts * R]`` the pool allocates once. The kernels use only ``tl`` operations present in
Triton 3.6 and 3.9.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

BLOCK_K = 64
BLOCK_N = 128


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, u_ptr, slots_ptr, active_ptr, K, stride_x, stride_as, stride_u,
                   R: tl.constexpr, R_P: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.load(slots_ptr + t)
    if s >= 0:
        if tl.load(active_ptr + s) != 0:
            r = tl.arange(0, R_P)
            acc = tl.zeros([R_P], dtype=tl.float32)
            rows = a_ptr + s.to(tl.int64) * stride_as + (j * R + r[:, None]).to(tl.int64) * K
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                xk = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
                a = tl.load(rows + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)
                acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
            tl.store(u_ptr + t * stride_u + j * R + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(y_ptr, bt_ptr, u_ptr, slots_ptr, active_ptr, N, P1, P2, stride_y, stride_bs, stride_u,
                   R: tl.constexpr, R_P: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    s = tl.load(slots_ptr + t)
    if s >= 0:
        if tl.load(active_ptr + s) != 0:
            o = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            c = tl.arange(0, R_P)
            part = (o >= P1).to(tl.int32) + (o >= P2).to(tl.int32)  # the part each column belongs to
            mask = (c[:, None] < R) & (o[None, :] < N)
            u = tl.load(u_ptr + t * stride_u + part[None, :] * R + c[:, None], mask=mask, other=0.0)
            bs = bt_ptr + s.to(tl.int64) * stride_bs
            b = tl.load(bs + c[:, None] * N + o[None, :], mask=mask, other=0.0)
            delta = tl.sum(u * b.to(tl.float32), axis=0)
            yo = y_ptr + t * stride_y + o
            y = tl.load(yo, mask=o < N, other=0.0).to(tl.float32)
            tl.store(yo, (y + delta).to(y_ptr.dtype.element_ty), mask=o < N)


def lora_apply(x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
               parts: list[int], active: torch.Tensor, u: torch.Tensor) -> None:
    """``y[t] += B_s A_s x[t]`` for each token ``t`` of slot ``s = slots[t]`` (see the module
    docstring); ``parts``: each part's first output column, then the width (at most 3 parts);
    ``u``: float32 scratch of at least ``[T, parts * R]``."""
    n_tok, k = x.shape
    n, r, p = y.shape[1], bt.shape[1], len(parts) - 1
    if not n_tok:
        return
    bounds = [*parts[1:-1], n, n][:2]  # P1, P2: where parts 1 and 2 begin (n: no such part)
    r_p = triton.next_power_of_2(r)
    _shrink_kernel[(n_tok, p)](x, a, u, slots, active, k, x.stride(0), a.stride(0), u.stride(0),
                               R=r, R_P=r_p, BLOCK_K=BLOCK_K)
    _expand_kernel[(n_tok, triton.cdiv(n, BLOCK_N))](y, bt, u, slots, active, n, bounds[0], bounds[1],
                                                     y.stride(0), bt.stride(0), u.stride(0), R=r, R_P=r_p,
                                                     BLOCK_N=BLOCK_N)
