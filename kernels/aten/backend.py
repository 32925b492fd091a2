"""The ATen backend (CUDA, Ascend, and CPUs without the native build): the layer ops as ATen's
ops over float32 scratch (eight ops a norm), and attention whose decode rows gather each
sequence's context slots from its block table into a scratch buffer once per layer and run a
masked grouped-query attention there: fixed shapes, so a captured graph replays it. Prompt
chunks go through ``prompt_rows``."""

from __future__ import annotations

import torch

from fusedserve.kernels import sampler
from fusedserve.kernels.attention.prompt_rows import PromptChunk, attend_chunks, plan_chunks
from fusedserve.kernels.forward_batch import ForwardBatch
from fusedserve.kernels.layer_ops import NormScratch, rms_norm, rotary
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.kernels.native.gemm_choice import GemmChooser
from fusedserve.kernels.sampler import Sampler, sample

NAME = "aten"
CAPTURABLE = True


def usable(device: torch.device) -> bool:
    return True


def token_sampler() -> Sampler:
    return sample


def attention_name() -> str:
    return "aten-gather"


def layer_ops(c: Qwen3Config, device: torch.device) -> TorchLayerOps:
    return TorchLayerOps(c.rms_norm_eps, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                         c.head_dim, device)


def attention(c: Qwen3Config, dtype: torch.dtype, device: torch.device, max_batch: int, max_ctx: int,
              block_size: int, kv_cache_dtype: str = "auto",
              chooser: GemmChooser | None = None) -> TorchAttention:
    scratch = AttentionScratch(max_batch, max_ctx, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                               block_size, dtype, device)
    return TorchAttention(scratch, c.head_dim ** -0.5)


class TorchLayerOps:
    """ATen's ops over the layer buffers' float32 scratch (eight ops a norm)."""

    def __init__(self, eps: float, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 device: torch.device):
        f32 = {"dtype": torch.float32, "device": device}
        # 0-dim constants: a Python scalar operand would be boxed into a new tensor per op.
        self.eps = torch.tensor(eps, **f32)
        self.inv_hidden = torch.tensor(1.0 / hidden, **f32)
        self.inv_head = torch.tensor(1.0 / head_dim, **f32)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.bit_table = sampler.bit_table(device)

    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor,
                     out: torch.Tensor, buf: NormScratch) -> None:
        if add is not None:
            x.add_(add)
        n = x.shape[0]
        rms_norm(x, weight, self.eps, out, buf.f32_h[:n], buf.var_h[:n], self.inv_hidden)

    def qk_norm_rope(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, buf: NormScratch,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        n, nh, nkv, hd = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        q = qkv[:, : nh * hd].view(n, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].view(n, nkv, hd)
        rms_norm(q, q_weight, self.eps, q_out, buf.f32_q[:n], buf.var_q[:n], self.inv_head)
        rms_norm(k, k_weight, self.eps, k, buf.f32_k[:n], buf.var_k[:n], self.inv_head)
        cos3, sin3 = cos.unsqueeze(1), sin.unsqueeze(1)
        rotary(q_out, cos3, sin3, buf.rot_q[:n])
        rotary(k, cos3, sin3, buf.rot_k[:n])
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, qkv[:, (nh + nkv) * hd :].view(n, nkv, hd))

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        gate = gate_up[:, : out.shape[1]]
        torch.nn.functional.silu(gate, inplace=True)
        torch.mul(gate, gate_up[:, out.shape[1] :], out=out)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        allowed = sampler.allowed_tokens(bitmask, logits.shape[1], self.bit_table)
        logits.masked_fill_(allowed.logical_not_(), float("-inf"))


class AttentionScratch:
    """Flat scratch sized for ``max_batch`` rows of ``max_ctx`` context slots.

    Views for a step's actual (batch, ctx) are carved from the front of each flat
    buffer, so a step never allocates.
    """

    def __init__(
        self,
        max_batch: int,
        max_ctx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.max_batch, self.max_ctx = max_batch, max_ctx
        self.h, self.kvh, self.hd = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        n = max_batch * max_ctx
        kw = {"device": device}
        self.pos = torch.arange(max_ctx, dtype=torch.int32, **kw)
        self.pos_block = torch.div(self.pos, block_size, rounding_mode="floor")
        self.pos_offset = torch.remainder(self.pos, block_size)
        self.block_size_t = torch.tensor(block_size, dtype=torch.int32, **kw)
        self.slots = torch.empty(n, dtype=torch.int32, **kw)
        self.mask = torch.empty(n, dtype=torch.bool, **kw)
        self.gather = torch.empty(n * num_kv_heads * head_dim, dtype=dtype, **kw)
        self.k = torch.empty(n * num_kv_heads * head_dim, dtype=dtype, **kw)
        self.v = torch.empty(n * num_kv_heads * head_dim, dtype=dtype, **kw)
        self.scores = torch.empty(n * num_heads, dtype=dtype, **kw)
        self.row = torch.empty(max_batch * num_heads, dtype=dtype, **kw)
        self.scale = torch.tensor(head_dim**-0.5, dtype=dtype, **kw)

    def prepare(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, ctx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context slot ids [B, ctx] and padding mask [B, ctx] (True = not a token).

        Computed once per step and shared by every layer.
        """
        b = block_tables.shape[0]
        if ctx > self.max_ctx or b > self.max_batch:
            raise ValueError(f"batch {b} x context {ctx} exceeds scratch {self.max_batch} x {self.max_ctx}")
        slots = self.slots[: b * ctx].view(b, ctx)
        torch.index_select(block_tables, 1, self.pos_block[:ctx], out=slots)
        slots.mul_(self.block_size_t).add_(self.pos_offset[:ctx])
        mask = self.mask[: b * ctx].view(b, ctx)
        torch.ge(self.pos[:ctx].unsqueeze(0), seq_lens.unsqueeze(1), out=mask)
        return slots, mask


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
    scratch: AttentionScratch,
    out: torch.Tensor,
) -> torch.Tensor:
    """One query token per sequence against its paged context.

    q: [B, heads, head_dim]; k_cache/v_cache: flat [slots, kv_heads, head_dim];
    slots/mask from ``AttentionScratch.prepare``; out: [B, heads, head_dim].
    ``scale=None`` uses the scratch's preboxed head_dim**-0.5 (no per-step boxing).
    Query head ``h`` reads KV head ``h // (heads // kv_heads)``, as in transformers.
    """
    b, ctx = slots.shape
    s = scratch
    g = s.h // s.kvh
    flat_slots = slots.view(-1)
    gathered = s.gather[: b * ctx * s.kvh * s.hd].view(b * ctx, s.kvh, s.hd)
    k = s.k[: b * ctx * s.kvh * s.hd].view(b, s.kvh, ctx, s.hd)
    v = s.v[: b * ctx * s.kvh * s.hd].view(b, s.kvh, ctx, s.hd)
    torch.index_select(k_cache, 0, flat_slots, out=gathered)
    k.copy_(gathered.view(b, ctx, s.kvh, s.hd).transpose(1, 2))
    torch.index_select(v_cache, 0, flat_slots, out=gathered)
    v.copy_(gathered.view(b, ctx, s.kvh, s.hd).transpose(1, 2))

    scores = s.scores[: b * s.h * ctx].view(b, s.kvh, g, ctx)
    torch.matmul(q.view(b, s.kvh, g, s.hd), k.transpose(-1, -2), out=scores)
    scores.mul_(s.scale if scale is None else scale)
    # A Python scalar, not a 0-dim tensor: CUDA's masked_fill_ reads a tensor value with
    # .item(), a host sync that graph capture forbids.
    scores.masked_fill_(mask.view(b, 1, 1, ctx), float("-inf"))
    row = s.row[: b * s.h].view(b, s.kvh, g, 1)
    torch.amax(scores, dim=-1, keepdim=True, out=row)
    scores.sub_(row).exp_()
    torch.sum(scores, dim=-1, keepdim=True, out=row)
    scores.div_(row)
    torch.matmul(scores, v, out=out.view(b, s.kvh, g, s.hd))
    return out


class TorchAttention:
    def __init__(self, scratch: AttentionScratch, scale: float):
        self.scratch, self.scale = scratch, scale
        self._num_decode = 0
        self._slots_mask: tuple[torch.Tensor, torch.Tensor] | None = None
        self._chunks: list[PromptChunk] = []

    def begin(self, batch: ForwardBatch, block_size: int) -> None:
        nd = self._num_decode = batch.num_decode
        if nd:  # once per launch, shared by every layer
            ctx = batch.block_tables.shape[1] * block_size
            self._slots_mask = self.scratch.prepare(batch.block_tables[:nd], batch.seq_lens[:nd], ctx)
        self._chunks = plan_chunks(batch, block_size) if batch.prompt_query_lens else []

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> None:
        nd = self._num_decode
        if nd:
            paged_decode_attention(q[:nd], k_cache, v_cache, *self._slots_mask, None, self.scratch, out[:nd])
        attend_chunks(self._chunks, q, k_cache, v_cache, out, self.scale)
