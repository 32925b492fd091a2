"""The Triton kernels checked against plain torch on the device they are about to run on, once per
device, before a model takes them: a GPU, a driver or a Triton release where they compile wrong
falls back to ATen with a warning instead of serving wrong tokens.

Small shapes (a few ms once compiled): paged decode attention over scattered pages with GQA,
rows of 1 to 70 tokens (several splits); prompt attention over a cached prefix and a whole
prompt; ``silu_mul``; in float32 and bf16.
"""

from __future__ import annotations

import torch

from kernels.triton.decode_attention import DecodeAttentionScratch, decode_attention
from kernels.triton.layer_ops import TritonLayerOps
from kernels.triton.prompt_attention import prompt_attention

TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 5e-2}


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               positions: list[list[int]], bs: int) -> torch.Tensor:
    """Attention of each query row over the listed positions of its table, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // k_cache.shape[1]
    for r, pos in enumerate(positions):
        slots = torch.tensor([int(tables[r, p // bs]) * bs + p % bs for p in pos], device=q.device)
        k, v = k_cache[slots].double(), v_cache[slots].double()
        for h in range(q.shape[1]):
            s = (k[:, h // group] @ q[r, h].double()) * q.shape[2] ** -0.5
            out[r, h] = torch.softmax(s, 0) @ v[:, h // group]
    return out


def _decode(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> float:
    heads, kv_heads, hd, bs, blocks = 8, 2, 64, 8, 64
    k_cache = torch.randn(blocks * bs, kv_heads, hd, generator=g).to(device, dtype)
    v_cache = torch.randn(blocks * bs, kv_heads, hd, generator=g).to(device, dtype)
    lens = [1, 70, 9, 33]
    tables = torch.randperm(blocks, generator=g)[: 4 * 9].view(4, 9).to(device, torch.int32)
    q = torch.randn(4, heads, hd, generator=g).to(device, dtype)
    out = torch.empty_like(q)
    scratch = DecodeAttentionScratch(4, heads, hd, 4, device)
    decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=device), bs,
                     hd ** -0.5, out, scratch)
    want = _reference(q, k_cache, v_cache, tables, [list(range(n)) for n in lens], bs)
    return (out.double() - want).abs().max().item()


def _prompt(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> float:
    """One decode row (not this kernel's), a 21-token prompt, and a 12-token chunk after 20 cached."""
    heads, kv_heads, hd, bs, blocks = 4, 2, 32, 4, 64
    k_cache = torch.randn(blocks * bs, kv_heads, hd, generator=g).to(device, dtype)
    v_cache = torch.randn(blocks * bs, kv_heads, hd, generator=g).to(device, dtype)
    query_lens, seq_lens = [1, 21, 12], [5, 21, 32]
    tables = torch.randperm(blocks, generator=g)[: 3 * 8].view(3, 8).to(device, torch.int32)
    qsl = torch.tensor([0, 1, 22, 34], dtype=torch.int32, device=device)
    q = torch.randn(34, heads, hd, generator=g).to(device, dtype)
    out = torch.zeros_like(q)
    prompt_attention(q, k_cache, v_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                     tables, 1, query_lens[1:], bs, hd ** -0.5, out)
    err = 0.0
    for r in (1, 2):  # each query sees its prefix and itself (causal)
        t0, n, ctx = int(qsl[r]), query_lens[r], seq_lens[r]
        rows = q[t0:t0 + n]
        want = _reference(rows, k_cache, v_cache, tables[r].expand(n, -1),
                          [list(range(ctx - n + i + 1)) for i in range(n)], bs)
        err = max(err, (out[t0:t0 + n].double() - want).abs().max().item())
    return err


def _silu_mul(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> float:
    gate_up = torch.randn(5, 2 * 96, generator=g).to(device, dtype)
    out = torch.empty(5, 96, device=device, dtype=dtype)
    TritonLayerOps(1e-6, 2, 1).silu_mul(gate_up, out)
    gate, up = gate_up.double().chunk(2, dim=-1)
    return (out.double() - torch.nn.functional.silu(gate) * up).abs().max().item()


def check(device: torch.device) -> str | None:
    """None where every kernel agrees with torch on ``device``; else what disagreed, or the
    exception a kernel raised."""
    for dtype, tol in TOLERANCE.items():
        for name, fn in (("decode attention", _decode), ("prompt attention", _prompt),
                         ("silu_mul", _silu_mul)):
            try:
                err = fn(device, dtype, torch.Generator().manual_seed(7))
            except Exception as exc:  # noqa: BLE001 - any failure means: do not use these kernels here
                return f"{name} ({dtype}) raised {type(exc).__name__}: {exc}"
            if not err <= tol:  # NaN included
                return f"{name} ({dtype}) is off by {err:.3g} (tolerance {tol})"
    return None
