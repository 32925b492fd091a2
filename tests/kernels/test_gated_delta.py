"""The Gated DeltaNet's kernels: the chunked delta rule equals the recurrent one token by token
(any length, from any state), and the native decode step and prompt chunk (conv, rule, gated
norm; in place in the slots) equal the torch ones."""

from __future__ import annotations

import pytest
import torch

from fusedserve.kernels import gated_delta
from fusedserve.kernels.hybrid_cache import LayerState
from fusedserve.kernels.model_description.hybrid import LinearAttention
from fusedserve.kernels.native import build as native_build
from fusedserve.worker.model.gated_delta_net import DeltaNetOps
from fusedserve.worker.model.weights import LinearAttnWeights

H, DK, DV = 4, 16, 32


def _inputs(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, 2, DK, generator=gen) for _ in range(2))
    q, k = gated_delta.prepare_qk(q, k, H)
    v = torch.randn(n, H, DV, generator=gen)
    g = -torch.rand(n, H, generator=gen) * 2  # log decays, <= 0
    beta = torch.rand(n, H, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("length", [1, 5, 64, 130])
def test_chunked_rule_equals_token_by_token(length):
    q, k, v, g, beta = _inputs(length, length)
    start = torch.randn(H, DK, DV, generator=torch.Generator().manual_seed(9)) * 0.1
    out, state = gated_delta.chunked(q, k, v, g, beta, start)
    s, want = start.unsqueeze(0), []
    for t in range(length):
        t1 = slice(t, t + 1)
        o, s = gated_delta.recurrent(q[t1], k[t1], v[t1], g[t1], beta[t1], s)
        want.append(o[0])
    torch.testing.assert_close(out, torch.stack(want), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, s[0], atol=1e-4, rtol=1e-4)


def _layer(dtype: torch.dtype, rows: int, seed: int):
    """A layer's weights, ``rows`` rows of its projection's output (strided, as the projection
    writes them) split into (mixed, z, b, a), and 6-slot conv and recurrent pools with state."""
    la = LinearAttention(num_key_heads=2, num_value_heads=H, key_head_dim=DK, value_head_dim=DV,
                         conv_kernel=4)
    gen = torch.Generator().manual_seed(seed)
    w = LinearAttnWeights(in_proj=None, conv=torch.randn(la.conv_dim, 4, generator=gen).to(dtype),
                          dt_bias=torch.randn(H, generator=gen), neg_a=-torch.rand(H, generator=gen) * 4,
                          norm=(1 + 0.1 * torch.randn(DV, generator=gen)).to(dtype), out_proj=None)
    proj = torch.randn(rows, la.in_proj_rows + 5, generator=gen).to(dtype)
    cd, vd = la.conv_dim, la.value_dim
    parts = (proj[:, :cd], proj[:, cd : cd + vd], proj[:, cd + vd : cd + vd + H],
             proj[:, cd + vd + H : cd + vd + 2 * H])
    conv_pool = torch.randn(6, cd, 3, generator=gen).to(dtype)
    rec_pool = torch.randn(6, H, DK, DV, generator=gen) * 0.1
    return la, w, parts, conv_pool, rec_pool


@pytest.mark.skipif(native_build.require() is None, reason="no native CPU kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_step_equals_torch(dtype):
    """The native conv and step (rule inputs, rule in place, gated norm) against torch's, over rows
    in scattered slots of a pool; slots no row names are untouched."""
    native, ref = DeltaNetOps(native_build.require()), DeltaNetOps(None)
    n, slots = 3, torch.tensor([4, 0, 2])
    la, w, (mixed, z, b, a), conv_pool, rec_pool = _layer(dtype, n, 3)
    cd, vd = la.conv_dim, la.value_dim
    outs = []
    for ops in (native, ref):
        cp, rp = conv_pool.clone(), rec_pool.clone()
        conv, out = torch.empty(n, cd, dtype=dtype), torch.empty(n, vd, dtype=dtype)
        ops.conv(mixed, cp, slots, w.conv, conv)
        ops.step(la, w, 1e-6, conv, b, a, z, rp, slots, out)
        outs.append((conv, out, cp, rp))
    (c1, o1, cp1, rp1), (c2, o2, cp2, rp2) = outs
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(c1, c2, **tol)
    torch.testing.assert_close(o1, o2, **tol)
    assert torch.equal(cp1, cp2), "the conv inputs shift exactly"
    torch.testing.assert_close(rp1, rp2, atol=1e-4, rtol=1e-4)
    untouched = [1, 3, 5]
    assert torch.equal(rp1[untouched], rec_pool[untouched])
    assert torch.equal(cp1[untouched], conv_pool[untouched])


@pytest.mark.skipif(native_build.require() is None, reason="no native CPU kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 5, 64, 130])
def test_native_prompt_chunk_equals_torch(dtype, length):
    """A prompt chunk of one sequence (launch row 1, slot 3 of 6) through the native conv and
    chunked rule against torch's: outputs, the slot's conv inputs and delta-rule state; other slots
    untouched. Lengths under, at and over one 64-token block, from a non-zero state."""
    la, w, (mixed, z, b, a), conv_pool, rec_pool = _layer(dtype, length, length)
    cd, vd = la.conv_dim, la.value_dim
    slots = torch.tensor([0, 3])
    outs = []
    for ops in (DeltaNetOps(native_build.require()), DeltaNetOps(None)):
        state = LayerState(conv_pool.clone(), rec_pool.clone())
        conv, out = torch.empty(length, cd, dtype=dtype), torch.empty(length, vd, dtype=dtype)
        ops.prompt(la, w, 1e-6, mixed, b, a, z, state, slots, 1, conv, out)
        outs.append((conv, out, state.conv, state.recurrent))
    (c1, o1, cp1, rp1), (c2, o2, cp2, rp2) = outs
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(c1, c2, **tol)
    torch.testing.assert_close(o1, o2, **tol)
    assert torch.equal(cp1, cp2), "the slot keeps the last inputs exactly"
    torch.testing.assert_close(rp1, rp2, atol=1e-4, rtol=1e-4)
    untouched = [0, 1, 2, 4, 5]
    assert torch.equal(rp1[untouched], rec_pool[untouched])
    assert torch.equal(cp1[untouched], conv_pool[untouched])
    assert not torch.equal(rp1[3], rec_pool[3])


@pytest.mark.skipif(native_build.require() is None, reason="no native CPU kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels", [37, 200])
def test_native_conv_decode_and_prompt_agree_on_any_channel_count(dtype, channels):
    """The conv's SiLU runs VL channels at a time with a padded tail: a channel count that is no
    multiple of the vector (37, 200) gives torch's conv, and a prompt's tokens fed as decode rows
    one at a time give the prompt path's outputs and states bit for bit (one SiLU arithmetic)."""
    native = native_build.require()
    gen = torch.Generator().manual_seed(channels)
    x = torch.randn(5, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, 4, generator=gen).to(dtype)
    pool = torch.randn(3, channels, 3, generator=gen).to(dtype)
    slot = torch.tensor([2])
    prompt_pool, prompt_out = pool.clone(), torch.empty(5, channels, dtype=dtype)
    native.conv_prompt(x, prompt_pool, slot, 0, weight, prompt_out)
    decode_pool, rows = pool.clone(), []
    for t in range(5):
        out = torch.empty(1, channels, dtype=dtype)
        native.conv_decode(x[t : t + 1], decode_pool, slot, weight, out)
        rows.append(out)
    assert torch.equal(torch.cat(rows), prompt_out) and torch.equal(decode_pool, prompt_pool)
    want = gated_delta.conv_prompt(x, pool[2].clone(), weight)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(prompt_out, want.to(dtype), **tol)
