"""Weights and the KV cache on transparent huge pages (``kernels/host_memory.py``)."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from fusedserve.kernels.host_memory import HUGE_PAGE, huge_page_empty, on_huge_pages

# A Linux kernel built with transparent huge pages (else madvise refuses the advice: 4 KiB pages).
THP = "/sys/kernel/mm/transparent_hugepage/enabled"
LINUX_ADVICE = hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists(THP)
needs_thp_advice = pytest.mark.skipif(not LINUX_ADVICE, reason="no transparent huge pages (Linux's)")


def _mapping(addr: int) -> dict | None:
    """The /proc/self/smaps entry whose range holds ``addr``: its range and VmFlags."""
    entry = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                entry = {"lo": lo, "hi": hi} if lo <= addr < hi else None
            elif entry is not None and line.startswith("VmFlags:"):
                entry["flags"] = line.split()[1:]
                return entry
    return None


@needs_thp_advice
def test_a_large_tensor_starts_on_a_huge_page_boundary_of_an_advised_private_map():
    t = huge_page_empty((3, HUGE_PAGE // 2 + 100), torch.bfloat16)
    assert t.shape == (3, HUGE_PAGE // 2 + 100) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(1.5)
    assert bool((t == 1.5).all())
    m = _mapping(t.data_ptr())
    assert m is not None and "hg" in m["flags"], "advised MADV_HUGEPAGE"
    assert "sh" not in m["flags"], "private: a shared map's huge pages follow shmem_enabled"
    end = _mapping(t.data_ptr() + t.nbytes - 1)
    assert end is not None and "hg" in end["flags"], "the whole tensor is advised"


@needs_thp_advice
def test_the_map_goes_with_the_tensor():
    t = huge_page_empty((HUGE_PAGE * 2,), torch.uint8)
    addr = t.data_ptr()
    view = t[HUGE_PAGE:]
    del t
    gc.collect()
    assert _mapping(addr) is not None, "a view keeps the map"
    del view
    gc.collect()
    assert _mapping(addr) is None, "unmapped with its last view"


def test_small_tensors_and_copies():
    small = huge_page_empty((4, 8), torch.float32)
    assert small.shape == (4, 8)
    x = torch.randn(1024, 1024)
    y = on_huge_pages(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    tiny = torch.randn(10)
    assert on_huge_pages(tiny) is tiny


@needs_thp_advice
def test_packed_weights_and_the_kv_cache_land_on_advised_memory():
    from fusedserve.coordinator.model_files.default_model import default_model_dir
    from fusedserve.kernels.kv_cache import PagedKVCache
    from fusedserve.kernels.linear import LinearOp, PackedWeight
    from fusedserve.kernels.model_description.config import Qwen3Config
    from fusedserve.kernels.native import build as native

    cache = PagedKVCache(Qwen3Config.from_dir(default_model_dir("tiny")), 512, 16, torch.bfloat16)
    assert cache.data.data_ptr() % HUGE_PAGE == 0 and not cache.data.any()
    assert "hg" in _mapping(cache.data.data_ptr())["flags"]
    build = native.kernels()
    if build is None or not build.has_packed():
        pytest.skip("no packed native GEMM on this host")
    w = torch.randn(2048, 1024).to(torch.bfloat16)
    op = LinearOp(torch.device("cpu"), build, torch.bfloat16, True, "native")
    p = op.prepare(w)
    assert isinstance(p, PackedWeight) and p.packed.data_ptr() % HUGE_PAGE == 0
    assert "hg" in _mapping(p.packed.data_ptr())["flags"]
    x = torch.randn(3, 1024).to(torch.bfloat16)
    out = torch.empty(3, 2048, dtype=torch.bfloat16)
    op(x, p, out)
    torch.testing.assert_close(out.float(), x.float() @ w.float().t(), atol=0.1, rtol=0.02)
