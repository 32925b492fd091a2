"""The Triton kernels checked against plain torch on the device they are about to run on, once per
device, before a model takes them: a GPU, a driver or a Triton release where they compile wrong
falls back to ATen with a warning instead of serving wrong tokens.

Small shapes (a few ms once compiled): paged decode attention over scattered pages with GQA,
rows of 1 to 70 tokens (several splits); prompt attention over a cached prefix and a whole
prompt; ``silu_mul``; in float32 and bf16. The sampler: rows on every path (greedy, candidates,
whole vocabulary with top-k beyond the candidates, top-p, min-p) draw ATen's tokens.
"""

from __future__ import annotations

import torch

from fusedserve.kernels import sampler as aten_sampler
from fusedserve.kernels.triton import sampler as triton_sampler
from fusedserve.kernels.triton.decode_attention import DecodeAttentionScratch, decode_attention
from fusedserve.kernels.triton.layer_ops import TritonLayerOps
from fusedserve.kernels.triton.prompt_attention import prompt_attention

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


# (temperature, top_p, min_p, top_k) per row kind: every path and stage of the sampler.
SAMPLER_ROWS = ((0.0, 1.0, 0.0, 0), (0.7, 1.0, 0.0, 5), (1.0, 0.9, 0.0, 0), (1.3, 0.5, 0.05, 0),
                (0.9, 1.0, 0.1, 0), (1.1, 0.95, 0.0, 100), (0.8, 0.999, 0.0, 16), (2.0, 0.3, 0.0, 1),
                (1.0, 0.9, 0.0, 3000), (0.5, 0.8, 0.02, 12))


def sampler_batch(rows: int, vocab: int, g: torch.Generator, device: torch.device) -> tuple:
    """(logits, params, seeds) of ``rows`` rows cycling through ``SAMPLER_ROWS``: logits at three
    scales (peaked to flat, so top-p is placed among the candidates or needs the whole row)."""
    scale = torch.tensor([4.0, 1.0, 0.3])[torch.arange(rows) % 3][:, None]
    logits = torch.randn(rows, vocab, generator=g) * scale
    params = torch.tensor([SAMPLER_ROWS[r % len(SAMPLER_ROWS)] for r in range(rows)], dtype=torch.float32)
    seeds = torch.stack([torch.arange(rows) * 7919 + 1, torch.arange(rows) + 11], 1)
    return logits.to(device), params.to(device), seeds.to(device)


def sampler_mismatches(device: torch.device, rows: int = 40, vocab: int = 3000, candidates: int = 16) -> int:
    """Rows whose Triton draw differs from ATen's on ``device`` (a probability can differ in its
    last bit, so a draw right at a boundary may; on these rows none does on the CPU)."""
    logits, params, seeds = sampler_batch(rows, vocab, torch.Generator().manual_seed(3), device)
    plan = aten_sampler.SamplingPlan.for_rows(params.cpu().numpy(), candidates, vocab)
    out = [torch.zeros(rows, dtype=torch.int32, device=device) for _ in range(2)]
    aten_sampler.sample(logits, params, seeds, out[0], plan, candidates)
    triton_sampler.sample(logits, params, seeds, out[1], plan, candidates)
    return int((out[0] != out[1]).sum())


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
    try:
        wrong = sampler_mismatches(device)
    except Exception as exc:  # noqa: BLE001
        return f"the sampler raised {type(exc).__name__}: {exc}"
    if wrong > 1:
        return f"the sampler drew {wrong} of 40 rows differently from ATen's"
    return None
