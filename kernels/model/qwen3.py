"""The Qwen3 dense model: batched prefill and the fused, allocation-free decode step.

``decode_step`` is one call that embeds on the device, runs every layer over the
paged cache, applies the final norm and lm_head, and samples on the device (greedy
ids, and top-K candidates for host-side stochastic sampling), writing into
``SampleOutputs`` the caller created once. Nothing comes back to the host unless
the caller copies it: that is the point (docs/ARCHITECTURE.md, the argument contract).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import native
from kernels.attention.torch_gather import AttentionScratch, paged_decode_attention, prefill_attention
from kernels.kv_cache import PagedKVCache
from kernels.linear import Int8Weight, LinearOp
from kernels.model.config import ConfigError, Qwen3Config, parse_dtype
from kernels.model.loader import Qwen3Weights, load_weights
from kernels.norms import linear_gemv, rms_norm, rope_tables, rotary

QUANTIZATIONS = (None, "none", "int8")


@dataclass
class SampleOutputs:
    """Device-side outputs of a launch, sized for the largest batch; rows [:B] are written."""

    greedy_ids: torch.Tensor  # [max_batch] int32
    topk_values: torch.Tensor  # [max_batch, K] float32
    topk_ids: torch.Tensor  # [max_batch, K] int32
    logits: torch.Tensor  # [max_batch, vocab] float32

    @classmethod
    def allocate(
        cls, max_batch: int, vocab: int, top_k: int, device: torch.device | str = "cpu"
    ) -> SampleOutputs:
        return cls(
            greedy_ids=torch.zeros(max_batch, dtype=torch.int32, device=device),
            topk_values=torch.zeros(max_batch, top_k, dtype=torch.float32, device=device),
            topk_ids=torch.zeros(max_batch, top_k, dtype=torch.int32, device=device),
            logits=torch.zeros(max_batch, vocab, dtype=torch.float32, device=device),
        )


@dataclass
class LayerBuffers:
    """One layer's intermediates for n rows: views of the decode workspace (decode: no
    allocation), or fresh tensors sized for the prompt tokens (prefill)."""

    h: torch.Tensor  # [n, D] normed input of attention / MLP
    f32_h: torch.Tensor  # [n, D] float32 scratch of the hidden norms
    var_h: torch.Tensor  # [n, 1]
    qkv: torch.Tensor  # [n, q + 2 kv]
    q: torch.Tensor  # [n, heads, hd] (contiguous, normed q)
    f32_q: torch.Tensor
    var_q: torch.Tensor
    f32_k: torch.Tensor
    var_k: torch.Tensor
    rot_q: torch.Tensor  # rotary scratch, like q
    rot_k: torch.Tensor  # like k
    attn: torch.Tensor  # [n, heads, hd]
    o: torch.Tensor  # [n, D] projection outputs added to the residual
    gate_up: torch.Tensor  # [n, 2 I]
    act: torch.Tensor  # [n, I]

    @classmethod
    def allocate(cls, c: Qwen3Config, n: int, dtype: torch.dtype, device: torch.device) -> LayerBuffers:
        kw, f32 = {"dtype": dtype, "device": device}, {"dtype": torch.float32, "device": device}
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        return cls(
            h=torch.empty(n, c.hidden_size, **kw), f32_h=torch.empty(n, c.hidden_size, **f32),
            var_h=torch.empty(n, 1, **f32), qkv=torch.empty(n, c.q_size + 2 * c.kv_size, **kw),
            q=torch.empty(n, nh, hd, **kw), f32_q=torch.empty(n, nh, hd, **f32),
            var_q=torch.empty(n, nh, 1, **f32), f32_k=torch.empty(n, nkv, hd, **f32),
            var_k=torch.empty(n, nkv, 1, **f32), rot_q=torch.empty(n, nh, hd, **kw),
            rot_k=torch.empty(n, nkv, hd, **kw), attn=torch.empty(n, nh, hd, **kw),
            o=torch.empty(n, c.hidden_size, **kw), gate_up=torch.empty(n, 2 * c.intermediate_size, **kw),
            act=torch.empty(n, c.intermediate_size, **kw),
        )

    @classmethod
    def of_workspace(cls, ws: DecodeWorkspace, c: Qwen3Config, b: int) -> LayerBuffers:
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        return cls(
            h=ws.normed[:b], f32_h=ws.norm_f32[: b * c.hidden_size].view(b, c.hidden_size),
            var_h=ws.norm_var[:b].view(b, 1), qkv=ws.qkv[:b], q=ws.q[:b].view(b, nh, hd),
            f32_q=ws.norm_f32[: b * c.q_size].view(b, nh, hd),
            var_q=ws.norm_var[: b * nh].view(b, nh, 1),
            f32_k=ws.norm_f32[: b * c.kv_size].view(b, nkv, hd),
            var_k=ws.norm_var[: b * nkv].view(b, nkv, 1),
            rot_q=ws.rot_tmp[: b * c.q_size].view(b, nh, hd),
            rot_k=ws.rot_tmp[: b * c.kv_size].view(b, nkv, hd),
            attn=ws.attn[:b].view(b, nh, hd), o=ws.o[:b], gate_up=ws.gate_up[:b], act=ws.act[:b],
        )


# attend(q, k, v, k_cache, v_cache, out): this launch's attention for one layer.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecodeWorkspace:
    """Every intermediate of a decode step, allocated once for ``max_batch``."""

    def __init__(self, c: Qwen3Config, max_batch: int, max_ctx: int, block_size: int,
                 top_k: int, dtype: torch.dtype, device: torch.device | str,
                 hidden: torch.Tensor | None = None, gather_attention: bool = True):
        kw = {"dtype": dtype, "device": device}
        f32 = {"dtype": torch.float32, "device": device}
        b, d = max_batch, c.hidden_size
        self.max_batch = max_batch
        # The residual stream ends as next_hidden; a caller's scratch pool may own it.
        self.hidden = torch.empty(b, d, **kw) if hidden is None else hidden
        self.normed = torch.empty(b, d, **kw)
        self.norm_f32 = torch.empty(b * max(d, c.q_size), **f32)
        self.norm_var = torch.empty(b * c.num_attention_heads, **f32)
        self.qkv = torch.empty(b, c.q_size + 2 * c.kv_size, **kw)
        self.q = torch.empty(b, c.q_size, **kw)  # contiguous q: batched matmul can then view it
        self.rot_tmp = torch.empty(b * c.q_size, **kw)
        self.cos = torch.empty(b, c.head_dim, **kw)
        self.sin = torch.empty(b, c.head_dim, **kw)
        self.attn = torch.empty(b, c.q_size, **kw)
        self.o = torch.empty(b, d, **kw)
        self.gate_up = torch.empty(b, 2 * c.intermediate_size, **kw)
        self.act = torch.empty(b, c.intermediate_size, **kw)
        self.logits = None if dtype == torch.float32 else torch.empty(b, c.vocab_size, **kw)
        self.argmax = torch.empty(b, dtype=torch.int64, device=device)
        # 0-dim constants: a Python scalar operand would be boxed into a new tensor per op.
        self.eps = torch.tensor(c.rms_norm_eps, **f32)
        self.inv_hidden = torch.tensor(1.0 / d, **f32)
        self.inv_head = torch.tensor(1.0 / c.head_dim, **f32)
        self.topk_values = torch.empty(b, top_k, **f32)
        self.topk_ids = torch.empty(b, top_k, dtype=torch.int64, device=device)
        # The gathering attention's scratch; the native kernel reads the pages in place.
        self.attention = AttentionScratch(
            max_batch, max_ctx, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            block_size, dtype, device,
        ) if gather_attention else None


class Qwen3Model:
    """Weights, rotary tables and the launch entry points for one device."""

    def __init__(self, config: Qwen3Config, weights: Qwen3Weights, dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_model_len: int | None = None,
                 single_row_gemv: bool = False, quantization: str | None = None):
        if quantization not in QUANTIZATIONS:
            raise ConfigError(f"unknown quantization {quantization!r}; use int8 or none")
        self.config = config
        self.quantization = None if quantization == "none" else quantization
        # Opt-in: faster one-row bf16 decode on the CPU, but its rounding differs from the
        # batched kernel's, so outputs stop being independent of the batch a request lands in.
        self.single_row_gemv = single_row_gemv
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_model_len = min(max_model_len or config.max_position_embeddings,
                                 config.max_position_embeddings)
        self.w = _to_device(weights, self.device)
        if self.quantization == "int8":
            _quantize_int8(self.w, dtype, self.device)
        # The native CPU kernels (None on other devices, or where they cannot be built).
        self.native = native.kernels() if self.device.type == "cpu" else None
        self.linear = LinearOp(self.device, self.native, dtype)
        _prepare(self.w, self.linear)
        self.cos, self.sin = rope_tables(config.head_dim, config.rope_theta,
                                         self.max_model_len, dtype)
        self.cos, self.sin = self.cos.to(self.device), self.sin.to(self.device)
        self.scale = config.head_dim ** -0.5

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: str | torch.dtype | None = None,
                        device: torch.device | str = "cpu", max_model_len: int | None = None,
                        quantization: str | None = None) -> Qwen3Model:
        """``dtype``: a name, None (the checkpoint's) or ``"auto"`` (``resolve_dtype``)."""
        config = Qwen3Config.from_dir(model_dir)
        torch_dtype = resolve_dtype(dtype, parse_dtype(config.dtype), torch.device(device))
        weights = load_weights(model_dir, config, torch_dtype)
        return cls(config, weights, torch_dtype, device, max_model_len, quantization=quantization)

    def kernel_info(self) -> dict[str, str]:
        """Which kernels this model runs (``stats`` and the startup log report it)."""
        wdtype = "int8" if self.quantization == "int8" else self.dtype
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": self.quantization or "none",
            "linear": self.linear.describe(wdtype),
            "attention": f"native-{self.native.isa()}" if self.native is not None else "aten-gather",
        }

    # ----------------------------------------------------------------- allocation

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(self.config, num_blocks, block_size, self.dtype, self.device)

    def new_workspace(self, max_batch: int, block_size: int, top_k: int,
                      hidden: torch.Tensor | None = None) -> DecodeWorkspace:
        max_ctx = -(-self.max_model_len // block_size) * block_size
        return DecodeWorkspace(self.config, max_batch, max_ctx, block_size, top_k,
                               self.dtype, self.device, hidden, gather_attention=self.native is None)

    def new_outputs(self, max_batch: int, top_k: int) -> SampleOutputs:
        return SampleOutputs.allocate(max_batch, self.config.vocab_size, top_k, self.device)

    # --------------------------------------------------------------------- decode

    def decode_step(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv: PagedKVCache,
        ws: DecodeWorkspace,
        out: SampleOutputs,
        ctx_len: int | None = None,
        want_topk: bool = True,
    ) -> None:
        """Decode one token for each of B sequences, entirely on the device.

        token_ids, positions, seq_lens (incl. this token), slot_mapping: [B] int32;
        block_tables: [B, max_blocks] int32. ``ctx_len`` bounds the context gathered
        (defaults to block_tables' width x block_size); pass max(seq_lens) rounded up
        to a block to avoid a device->host read. Writes rows [:B] of ``out``.
        """
        b = token_ids.shape[0]
        if ctx_len is None:
            ctx_len = block_tables.shape[1] * kv.block_size
        x = ws.hidden[:b]
        torch.index_select(self.w.embed, 0, token_ids, out=x)
        cos, sin = ws.cos[:b], ws.sin[:b]
        torch.index_select(self.cos, 0, positions, out=cos)
        torch.index_select(self.sin, 0, positions, out=sin)
        if self.native is not None:  # K/V read in place; cost follows each row's own length
            def attend(q, k, v, k_cache, v_cache, o) -> None:
                self.native.decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                             kv.block_size, self.scale, o)
        else:
            slots, mask = ws.attention.prepare(block_tables, seq_lens, ctx_len)

            def attend(q, k, v, k_cache, v_cache, o) -> None:
                paged_decode_attention(q, k_cache, v_cache, slots, mask, None, ws.attention, o)

        buf = LayerBuffers.of_workspace(ws, self.config, b)
        linear = self._linear_for(b)
        cos3, sin3 = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, lw in enumerate(self.w.layers):
            self._layer(i, lw, x, buf, cos3, sin3, slot_mapping, kv, ws, attend, linear)
        self._norm(x, None, self.w.final_norm, buf, ws)
        self._sample(buf.h, ws, out, b, want_topk)

    def _layer(self, i: int, lw, x: torch.Tensor, buf: LayerBuffers, cos: torch.Tensor, sin: torch.Tensor,
               slot_mapping: torch.Tensor, kv: PagedKVCache, ws: DecodeWorkspace, attend: Attend,
               linear: Linear) -> None:
        """One transformer layer over n rows, residual ``x`` [n, D] updated in place; the same
        for prefill (n prompt tokens) and decode (n sequences). Writes this layer's K/V pages."""
        c = self.config
        n = x.shape[0]
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self._norm(x, None, lw.input_norm, buf, ws)
        linear(buf.h, lw.qkv, buf.qkv)
        if lw.qkv_bias is not None:
            buf.qkv.add_(lw.qkv_bias)
        q = buf.q
        k = buf.qkv[:, c.q_size : c.q_size + c.kv_size].view(n, nkv, hd)
        v = buf.qkv[:, c.q_size + c.kv_size :].view(n, nkv, hd)
        if self.native is not None:  # one pass: both norms and both rotaries, k in place
            self.native.qk_norm_rope(buf.qkv, lw.q_norm, lw.k_norm, cos[:, 0], sin[:, 0], c.rms_norm_eps,
                                     q, nh, nkv)
        else:
            rms_norm(buf.qkv[:, : c.q_size].view(n, nh, hd), lw.q_norm, ws.eps, q, buf.f32_q, buf.var_q,
                     ws.inv_head)
            rms_norm(k, lw.k_norm, ws.eps, k, buf.f32_k, buf.var_k, ws.inv_head)
            rotary(q, cos, sin, buf.rot_q)
            rotary(k, cos, sin, buf.rot_k)
        k_cache, v_cache = kv.layer(i)
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, v)
        attend(q, k, v, k_cache, v_cache, buf.attn)
        linear(buf.attn.view(n, c.q_size), lw.o_proj, buf.o)
        self._norm(x, buf.o, lw.post_norm, buf, ws)
        linear(buf.h, lw.gate_up, buf.gate_up)
        gate = buf.gate_up[:, : c.intermediate_size]
        torch.nn.functional.silu(gate, inplace=True)
        torch.mul(gate, buf.gate_up[:, c.intermediate_size :], out=buf.act)
        linear(buf.act, lw.down, buf.o)
        x.add_(buf.o)

    def _norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, buf: LayerBuffers,
              ws: DecodeWorkspace) -> None:
        """``x += add`` (if given), then ``buf.h = rms_norm(x) * weight``: one native pass."""
        if self.native is not None:
            self.native.add_rms_norm(x, add, weight, self.config.rms_norm_eps, buf.h)
            return
        if add is not None:
            x.add_(add)
        rms_norm(x, weight, ws.eps, buf.h, buf.f32_h, buf.var_h, ws.inv_hidden)

    def _linear_for(self, rows: int):
        """The matmul for a step of ``rows`` rows: ``self.linear``, whose rows do not depend on
        the batch; or, opt-in without the native kernels, ATen's GEMV for one bf16 row."""
        if (self.single_row_gemv and rows == 1 and self.native is None and self.quantization is None
                and self.device.type == "cpu" and self.dtype == torch.bfloat16):
            return linear_gemv
        return self.linear

    def _sample(self, h: torch.Tensor, ws: DecodeWorkspace, out: SampleOutputs, b: int,
                want_topk: bool) -> None:
        """lm_head and on-device sampling into ``out`` rows [:b]."""
        linear = self._linear_for(b)
        logits = out.logits[:b]
        if ws.logits is None:
            linear(h, self.w.lm_head, logits)
        else:
            linear(h, self.w.lm_head, ws.logits[:b])
            logits.copy_(ws.logits[:b])
        torch.argmax(logits, dim=-1, out=ws.argmax[:b])
        out.greedy_ids[:b].copy_(ws.argmax[:b])
        if want_topk:
            k = out.topk_values.shape[1]
            torch.topk(logits, k, dim=-1, out=(ws.topk_values[:b], ws.topk_ids[:b]))
            out.topk_values[:b].copy_(ws.topk_values[:b])
            out.topk_ids[:b].copy_(ws.topk_ids[:b])

    # -------------------------------------------------------------------- prefill

    def prefill(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: list[int],
        slot_mapping: torch.Tensor,
        kv: PagedKVCache,
        ws: DecodeWorkspace,
        out: SampleOutputs,
        want_topk: bool = True,
        prefix_lens: list[int] | None = None,
        prefix_slots: torch.Tensor | None = None,
        num_decode: int = 0,
        block_tables: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        ctx_len: int = 0,
    ) -> None:
        """Run B packed prompts, write their K/V into pages, sample each one's next token.

        token_ids, positions, slot_mapping: [T] for all prompts' new tokens packed back to
        back; ``cu_seqlens`` [B + 1] are their boundaries. A prompt whose first
        ``prefix_lens[i]`` tokens are cached (prefix caching) passes only the rest, and its
        attention also reads the cached K/V at ``prefix_slots`` (packed per prompt, in order).
        Chunked prefill: the first ``num_decode`` rows are decode rows (one token each, whose
        context is paged: ``block_tables`` [num_decode, W], ``seq_lens``), attended as in
        ``decode_step``; the rest are prompt chunks. Rows [:B] of ``out`` are written.
        Prefill may allocate (its shapes vary with the prompts); decode does not.
        """
        b = len(cu_seqlens) - 1
        if b > ws.max_batch:
            raise ValueError(f"prefill batch {b} exceeds the workspace's max batch {ws.max_batch}")
        x = self.w.embed.index_select(0, token_ids)
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)

        nd = num_decode
        if nd and self.native is None:
            slots_mask = ws.attention.prepare(block_tables, seq_lens, ctx_len)
        chunk_cu = [c - nd for c in cu_seqlens[nd:]]
        chunk_prefix = None if not prefix_lens else prefix_lens[nd:]

        def attend(q, k, v, k_cache, v_cache, o) -> None:
            if nd and self.native is not None:
                self.native.decode_attention(q[:nd], k_cache, v_cache, block_tables, seq_lens,
                                             kv.block_size, self.scale, o[:nd])
            elif nd:
                paged_decode_attention(q[:nd], k_cache, v_cache, *slots_mask, None, ws.attention, o[:nd])
            prefix = None if not chunk_prefix or not any(chunk_prefix) else \
                (chunk_prefix, prefix_slots, k_cache, v_cache)
            prefill_attention(q[nd:], k[nd:], v[nd:], chunk_cu, self.scale, out=o[nd:], prefix=prefix)

        buf = LayerBuffers.allocate(self.config, x.shape[0], self.dtype, x.device)
        for i, lw in enumerate(self.w.layers):
            self._layer(i, lw, x, buf, cos, sin, slot_mapping, kv, ws, attend, self.linear)
        last = torch.tensor([e - 1 for e in cu_seqlens[1:]], device=x.device)
        hb = ws.normed[:b]
        rms_norm(x.index_select(0, last), self.w.final_norm, ws.eps, hb, buf.f32_h[:b], buf.var_h[:b],
                 ws.inv_hidden)
        self._sample(hb, ws, out, b, want_topk)


def resolve_dtype(dtype: str | torch.dtype | None, checkpoint: torch.dtype,
                  device: torch.device) -> torch.dtype:
    """None: the checkpoint's dtype. ``"auto"``: the fastest here for this checkpoint.

    On an accelerator, the checkpoint's 16-bit dtype (bf16 for an fp32 checkpoint). On the
    CPU with the native kernels, the same (they stream 16-bit weights, half fp32's bytes);
    without them, bf16 where the CPU has AVX-512 BF16 (oneDNN's bf16 matmul), else fp32
    (ATen's bf16 matmul is several times slower than its fp32 one there).
    """
    if dtype is None:
        return checkpoint
    if dtype != "auto":
        return parse_dtype(dtype)
    sixteen = checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.bfloat16
    if device.type != "cpu" or native.kernels() is not None:
        return sixteen
    return torch.bfloat16 if "avx512_bf16" in native.cpu_flags() else torch.float32


def _quantize_int8(w: Qwen3Weights, dtype: torch.dtype, device: torch.device) -> None:
    """Every projection and the lm_head to weight-only int8, in place, one tensor at a time
    (peak memory stays near the 16-bit model's). The embedding gather stays 16-bit."""
    for lw in w.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            setattr(lw, name, Int8Weight.quantize(getattr(lw, name), dtype, device))
    w.lm_head = Int8Weight.quantize(w.lm_head, dtype, device)


def _prepare(w: Qwen3Weights, linear: LinearOp) -> None:
    """Every projection and the lm_head in its kernel's layout, in place (the embedding gather
    keeps its own tensor, so a tied lm_head is then a packed copy)."""
    for lw in w.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            setattr(lw, name, linear.prepare(getattr(lw, name)))
    w.lm_head = linear.prepare(w.lm_head)


def _to_device(w: Qwen3Weights, device: torch.device) -> Qwen3Weights:
    if device.type == "cpu":
        return w
    embed = w.embed.to(device)
    return Qwen3Weights(
        embed=embed,
        layers=[type(lw)(**{k: (None if t is None else t.to(device)) for k, t in vars(lw).items()})
                for lw in w.layers],
        final_norm=w.final_norm.to(device),
        lm_head=embed if w.lm_head is w.embed else w.lm_head.to(device),
    )
