"""The native CPU backend (``csrc/``, built per instruction set by ``build.py`` beside it):
one fused pass per row (add + norm), per head (norm + rotary + cache write) and per row of the
MLP (SiLU x up); decode rows read K/V in place from the pages (``attention.cpp``: online softmax
in fp32, GQA, cost per row's own length); prompt chunks by ``prompt_attention.cpp`` (flash style
over the pages, AVX-512 BF16 builds, bf16 activations), else through ``prompt_rows`` (SDPA), which
also takes the chunk sizes where it measured faster on this host (``attention/prompt_choice.py``:
AMX through oneDNN)."""

from __future__ import annotations

from types import ModuleType

import torch

from fusedserve.kernels.attention.prompt_rows import PromptChunk, attend_chunks, plan_chunk
from fusedserve.kernels.forward_batch import ForwardBatch
from fusedserve.kernels.layer_ops import NormScratch
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.kernels.native import build as native_build
from fusedserve.kernels.native.gemm_choice import ROW_BUCKETS, GemmChooser, bucket
from fusedserve.kernels.native.prompt_choice import choose_prompt_attention
from fusedserve.kernels.sampler import Sampler, sample

NAME = "native"
CAPTURABLE = True


def usable(device: torch.device) -> bool:
    return device.type == "cpu" and native_build.kernels() is not None


def token_sampler() -> Sampler:
    return sample


def attention_name() -> str:
    return f"native-{native_build.kernels().isa()}"


def layer_ops(c: Qwen3Config, device: torch.device) -> NativeLayerOps:
    build = native_build.kernels()
    return NativeLayerOps(build, c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads)


def attention(c: Qwen3Config, dtype: torch.dtype, device: torch.device, max_batch: int, max_ctx: int,
              block_size: int, kv_cache_dtype: str = "auto",
              chooser: GemmChooser | None = None) -> NativeAttention:
    """``chooser``: where given, prompt chunks take SDPA at the sizes where it measured faster."""
    build = native_build.kernels()
    scale = c.head_dim ** -0.5
    flash = dtype == torch.bfloat16 and c.head_dim % 16 == 0 and build.has_prompt_attention()
    sdpa_rows: tuple[bool, ...] = ()
    if flash and chooser is not None:
        sdpa_rows = choose_prompt_attention(chooser, build, c.num_attention_heads, c.num_key_value_heads,
                                            c.head_dim, kv_cache_dtype, scale)
    return NativeAttention(build, scale, flash, sdpa_rows)


class NativeLayerOps:
    """One pass per row (add + norm), per head (norm + rotary + cache write) and per row of the
    MLP (SiLU x up): ``kernels/native/csrc/norm.cpp``."""

    def __init__(self, native: ModuleType, eps: float, heads: int, kv_heads: int):
        self.native, self.eps, self.heads, self.kv_heads = native, eps, heads, kv_heads

    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor,
                     out: torch.Tensor, buf: NormScratch) -> None:
        """``x += add`` (if given), then ``out = rms_norm(x) * weight``."""
        self.native.add_rms_norm(x, add, weight, self.eps, out)

    def qk_norm_rope(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, buf: NormScratch,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """q heads of ``qkv`` normed and rotated into ``q_out`` [n, heads, hd]; k heads in place;
        each token's k and v heads into row ``slot_mapping[t]`` of the caches."""
        self.native.qk_norm_rope(qkv, q_weight, k_weight, cos, sin, self.eps, q_out, self.heads,
                                 self.kv_heads, k_cache, v_cache, slot_mapping)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """``out = silu(gate) * up`` for ``gate_up = [gate, up]``."""
        self.native.silu_mul(gate_up, out)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """``logits[b, v] = -inf`` where bit v of ``bitmask[b]`` is clear (one pass, in place)."""
        self.native.apply_token_bitmask(logits, bitmask)


class NativeAttention:
    """Decode rows by ``decode_attention``; prompt chunks by the flash-style ``prompt_attention``
    where the build has it (AVX-512 BF16) and activations are bf16 with head_dim a multiple of 16,
    else through ``prompt_rows`` (SDPA per chunk). ``sdpa_rows``: per row bucket, whether a chunk
    of that many queries takes SDPA anyway (measured faster here); empty: never."""

    def __init__(self, native: ModuleType, scale: float, flash: bool, sdpa_rows: tuple[bool, ...] = ()):
        self.native, self.scale, self.flash, self.sdpa_rows = native, scale, flash, sdpa_rows
        self._batch: ForwardBatch | None = None
        self._block_size = 0
        self._chunks: list[PromptChunk] = []
        self._flash_chunks: torch.Tensor | None = None
        self._decode_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def sdpa_from(self) -> int | None:
        """The fewest query rows of a prompt chunk that SDPA takes (None: the flash kernel takes
        every chunk it can), for ``stats`` to name."""
        if not (self.flash and any(self.sdpa_rows)):
            return None
        return ROW_BUCKETS[self.sdpa_rows.index(True)]

    def begin(self, batch: ForwardBatch, block_size: int) -> None:
        self._batch, self._block_size = batch, block_size
        self._chunks, self._flash_chunks = [], None
        nd = batch.num_decode  # the decode rows' tables, sliced once a launch rather than per layer
        self._decode_tables = (batch.block_tables[:nd], batch.seq_lens[:nd]) if nd else None
        if not batch.prompt_query_lens:
            return
        flash, start = [], batch.num_decode  # (block-table row, first query, queries, context)
        for i, (n, ctx) in enumerate(zip(batch.prompt_query_lens, batch.prompt_seq_lens, strict=True)):
            if self.flash and not (self.sdpa_rows and self.sdpa_rows[bucket(n)]):
                flash.append((batch.num_decode + i, start, n, ctx))
            else:
                self._chunks.append(plan_chunk(batch, i, start, block_size))
            start += n
        if flash:
            self._flash_chunks = torch.tensor(flash, dtype=torch.int64)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> None:
        b, nd = self._batch, self._batch.num_decode
        if self._decode_tables is not None:
            tables, lens = self._decode_tables
            whole = q.shape[0] == nd  # else prompt rows follow the decode rows
            self.native.decode_attention(q if whole else q[:nd], k_cache, v_cache, tables, lens,
                                         self._block_size, self.scale, out if whole else out[:nd])
        if self._flash_chunks is not None:
            self.native.prompt_attention(q, k_cache, v_cache, b.block_tables, self._flash_chunks,
                                         self._block_size, self.scale, out)
        if self._chunks:
            attend_chunks(self._chunks, q, k_cache, v_cache, out, self.scale)
