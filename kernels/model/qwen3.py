"""The Qwen3 model, dense or mixture of experts: one forward over a phase-less batch.

``forward`` embeds the launch's packed tokens on the device, runs every layer over the
paged KV cache (writing this launch's K/V), and writes each row's next-token logits into a
buffer the caller owns. Decode steps, prefills, chunks and any mix of them are the same
call (``kernels/forward_batch.py``). Which kernels run was chosen at load
(``kernels/backend.py``); nothing comes back to the host unless the caller copies it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels import native
from kernels.backend import select_kernels
from kernels.forward_batch import ForwardBatch
from kernels.kv_cache import PagedKVCache
from kernels.layer_ops import rope_tables
from kernels.linear import Int4Weight, Int8Weight, LinearOp
from kernels.model.config import ConfigError, Qwen3Config, parse_dtype
from kernels.model.loader import Qwen3Weights, load_weights
from kernels.model.tensor_parallel import SINGLE, TensorParallel
from kernels.model.workspace import LayerBuffers, Workspace

# int8 and int4 multiply with int8 activations on the native CPU kernels; int8-weight-only keeps
# the activations 16-bit (exact to the weights' rounding alone: tests show W8A8 flips a rare token).
QUANTIZATIONS = (None, "none", "int8", "int8-weight-only", "int4")


class Qwen3Model:
    """Weights, rotary tables and the kernels for one device."""

    def __init__(self, config: Qwen3Config, weights: Qwen3Weights, dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_model_len: int | None = None,
                 quantization: str | None = None, tp: TensorParallel = SINGLE):
        if quantization not in QUANTIZATIONS:
            raise ConfigError(f"unknown quantization {quantization!r}; use one of {QUANTIZATIONS[1:]}")
        self.config = config
        # What this rank computes: its heads and MLP slice under tensor parallelism, else the model.
        self.local = tp.local_config(config)
        self.tp = tp
        self.quantization = None if quantization == "none" else quantization
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_model_len = min(max_model_len or config.max_position_embeddings,
                                 config.max_position_embeddings)
        self.w = _to_device(weights, self.device)
        self.kernels = select_kernels(self.local, dtype, self.device,
                                      int8_activations=self.quantization != "int8-weight-only")
        if self.quantization == "int4" and not self.kernels.linear.int4:
            raise ConfigError("int4 weights run on the native CPU kernels (AVX2 or AVX-512 builds); this "
                              f"device ({self.device}) has none: use int8 or none")
        if self.quantization:
            _quantize(self.w, self.quantization, dtype, self.device)
        _prepare(self.w, self.kernels.linear, self.kernels.grouped_moe)
        self.cos, self.sin = rope_tables(config.head_dim, config.rope_theta, self.max_model_len, dtype)
        self.cos, self.sin = self.cos.to(self.device), self.sin.to(self.device)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: str | torch.dtype | None = None,
                        device: torch.device | str = "cpu", max_model_len: int | None = None,
                        quantization: str | None = None, tp: TensorParallel = SINGLE) -> Qwen3Model:
        """``dtype``: a name, None (the checkpoint's) or ``"auto"`` (``resolve_dtype``). ``tp``: load
        and run one tensor-parallel rank's share."""
        config = Qwen3Config.from_dir(model_dir)
        torch_dtype = resolve_dtype(dtype, parse_dtype(config.dtype), torch.device(device))
        weights = load_weights(model_dir, config, torch_dtype, tp)
        return cls(config, weights, torch_dtype, device, max_model_len, quantization=quantization, tp=tp)

    def kernel_info(self) -> dict[str, str]:
        """Which kernels this model runs (``stats`` and the startup log report it)."""
        wdtype = {"int8-weight-only": "int8-wo"}.get(self.quantization, self.quantization) or self.dtype
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": self.quantization or "none",
            "linear": self.kernels.linear.describe(wdtype),
            "attention": self.kernels.attention_name,
        }

    # ----------------------------------------------------------------- allocation

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(self.local, num_blocks, block_size, self.dtype, self.device)

    def new_workspace(self, max_rows: int, block_size: int) -> Workspace:
        """Buffers for launches of up to ``max_rows`` tokens (and rows)."""
        max_ctx = -(-self.max_model_len // block_size) * block_size
        attention = self.kernels.new_attention(max_rows, max_ctx, block_size)
        return Workspace(self.local, max_rows, attention, self.dtype, self.device, self.tp)

    # -------------------------------------------------------------------- forward

    def forward(self, batch: ForwardBatch, kv: PagedKVCache, ws: Workspace,
                logits: torch.Tensor) -> torch.Tensor:
        """Run the batch's tokens through every layer and write their K/V into the pages;
        ``logits`` [B, V] float32 gets each row's last token's next-token logits. Returns the
        residual stream [T, D] (``compute_logits`` reads other tokens' from it)."""
        t, b = batch.num_tokens, batch.num_rows
        x = ws.residual(t)
        self.tp.embed(self.w.embed, batch.token_ids, x)
        cos, sin = ws.rope(t)
        torch.index_select(self.cos, 0, batch.positions, out=cos)
        torch.index_select(self.sin, 0, batch.positions, out=sin)
        buf = ws.layer_buffers(t)
        ws.attention.begin(batch, kv.block_size)
        pending = None  # the previous layer's MLP output, added to the residual by the next norm
        for i, lw in enumerate(self.w.layers):
            pending = self._layer(i, lw, x, pending, buf, cos, sin, batch.slot_mapping, kv, ws)
        if pending is not None:
            x.add_(pending)
        last = ws.last[:b]
        torch.sub(batch.query_start_loc[1:], ws.one, out=last)
        self.compute_logits(x, last, logits, ws)
        return x

    def _layer(self, i: int, lw, x: torch.Tensor, pending: torch.Tensor | None, buf: LayerBuffers,
               cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, kv: PagedKVCache,
               ws: Workspace) -> torch.Tensor:
        """One transformer layer over n tokens: the residual ``x`` [n, D] gets ``pending`` and the
        attention output in place; returns the MLP's output, for the next layer to add."""
        c, ops, linear, tp = self.local, self.kernels.ops, self.kernels.linear, self.tp
        n = x.shape[0]
        ops.add_rms_norm(x, pending, lw.input_norm, buf.h, buf.norm)
        linear(buf.h, lw.qkv, buf.qkv)
        if lw.qkv_bias is not None:
            buf.qkv.add_(lw.qkv_bias)
        k_cache, v_cache = kv.layer(i)
        ops.qk_norm_rope(buf.qkv, lw.q_norm, lw.k_norm, cos, sin, buf.q, buf.norm, k_cache, v_cache,
                         slot_mapping)
        ws.attention.attend(buf.q, k_cache, v_cache, buf.attn)
        linear(buf.attn.view(n, c.q_size), lw.o_proj, buf.o)
        tp.all_reduce(buf.o)
        ops.add_rms_norm(x, buf.o, lw.post_norm, buf.h, buf.norm)
        if lw.experts is not None:
            self._moe(lw, buf.h, buf.o)
        else:
            linear(buf.h, lw.gate_up, buf.gate_up)
            ops.silu_mul(buf.gate_up, buf.act)
            linear(buf.act, lw.down, buf.o)
        tp.all_reduce(buf.o)
        return buf.o

    def _moe(self, lw, h: torch.Tensor, out: torch.Tensor) -> None:
        """A Qwen3-MoE layer's MLP over n tokens, as transformers computes it: the router's
        softmax (float32), each token's top-k experts (their weights renormalised with
        ``norm_topk_prob``), then, expert by expert in index order, one GEMM of every token
        routed to it, scaled by its weight and added into ``out`` [n, D].

        The tokens of each expert are known only from the router's output, so this reads the
        routing back to the host (on a CPU that is no copy; a device graph cannot capture it)."""
        c, ops, linear = self.local, self.kernels.ops, self.kernels.linear
        n, k, mi = h.shape[0], c.num_experts_per_tok, c.moe_intermediate_size
        logits = torch.empty(n, c.num_experts, dtype=h.dtype, device=h.device)
        linear(h, lw.router, logits)
        weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
        if c.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype)
        if lw.expert_stack is not None:
            self._experts_grouped(lw, h, out, weights, ids)
            return
        if n == 1:  # decode of one row: k experts, the routing read once, no gather or scatter
            self._experts_one_row(lw, h, out, ids[0].tolist(), weights[0].tolist())
            return
        weights = weights.flatten()
        out.zero_()
        for e, rows, slots in _by_expert(ids, c.num_experts):
            if lw.experts[e] is None:  # held by another rank (expert parallelism)
                continue
            gate_up, down = lw.experts[e]
            count = rows.shape[0]
            x = h.index_select(0, rows)
            gu = torch.empty(count, 2 * mi, dtype=h.dtype, device=h.device)
            linear(x, gate_up, gu)
            act = torch.empty(count, mi, dtype=h.dtype, device=h.device)
            ops.silu_mul(gu, act)
            y = torch.empty(count, c.hidden_size, dtype=h.dtype, device=h.device)
            linear(act, down, y)
            y.mul_(weights.index_select(0, slots)[:, None])
            out.index_add_(0, rows, y)

    def _experts_one_row(self, lw, h: torch.Tensor, out: torch.Tensor, experts: list[int],
                         weights: list[float]) -> None:
        """One token's experts, in index order (as the batched path adds them), into ``out`` [1, D]."""
        c, ops, linear = self.local, self.kernels.ops, self.kernels.linear
        mi = c.moe_intermediate_size
        kw = {"dtype": h.dtype, "device": h.device}
        gu, act = torch.empty(1, 2 * mi, **kw), torch.empty(1, mi, **kw)
        y = torch.empty(1, c.hidden_size, **kw)
        out.zero_()
        for e, w in sorted(zip(experts, weights)):
            if lw.experts[e] is None:
                continue
            gate_up, down = lw.experts[e]
            linear(h, gate_up, gu)
            ops.silu_mul(gu, act)
            linear(act, down, y)
            out.add_(y.mul_(w))

    def _experts_grouped(self, lw, h: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor) -> None:
        """Every routed (token, expert) pair in two grouped GEMMs: the pairs sorted by expert on the
        device, one ``torch._grouped_mm`` for gate/up and one for down over each expert's run, then
        each token's k outputs summed in its routing order. Nothing is read back to the host and
        every shape follows n alone, so a device graph could capture it."""
        c, ops = self.local, self.kernels.ops
        n, k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(c.num_experts, dtype=torch.int32, device=h.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount would sync
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate_up, down = lw.expert_stack
        gu = torch._grouped_mm(h.index_select(0, order // k), gate_up.transpose(-2, -1), offs=offs)
        act = torch.empty(n * k, c.moe_intermediate_size, dtype=h.dtype, device=h.device)
        ops.silu_mul(gu, act)
        y = torch._grouped_mm(act, down.transpose(-2, -1), offs=offs)
        y.mul_(weights.flatten().index_select(0, order)[:, None])
        slots = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, k) order, deterministic
        torch.sum(slots.view(n, k, c.hidden_size), dim=1, out=out)

    def compute_logits(self, x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, ws: Workspace) -> None:
        """``out`` [R, V] float32 = lm_head(final_norm(x[rows])), ``ws.max_rows`` rows at a time."""
        step = ws.max_rows
        for s in range(0, rows.shape[0], step):
            n = min(step, rows.shape[0] - s)
            h = ws.final[:n]
            torch.index_select(x, 0, rows[s : s + n], out=h)
            self.kernels.ops.add_rms_norm(h, None, self.w.final_norm, h, ws.buffers.norm.rows(n))
            if ws.logits_local is None:
                self.kernels.linear(h, self.w.lm_head, out[s : s + n])
            else:  # 16-bit logits, or this rank's vocab share of them: widened or gathered into out
                self.kernels.linear(h, self.w.lm_head, ws.logits_local[:n])
                self.tp.gather_vocab(ws.logits_local[:n], out[s : s + n], ws.logits_gathered)


def _by_expert(ids: torch.Tensor, num_experts: int):
    """For each expert with tokens, in index order: (expert, token rows [m], routing slots [m])
    of the tokens routed to it; ``ids`` [n, k] are each token's experts. Few slots (decode) are
    grouped on the host from one read; many (prefill) by a sort on the device."""
    n, k = ids.shape
    if n * k <= 256:
        groups: dict[int, list[int]] = {}
        for slot, e in enumerate(ids.flatten().tolist()):
            groups.setdefault(e, []).append(slot)
        for e in sorted(groups):
            slots = torch.tensor(groups[e], device=ids.device)
            yield e, slots // k, slots
        return
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for e, count in enumerate(counts):
        if count:
            slots = order[start : start + count]
            yield e, slots // k, slots
            start += count


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


def _quantize(w: Qwen3Weights, mode: str, dtype: torch.dtype, device: torch.device) -> None:
    """Every projection (and the lm_head) quantized in place, one tensor at a time (peak memory
    stays near the 16-bit model's). int8: per channel, everything. int4: groups of 32 for the
    projections, the lm_head int8 (the logits keep 8 bits, as llama.cpp keeps 6 there). The
    embedding gather stays 16-bit."""
    def q(weight: torch.Tensor) -> Int4Weight | Int8Weight:
        if mode == "int4":
            return Int4Weight.quantize(weight, device)
        return Int8Weight.quantize(weight, dtype, device)

    for lw in w.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            if getattr(lw, name) is not None:
                setattr(lw, name, q(getattr(lw, name)))
        if lw.experts is not None:  # the experts; the router stays 16-bit (routing is sensitive)
            lw.experts = [None if ex is None else (q(ex[0]), q(ex[1])) for ex in lw.experts]
    w.lm_head = Int8Weight.quantize(w.lm_head, dtype, device)


def _prepare(w: Qwen3Weights, linear: LinearOp, grouped_moe: bool) -> None:
    """Every projection and the lm_head in its kernel's layout, in place (the embedding gather
    keeps its own tensor, so a tied lm_head is then a packed copy). ``grouped_moe``: a sparse
    layer's 16-bit experts, all held here, stacked for the grouped GEMMs."""
    for lw in w.layers:
        for name in ("qkv", "o_proj", "gate_up", "down", "router"):
            if getattr(lw, name) is not None:
                setattr(lw, name, linear.prepare(getattr(lw, name)))
        if (grouped_moe and lw.experts is not None and all(isinstance(ex, tuple) for ex in lw.experts)
                and all(isinstance(t, torch.Tensor) for ex in lw.experts for t in ex)):
            lw.expert_stack = (torch.stack([gu for gu, _ in lw.experts]),
                               torch.stack([d for _, d in lw.experts]))
            lw.experts = [(lw.expert_stack[0][e], lw.expert_stack[1][e]) for e in range(len(lw.experts))]
        elif lw.experts is not None:
            lw.experts = [None if ex is None else (linear.prepare(ex[0]), linear.prepare(ex[1]))
                          for ex in lw.experts]
    w.lm_head = linear.prepare(w.lm_head)


def _to_device(w: Qwen3Weights, device: torch.device) -> Qwen3Weights:
    if device.type == "cpu":
        return w
    embed = w.embed.to(device)

    def move(t):
        if isinstance(t, list):  # a sparse layer's experts
            return [None if ex is None else (ex[0].to(device), ex[1].to(device)) for ex in t]
        return None if t is None else t.to(device)

    return Qwen3Weights(
        embed=embed,
        layers=[type(lw)(**{k: move(t) for k, t in vars(lw).items()}) for lw in w.layers],
        final_norm=w.final_norm.to(device),
        lm_head=embed if w.lm_head is w.embed else w.lm_head.to(device),
    )
