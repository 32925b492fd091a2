"""Which kernel runs a prompt chunk's attention, by its query rows, measured on this host at load.

The native flash kernel (``kernels/native/csrc/prompt_attention.cpp``) multiplies on the vector unit
(``vdpbf16ps``). torch's SDPA (``prompt_rows``) runs its CPU flash attention on oneDNN's brgemm
micro-kernels, which take AMX-BF16 tiles where the CPU has them: on such a host its two products
can run several times faster, and a long prompt's attention is then its cost. Which wins depends
on the host, so each head layout and cache dtype is timed once, one chunk per row bucket (after a
prefix as long as itself, the masked case), native against SDPA, through the GEMM chooser
(``kernels/native/gemm_choice.py``: same buckets, margin, monotone choice and per-host cache).

Numerics. Both multiply bf16 exactly and sum in fp32, in different orders and blocks, and both
round the probabilities to bf16 for the value product, so a row may differ in the last bits of
its bf16 output. A chunk's path depends on its bucket, as a bf16 GEMM's does; ``--cpu-gemm
native`` keeps every chunk on the native kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

import torch

from fusedserve.kernels.attention.prompt_rows import PromptChunk, attend_chunks
from fusedserve.kernels.model_description.kv_layout import KV8_SCALE_BYTES
from fusedserve.kernels.native.gemm_choice import NATIVE, ROW_BUCKETS, GemmChooser

log = logging.getLogger(__name__)


def choose_prompt_attention(chooser: GemmChooser, native: ModuleType, heads: int, kv_heads: int,
                            head_dim: int, kv_cache_dtype: str, scale: float) -> tuple[bool, ...]:
    """Per row bucket (``gemm_choice.ROW_BUCKETS``), whether a prompt chunk of that many query
    tokens runs on SDPA rather than the native flash kernel (bf16 activations)."""
    on_native, on_sdpa = timed_pair(native, heads, kv_heads, head_dim, kv_cache_dtype, scale)
    kind = prompt_kind(kv_cache_dtype, kv_heads, head_dim)
    width = heads * head_dim
    paths = chooser.choose(kind, width, width, ROW_BUCKETS[-1], {NATIVE: on_native, "sdpa": on_sdpa},
                           torch.bfloat16)
    choice = tuple(p == "sdpa" for p in paths)
    if any(choice):
        log.info("prompt attention (%d heads, %d KV heads, %s cache): SDPA from %d query rows",
                 heads, kv_heads, kv_cache_dtype, ROW_BUCKETS[choice.index(True)])
    return choice


def prompt_kind(kv_cache_dtype: str, kv_heads: int, head_dim: int) -> str:
    """The chooser's name for a prompt-attention layout (its K and N: heads x head_dim)."""
    return f"prompt-attention-{'int8' if kv_cache_dtype == 'int8' else 'bf16'}-cache-kv{kv_heads}-d{head_dim}"


Attend = Callable[[torch.Tensor, torch.Tensor], None]


def timed_pair(native: ModuleType, heads: int, kv_heads: int, head_dim: int, kv_cache_dtype: str,
               scale: float) -> tuple[Attend, Attend]:
    """The two kernels as the chooser times them: ``f(x, out)`` attends one chunk of ``n =
    len(x)`` queries (``x``, ``out``: [n, heads * head_dim] bf16, n <= 512) after a prefix of n
    tokens, over one cache of random keys and values (``kv_cache_dtype``)."""
    ctx = 2 * ROW_BUCKETS[-1]
    g = torch.Generator().manual_seed(0)
    if kv_cache_dtype == "int8":
        shape = (ctx, kv_heads, head_dim + KV8_SCALE_BYTES)
        k_cache, v_cache = (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for _ in range(2))
        scales = torch.full((ctx, kv_heads, 1), 0.01, dtype=torch.float32).view(torch.int8)
        k_cache[..., head_dim:], v_cache[..., head_dim:] = scales, scales
    else:
        k_cache, v_cache = (torch.randn(ctx, kv_heads, head_dim, generator=g).bfloat16() for _ in range(2))
    block_tables = torch.arange(ctx, dtype=torch.int32)[None]  # blocks of one slot, in order
    slots = torch.arange(ctx, dtype=torch.int64)

    def on_native(x: torch.Tensor, out: torch.Tensor) -> None:
        n = x.shape[0]
        chunks = torch.tensor([[0, 0, n, 2 * n]], dtype=torch.int64)
        native.prompt_attention(x.view(n, heads, head_dim), k_cache, v_cache, block_tables, chunks, 1,
                                scale, out.view(n, heads, head_dim))

    def on_sdpa(x: torch.Tensor, out: torch.Tensor) -> None:
        n = x.shape[0]
        attend_chunks([PromptChunk(0, n, slots[: 2 * n])], x.view(n, heads, head_dim), k_cache, v_cache,
                      out.view(n, heads, head_dim), scale)

    return on_native, on_sdpa
