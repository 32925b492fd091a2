"""The Qwen3 model, dense or mixture of experts: one forward over a phase-less batch.

``forward`` embeds the launch's packed tokens on the device, runs every layer over the
paged KV cache (writing this launch's K/V), and writes each row's next-token logits into a
buffer the caller owns. Decode steps, prefills, chunks and any mix of them are the same
call (``kernels/forward_batch.py``). Which kernels run was chosen at load
(``kernels/backend_table.py``); nothing comes back to the host unless the caller copies it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from fusedserve.kernels.backend_table import select_kernels
from fusedserve.kernels.forward_batch import ForwardBatch
from fusedserve.kernels.hybrid_cache import HybridKVCache
from fusedserve.kernels.kv_cache import PagedKVCache
from fusedserve.kernels.layer_ops import partial_rope_tables, rope_tables
from fusedserve.kernels.lora import add_lora, lora_groups
from fusedserve.kernels.model_description.checkpoint_format import checkpoint_format
from fusedserve.kernels.model_description.config import ConfigError, Qwen3Config, parse_dtype, resolve_dtype
from fusedserve.kernels.model_description.quantization import check_quantization
from fusedserve.kernels.native import build as native_build
from fusedserve.worker.model.gated_delta_net import DeltaNetOps, delta_net_forward
from fusedserve.worker.model.hybrid_norms import HybridNorms
from fusedserve.worker.model.loader import Progress, load_weights
from fusedserve.worker.model.lora_weights import LoraWeights
from fusedserve.worker.model.moe import moe_forward
from fusedserve.worker.model.tensor_parallel import SINGLE, TensorParallel
from fusedserve.worker.model.weights import Quantizer, Qwen3Weights, prepare_weights
from fusedserve.worker.model.workspace import HybridBuffers, LayerBuffers, Workspace


class Qwen3Model:
    """Weights, rotary tables and the kernels for one device."""

    def __init__(self, config: Qwen3Config, weights: Qwen3Weights, dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_model_len: int | None = None,
                 quantization: str | None = None, tp: TensorParallel = SINGLE, gemm: str = "auto"):
        self.config = config
        self.source = ""  # the directory it was read from (from_pretrained), which pooling detection reads
        # What this rank computes: its heads and MLP slice under tensor parallelism, else the model.
        self.local = tp.local_config(config)
        self.tp = tp
        self.quantization = check_quantization(quantization)
        self.dtype = dtype
        self.device = torch.device(device)
        # Resolved by the caller (coordinator/engine/config_resolution.py clamps it to the model's).
        self.max_model_len = max_model_len or config.max_context
        self.kernels = select_kernels(self.local, dtype, self.device,
                                      int8_activations=self.quantization != "int8-weight-only", gemm=gemm)
        if self.quantization == "int4" and not self.kernels.linear.int4:
            raise ConfigError("int4 weights run on the native CPU kernels (AVX2 or AVX-512 builds); this "
                              f"device ({self.device}) has none: use int8 or none")
        self.w = prepare_weights(weights, self.kernels.linear, self.quantization, dtype, self.device,
                                 self.kernels.grouped_moe)
        rotary = config.rotary_dim or config.head_dim
        self.cos, self.sin = rope_tables(rotary, config.rope_theta, self.max_model_len, torch.float32,
                                         None if config.yarn is None else dict(config.yarn),
                                         config.max_position_embeddings)
        if rotary < config.head_dim:  # partial rotary: the permuted head's tables (hybrid_loader.py)
            self.cos, self.sin = partial_rope_tables(self.cos, self.sin, config.head_dim)
        self.cos, self.sin = self.cos.to(dtype), self.sin.to(dtype)
        # The norms' kernels: a hybrid's zero-centred ones round as transformers does (hybrid_norms.py).
        # A hybrid's norms and decode step: the native CPU kernels where they run, else torch.
        native = native_build.kernels() if self.kernels.name == "native" else None
        self.norms = HybridNorms(self.local, native) if config.hybrid else self.kernels.ops
        self.loras: list[LoraWeights | None] = []  # the adapter slots (set_lora)
        # A kernel applying every slot's update of one projection in one call (the worker's LoRA pool
        # sets it where the native CPU kernels run): (layer, projection, token slots, x, y).
        self.lora_apply: Callable[[int, str, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        self.delta_ops = DeltaNetOps(native)
        self.cos, self.sin = self.cos.to(self.device), self.sin.to(self.device)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: str | torch.dtype | None = None,
                        device: torch.device | str = "cpu", max_model_len: int | None = None,
                        quantization: str | None = None, tp: TensorParallel = SINGLE,
                        progress: Progress | None = None, gemm: str = "auto") -> Qwen3Model:
        """``dtype``: a name, None (the checkpoint's) or ``"auto"`` (``resolve_dtype``). ``tp``: load
        and run one tensor-parallel rank's share. ``progress``: told as the layers load. ``gemm``:
        the CPU's GEMM choice (``select_kernels``)."""
        config = Qwen3Config.from_dir(model_dir)
        dev = torch.device(device)
        torch_dtype = resolve_dtype(dtype, parse_dtype(config.dtype), dev.type)
        fmt = checkpoint_format(model_dir)
        quantization = fmt.quantization(check_quantization(quantization), dev.type)
        # On the CPU, each projection is quantized as its layer is read (reading the layers stays
        # a layer above their quantized size); accelerators quantize after the move, as before.
        quantize = Quantizer(quantization, torch_dtype, dev) if quantization and dev.type == "cpu" else None
        weights = load_weights(model_dir, config, torch_dtype, tp, progress, fmt, quantize)
        model = cls(config, weights, torch_dtype, device, max_model_len, quantization=quantization, tp=tp,
                    gemm=gemm)
        model.source = str(model_dir)
        return model

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

    def new_kv_cache(self, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto",
                     max_seqs: int = 1, snapshots: int = 0) -> PagedKVCache:
        """``kv_cache_dtype``: ``auto`` (this model's dtype) or ``int8``, which only the native CPU
        kernels read and write. ``max_seqs``: the running sequences a hybrid's states serve (and a
        spare slot more); ``snapshots``: its states kept at block boundaries (prefix caching)."""
        if kv_cache_dtype != "auto" and self.kernels.name != "native":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype} needs the native CPU kernels; this model "
                             f"runs the {self.kernels.name} backend on {self.device.type}")
        if self.config.hybrid:
            return HybridKVCache(self.local, num_blocks, block_size, max_seqs + 1, self.dtype, self.device,
                                 kv_cache_dtype, snapshots)
        return PagedKVCache(self.local, num_blocks, block_size, self.dtype, self.device, kv_cache_dtype)

    def new_workspace(self, max_rows: int, block_size: int, kv_cache_dtype: str = "auto") -> Workspace:
        """Buffers for launches of up to ``max_rows`` tokens (and rows), over a cache of
        ``kv_cache_dtype``."""
        max_ctx = -(-self.max_model_len // block_size) * block_size
        attention = self.kernels.new_attention(max_rows, max_ctx, block_size, kv_cache_dtype)
        return Workspace(self.local, max_rows, attention, self.dtype, self.device, self.tp)

    # -------------------------------------------------------------------- forward

    def forward(self, batch: ForwardBatch, kv: PagedKVCache, ws: Workspace,
                logits: torch.Tensor | None) -> torch.Tensor:
        """Run the batch's tokens through every layer and write their K/V into the pages;
        ``logits`` [B, V] float32 gets each row's last token's next-token logits (None: none are
        wanted, as when a draft model only keeps its K/V in step). Returns the residual stream
        [T, D] (``compute_logits`` reads other tokens' from it)."""
        t, b = batch.num_tokens, batch.num_rows
        x = ws.residual(t)
        self.tp.embed(self.w.embed, batch.token_ids, x)
        cos, sin = ws.rope(t)
        torch.index_select(self.cos, 0, batch.positions, out=cos)
        torch.index_select(self.sin, 0, batch.positions, out=sin)
        buf = ws.layer_buffers(t)
        ws.attention.begin(batch, kv.block_size)
        if self.config.hybrid:  # states starting from zero, or from a cached prefix's snapshot
            if batch.state_resets is not None and batch.state_resets.numel():
                kv.reset(batch.state_resets)
            if batch.state_restores is not None and batch.state_restores.numel():
                kv.restore(batch.state_restores)
        pending = None  # the previous layer's MLP output, added to the residual by the next norm
        lora = None  # the tokens' slots (a LoRA kernel's), or each slot's rows, for every layer's updates
        if batch.lora_slots is not None and self.loras:
            lora = batch.lora_slots if self.lora_apply else lora_groups(batch.lora_slots, len(self.loras))
        for i, lw in enumerate(self.w.layers):
            pending = self._layer(i, lw, x, pending, buf, cos, sin, batch, kv, ws, lora)
        if pending is not None:
            x.add_(pending)
        if self.config.hybrid and batch.state_saves is not None and batch.state_saves.numel():
            kv.save(batch.state_saves)
        if logits is None:
            return x
        last = ws.last[:b]
        torch.sub(batch.query_start_loc[1:], ws.one, out=last)
        self.compute_logits(x, last, logits, ws)
        return x

    def _layer(self, i: int, lw, x: torch.Tensor, pending: torch.Tensor | None, buf: LayerBuffers,
               cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache,
               ws: Workspace, lora: list | None = None) -> torch.Tensor:
        """One transformer layer over n tokens: the residual ``x`` [n, D] gets ``pending`` and the
        attention output (a hybrid's linear-attention layer: its Gated DeltaNet's) in place;
        returns the MLP's output, for the next layer to add."""
        c, ops, linear, tp, norms = self.local, self.kernels.ops, self.kernels.linear, self.tp, self.norms
        n = x.shape[0]
        norms.add_rms_norm(x, pending, lw.input_norm, buf.h, buf.norm)
        if lw.linear_attn is not None:
            delta_net_forward(c, linear, lw.linear_attn, buf.h, batch, kv.state(i), buf.o,
                              lambda groups, rows: kv.speculating(i, groups, rows), self.delta_ops,
                              buf.hybrid)
        else:
            linear(buf.h, lw.qkv, buf.qkv)
            self._lora(i, "qkv", lora, buf.h, buf.qkv)
            if lw.qkv_bias is not None:
                buf.qkv.add_(lw.qkv_bias)
            k_cache, v_cache = kv.layer(i)
            norms.qk_norm_rope(buf.qkv, lw.q_norm, lw.k_norm, cos, sin, buf.q, buf.norm, k_cache, v_cache,
                               batch.slot_mapping)
            ws.attention.attend(buf.q, k_cache, v_cache, buf.attn)
            if lw.attn_gate is not None:  # a hybrid's output gate: attn * sigmoid(h W_gate)
                gate = buf.hybrid.gate
                linear(buf.h, lw.attn_gate, gate)
                buf.attn.view(n, c.q_size).mul_(gate.sigmoid_())
            linear(buf.attn.view(n, c.q_size), lw.o_proj, buf.o)
            self._lora(i, "o_proj", lora, buf.attn.view(n, c.q_size), buf.o)
        tp.all_reduce(buf.o)
        norms.add_rms_norm(x, buf.o, lw.post_norm, buf.h, buf.norm)
        if lw.experts is not None:
            moe_forward(c, self.kernels, lw, buf.h, buf.o)
            if lw.shared_gate_up is not None:
                self._shared_expert(lw, buf.h, buf.o, buf.hybrid)
        else:
            linear(buf.h, lw.gate_up, buf.gate_up)
            self._lora(i, "gate_up", lora, buf.h, buf.gate_up)
            ops.silu_mul(buf.gate_up, buf.act)
            linear(buf.act, lw.down, buf.o)
            self._lora(i, "down", lora, buf.act, buf.o)
        tp.all_reduce(buf.o)
        return buf.o

    def set_lora(self, slot: int, weights: LoraWeights | None) -> None:
        """Make ``weights`` (an adapter loaded for this model and rank) the one of adapter slot
        ``slot``; None empties it. A launch's ``lora_slots`` name these slots per token."""
        while len(self.loras) <= slot:
            self.loras.append(None)
        self.loras[slot] = weights

    def _lora(self, i: int, name: str, lora: list | torch.Tensor | None, x: torch.Tensor,
              y: torch.Tensor) -> None:
        """The adapters' updates of projection ``name`` of layer ``i`` for the launch's rows of each
        (``lora``: the tokens' slots for ``lora_apply``, else ``lora_groups``; partial sums under
        tensor parallelism, before the all-reduce)."""
        if lora is None:
            return
        if self.lora_apply is not None:
            self.lora_apply(i, name, lora, x, y)
        elif lora:
            add_lora(x, y, lora, [None if w is None else w.layers[i].get(name) for w in self.loras])

    def _shared_expert(self, lw, h: torch.Tensor, out: torch.Tensor, hb: HybridBuffers) -> None:
        """A hybrid MoE layer's shared expert, gated by sigmoid(h . w), added to the experts' ``out``."""
        linear, ops = self.kernels.linear, self.kernels.ops
        linear(h, lw.shared_gate_up, hb.shared_gate_up)
        ops.silu_mul(hb.shared_gate_up, hb.shared_act)
        linear(hb.shared_act, lw.shared_down, hb.shared_out)
        torch.matmul(h, lw.shared_gate.t(), out=hb.shared_gate)
        out.add_(hb.shared_out.mul_(hb.shared_gate.sigmoid_()))

    def pool(self, x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, ws: Workspace,
             logits: torch.Tensor, score_tokens: tuple[int, ...] = ()) -> None:
        """A pooling runner's rows: ``out`` [R, H] float32 gets, for each token of ``rows`` (a request's
        last), its final-normed hidden state (embed), its classification head's logits, or with
        ``score_tokens`` (no, yes) a causal LM's logit(yes) - logit(no), the one-row head a
        Qwen3-Reranker scores with (``logits`` [>= R, V] is the scratch of its full logits)."""
        n = rows.shape[0]
        if self.w.classifier is None and score_tokens:
            self.compute_logits(x, rows, logits[:n], ws)
            no, yes = score_tokens
            out[:, 0].copy_(logits[:n, yes] - logits[:n, no])
            return
        h = ws.final[:n]
        torch.index_select(x, 0, rows, out=h)
        self.norms.add_rms_norm(h, None, self.w.final_norm, h, ws.buffers.norm.rows(n))
        if self.w.classifier is None:
            out.copy_(h)
        else:
            torch.matmul(h.float(), self.w.classifier.float().t(), out=out)

    def compute_logits(self, x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, ws: Workspace) -> None:
        """``out`` [R, V] float32 = lm_head(final_norm(x[rows])), ``ws.max_rows`` rows at a time."""
        if self.w.lm_head is None:
            raise RuntimeError("this checkpoint has no lm_head (an embedding or classification model): "
                               "it runs as a pooling model (--runner pooling)")
        step = ws.max_rows
        for s in range(0, rows.shape[0], step):
            n = min(step, rows.shape[0] - s)
            h = ws.final[:n]
            torch.index_select(x, 0, rows[s : s + n], out=h)
            self.norms.add_rms_norm(h, None, self.w.final_norm, h, ws.buffers.norm.rows(n))
            if ws.logits_local is None:
                self.kernels.linear(h, self.w.lm_head, out[s : s + n])
            else:  # 16-bit logits, or this rank's vocab share of them: widened or gathered into out
                self.kernels.linear(h, self.w.lm_head, ws.logits_local[:n])
                self.tp.gather_vocab(ws.logits_local[:n], out[s : s + n], ws.logits_gathered)


def prepare_kernels(device: torch.device) -> None:
    """Build (first run) or load the device's kernels before the weights load, so a first run's
    build announces itself instead of stalling a weight bar at 0% (the CPU's native kernels; other
    devices have nothing to build)."""
    if device.type == "cpu":
        native_build.kernels()
