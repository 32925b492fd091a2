"""The native LoRA kernel (``lora_apply``): every slot's update of one projection in one call, against
a float64 reference per token, on every ISA build this CPU runs: tokens of several adapters and of
none mixed, a slot whose adapter leaves the projection alone, parts of the output (q/k/v) each
expanded from its own columns of the shrink, widths past the last full vector and an odd rank
(the bf16 build's pairs need an even one: the generic path then)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_native_kernels import _isas, _module


def _reference(x, y, slots, a, bt, parts, active):
    out = y.double().clone()
    r = bt.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s < 0 or not active[s]:
            continue
        u = a[s].double() @ x[t].double()  # [parts * rank]
        for j in range(len(parts) - 1):
            cols = slice(parts[j], parts[j + 1])
            out[t, cols] += u[j * r : (j + 1) * r] @ bt[s, :, cols].double()
    return out


SHAPES = [(16, 256, [128, 64, 64]), (5, 100, [40, 9]), (8, 96, [72])]


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rank", "k", "widths"), SHAPES)
def test_every_slots_update_in_one_call_equals_the_reference(isa, dtype, rank, k, widths):
    m = _module(isa)
    g = torch.Generator().manual_seed(rank + k)
    n_slots, parts = 4, [sum(widths[:j]) for j in range(len(widths) + 1)]
    x = torch.randn(11, k, generator=g).to(dtype)
    y = torch.randn(11, parts[-1], generator=g).to(dtype)
    slots = torch.tensor([0, -1, 2, 0, 1, 3, -1, 2, 0, 0, 1], dtype=torch.int32)
    a = (torch.randn(n_slots, len(widths) * rank, k, generator=g) / k ** 0.5).to(dtype)
    bt = torch.randn(n_slots, rank, parts[-1], generator=g).to(dtype)
    active = torch.tensor([1, 1, 1, 0], dtype=torch.uint8)  # slot 3's adapter: not this projection
    want = _reference(x, y, slots, a, bt, parts, active)
    m.lora_apply(x, y, slots, a, bt, parts, active)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: u and the sum rounded as a bf16 matmul's
    torch.testing.assert_close(y.double(), want, atol=tol * want.abs().max().item(), rtol=tol)
    untouched = (slots < 0) | (slots == 3)
    assert torch.equal(y[untouched].double(), want[untouched])  # base rows: not one bit changed


def test_rows_of_a_strided_output_are_updated_in_place():
    m = _module(_isas()[0]) if _isas() else pytest.skip("no native build")
    x = torch.randn(3, 64)
    full = torch.zeros(3, 200)
    y = full[:, 8:136]  # rows of a wider buffer, as the workspace's views are
    a, bt = torch.randn(1, 8, 64), torch.randn(1, 8, 128)
    m.lora_apply(x, y, torch.zeros(3, dtype=torch.int32), a, bt, [0, 128], torch.ones(1, dtype=torch.uint8))
    torch.testing.assert_close(y, (x @ a[0].T) @ bt[0], atol=1e-4, rtol=1e-4)
    assert not full[:, :8].any() and not full[:, 136:].any()
