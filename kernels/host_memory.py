"""Host tensors on transparent huge pages, where Linux grants them.

A batch-1 decode step streams every weight once (1.2 GB for Qwen3-0.6B in bf16) and a long
context streams its KV cache; on 4 KiB pages that is ~300,000 page-table walks a step, which a
virtual machine's nested paging makes dear. Linux backs anonymous memory with 2 MiB pages when it
is advised so (``MADV_HUGEPAGE``, honoured with ``transparent_hugepage/enabled`` at ``madvise``
or ``always``) before the pages are first touched; torch's allocator gives no such advice (unless
``THP_MEM_ALLOC_ENABLE`` was set before torch was imported). So the weights the native GEMMs read
and the paged KV cache live in anonymous maps advised before their first write. Measured on a
2-core Zen 5 VM (BENCHMARKS.md's host): batch-1 decode 1.05x, batch 64 1.02x.

Where ``madvise`` or the constant is missing (not Linux), these are plain ``torch.empty``.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20


def huge_page_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` starting on a 2 MiB boundary of a fresh anonymous
    map advised to huge pages (its own memory: freed with the tensor). Below 2 MiB, or without
    ``MADV_HUGEPAGE``, a plain ``torch.empty``."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None:
        return torch.empty(shape, dtype=dtype)
    # A fresh map is page-aligned, not 2 MiB-aligned: take 2 MiB more and start at the boundary.
    # Private: a shared anonymous map is shmem, whose huge pages follow another switch (shmem_enabled).
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(m, dtype=torch.uint8)  # keeps the map alive as long as any view
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        m.madvise(advice, start, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    except OSError as exc:  # a kernel without transparent huge pages: 4 KiB pages, as before
        log.debug("MADV_HUGEPAGE refused (%s): 4 KiB pages", exc)
    return raw[start : start + nbytes].view(dtype).view(shape)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` in ``huge_page_empty`` memory (``t`` itself when it
    is smaller than a huge page)."""
    if t.device.type != "cpu" or t.nbytes < HUGE_PAGE:
        return t
    return huge_page_empty(t.shape, t.dtype).copy_(t)
