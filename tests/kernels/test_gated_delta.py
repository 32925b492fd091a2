"""The Gated DeltaNet's kernels: the chunked delta rule equals the recurrent one token by token
(any length, from any state), and the native decode step (conv, rule; in place in the slots)
equals the torch one."""

from __future__ import annotations

import pytest
import torch

from fusedserve.kernels import gated_delta
from fusedserve.kernels.native import build as native_build
from fusedserve.worker.model.gated_delta_net import DecodeOps

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


@pytest.mark.skipif(native_build.require() is None, reason="no native CPU kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_step_equals_torch(dtype):
    native, ref = DecodeOps(native_build.require()), DecodeOps(None)
    n, slots = 3, torch.tensor([4, 0, 2])
    q, k, v, g, beta = _inputs(n, 1)
    pools = torch.randn(6, H, DK, DV) * 0.1
    a, b = pools.clone(), pools.clone()
    out_a, out_b = torch.empty(n, H, DV), torch.empty(n, H, DV)
    native.rule(q, k, v, g, beta, a, slots, out_a)
    ref.rule(q, k, v, g, beta, b, slots, out_b)
    torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # only the rows' slots changed, alike
    assert torch.equal(a[[1, 3, 5]], pools[[1, 3, 5]])
    c = 24
    x = torch.randn(n, 2 * c).to(dtype)[:, :c]  # strided rows, as the fused projection's
    weight, conv = torch.randn(c, 4).to(dtype), torch.randn(6, c, 3).to(dtype)
    ca, cb = conv.clone(), conv.clone()
    ya, yb = torch.empty(n, c, dtype=dtype), torch.empty(n, c, dtype=dtype)
    native.conv(x, ca, slots, weight, ya)
    ref.conv(x, cb, slots, weight, yb)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ya, yb, **tol)
    assert torch.equal(ca, cb), "the inputs shift exactly"
