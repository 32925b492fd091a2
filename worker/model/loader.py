"""Hugging Face-layout weight loading: ``model.safetensors`` or a sharded index, read into the
records of ``weights.py`` (which also makes them runnable: device, quantization, layouts).

Block-wise FP8 tensors (``kernels/model_description/checkpoint_format.py``) are dequantized as they are read.
Where the weights run quantized on the CPU, each projection is quantized as soon as its layer is
read, so reading the layers stays about one layer above their quantized size, whatever the
checkpoint's dtype (the lm_head is quantized afterwards, in one piece).

Weights are fused at load time (q/k/v into one matrix, gate/up into another, per expert in a
Qwen3-MoE layer) so the decode step runs one matmul where the checkpoint has three or two.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from fusedserve.kernels.linear import Int4Weight, Weight
from fusedserve.kernels.model_description.checkpoint_format import PLAIN, CheckpointFormat, GroupQuant
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.kernels.quantize import dequantize_int4
from fusedserve.worker.model import group_quant, hybrid_loader
from fusedserve.worker.model.gguf_tensors import GGUFTensors
from fusedserve.worker.model.tensor_parallel import SINGLE, TensorParallel
from fusedserve.worker.model.weights import LayerWeights, Quantizer, Qwen3Weights

Progress = Callable[[int, int], None]  # (parts done, parts in all)
# A read dtype: the stored values where the model's dtype holds them exactly, else fp32. A bf16
# checkpoint quantized at load is read in bf16 (fp32 copies of every projection, freed at once,
# left glibc holding about 1.5 GB of Qwen3-0.6B's load in its heap); an fp32 or FP8 one in fp32.
EXACT = object()


class WeightError(ValueError):
    """A checkpoint is missing a tensor, or a tensor has the wrong shape."""


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightError(f"{index}: malformed safetensors index: {exc}") from None
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in set(files.values()):
            if not shard.is_file():
                raise WeightError(f"{index}: shard {shard.name} is listed but missing")
        return files
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise WeightError(f"{model_dir}: neither model.safetensors nor an index file found")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


class _Reader:
    """Reads named tensors lazily, checking shapes, one open file at a time per shard."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, fmt: CheckpointFormat = PLAIN,
                 int4: bool = False):
        self.gguf = GGUFTensors(fmt.file) if fmt.method == "gguf" else None
        self.files = {} if self.gguf is not None else _tensor_files(model_dir)
        self.dtype = dtype
        self.model_dir = model_dir
        self.fmt = fmt
        self.int4 = int4  # the model runs int4: a GGUF's Q4_0 projections keep their bytes

    def has(self, name: str) -> bool:
        return self.gguf.has(name) if self.gguf is not None else name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        if self.gguf is not None:
            return self.gguf.shape(name)
        with safe_open(str(self.files[name]), framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def get(self, name: str, shape: tuple[int, ...], rows: range | None = None,
            cols: range | None = None, dtype: torch.dtype | None = None, packed: bool = False) -> Weight:
        """The tensor ``name`` of ``shape`` in ``dtype`` (default: the model's; ``EXACT``), or only its
        ``rows`` / ``cols`` (a rank's share: only those bytes are read). ``packed``: a projection,
        which may come back already quantized (an in-order AWQ/GPTQ or a GGUF's Q4_0 as
        ``Int4Weight`` where the model runs int4) and must be stored packed in an AWQ/GPTQ one."""
        if self.gguf is not None:
            return self._get_gguf(name, shape, rows, cols, dtype, packed)
        prefix = name.removesuffix(".weight")
        if self.fmt.group_quant is not None and packed and self.fmt.group_quant.converts(prefix):
            if prefix + ".qweight" not in self.files:
                raise WeightError(f"{self.model_dir}: config.json declares {self.fmt.method} but projection "
                                  f"{prefix!r} has no {prefix}.qweight")
            w = self._get_group_quant(prefix, shape, rows, cols)
            return w if isinstance(w, Int4Weight) else w.to(self._read_dtype(w, dtype))
        path = self.files.get(name)
        if path is None:
            raise WeightError(f"{self.model_dir}: missing weight tensor {name!r}")
        with safe_open(str(path), framework="pt") as f:
            part = f.get_slice(name)
            if tuple(part.get_shape()) != shape:
                raise WeightError(
                    f"{path.name}: tensor {name!r} has shape {tuple(part.get_shape())}, expected {shape}"
                )
            r = slice(None) if rows is None else slice(rows.start, rows.stop)
            tensor = part[r] if cols is None else part[r, cols.start : cols.stop]
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = self._dequantize(name, shape, tensor, rows, cols)
        return tensor.to(self._read_dtype(tensor, dtype)).contiguous()

    def _read_dtype(self, tensor: torch.Tensor, dtype: torch.dtype | object | None) -> torch.dtype:
        """``EXACT``: as stored where the model's dtype holds it, else fp32 (no rounding)."""
        if dtype is EXACT:
            return self.dtype if tensor.dtype == self.dtype else torch.float32
        return dtype or self.dtype

    def _get_gguf(self, name: str, shape: tuple[int, ...], rows: range | None, cols: range | None,
                  dtype: torch.dtype | None, packed: bool) -> Weight:
        if not self.gguf.has(name):
            raise WeightError(f"{self.gguf.path}: missing weight tensor {name!r}")
        if self.gguf.shape(name) != shape:
            raise WeightError(f"{self.gguf.path.name}: tensor {name!r} has shape {self.gguf.shape(name)}, "
                              f"expected {shape}")
        if packed and self.int4:
            w = self.gguf.read_int4(name, rows, cols)
            if w is not None:
                return w
        values = self.gguf.read(name, rows, cols)  # fp32
        return values.to(self._read_dtype(values, dtype))

    def _slice(self, name: str, *dims: slice) -> torch.Tensor:
        """``name``'s raw values at ``dims`` (only those bytes are read)."""
        path = self.files.get(name)
        if path is None:
            raise WeightError(f"{self.model_dir}: missing weight tensor {name!r}")
        with safe_open(str(path), framework="pt") as f:
            return f.get_slice(name)[dims]

    def _get_group_quant(self, prefix: str, shape: tuple[int, ...], rows: range | None,
                         cols: range | None) -> Weight:
        """An AWQ/GPTQ projection's ``rows`` (outputs) x ``cols`` (inputs): its own bytes as
        int4 where the model runs int4 and they map exactly, else dequantized to fp32."""
        gq: GroupQuant = self.fmt.group_quant
        n, k = shape
        rows, cols = rows or range(n), cols or range(k)
        per, gs = 32 // gq.bits, gq.group_rows(k)
        full_r, full_c = slice(None), slice(None)
        r_ok = rows.start % 8 == 0 and rows.stop % 8 == 0 and rows.start % per == 0 and rows.stop % per == 0
        c_ok = cols.start % per == 0 and cols.stop % per == 0 and cols.start % gs == 0
        r = slice(rows.start, rows.stop) if r_ok else full_r
        rp = slice(rows.start // 8, rows.stop // 8) if r_ok else full_r  # AWQ: 8 outputs a word
        rg = slice(rows.start // per, rows.stop // per) if r_ok else full_r  # GPTQ zeros: per outputs a word
        g_idx = None
        if gq.method == "awq":
            c = slice(cols.start, cols.stop) if c_ok else full_c
            g = slice(cols.start // gs, -(-cols.stop // gs)) if c_ok else full_c
            qweight = self._slice(prefix + ".qweight", c, rp)
            qzeros, scales = self._slice(prefix + ".qzeros", g, rp), self._slice(prefix + ".scales", g, r)
        else:
            c = slice(cols.start // per, cols.stop // per) if c_ok else full_c
            qweight = self._slice(prefix + ".qweight", c, r)
            qzeros = self._slice(prefix + ".qzeros", full_c, rg)
            scales = self._slice(prefix + ".scales", full_c, r)
            if prefix + ".g_idx" in self.files:
                g_idx = self._slice(prefix + ".g_idx", slice(cols.start, cols.stop) if c_ok else full_c)
        width = len(cols) if c_ok else k
        q, z, s, groups = group_quant.unpack(gq, qweight, qzeros, scales, g_idx, width)
        if gq.method == "awq" and c_ok:
            groups = torch.arange(cols.start, cols.stop) // gs - cols.start // gs
        if not r_ok:
            q, z, s = q[rows.start : rows.stop], z[:, rows.start : rows.stop], s[:, rows.start : rows.stop]
        if not c_ok:
            q, groups = q[:, cols.start : cols.stop], groups[cols.start : cols.stop]
        if self.int4:
            w = group_quant.as_int4(gq, q, z, s, groups)
            if w is not None:
                return w
        return group_quant.dequantize(q, z, s, groups)

    def _dequantize(self, name: str, shape: tuple[int, ...], q: torch.Tensor, rows: range | None,
                    cols: range | None) -> torch.Tensor:
        """``q * scale`` per block, for the ``rows`` x ``cols`` of ``name`` that ``q`` holds: only
        the scales of those blocks are read."""
        if self.fmt.method != "fp8" or len(shape) != 2:
            raise WeightError(f"{self.model_dir}: tensor {name!r} is FP8 but config.json declares no "
                              "block-wise FP8 quantization_config")
        (n, k), (bn, bk) = shape, self.fmt.block
        rows, cols = rows or range(n), cols or range(k)
        sr = range(rows.start // bn, -(-rows.stop // bn))
        sc = range(cols.start // bk, -(-cols.stop // bk))
        scale = self.get(name + "_scale_inv", (-(-n // bn), -(-k // bk)), rows=sr, cols=sc,
                         dtype=torch.float32)
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        r0, c0 = rows.start - sr.start * bn, cols.start - sc.start * bk
        full = full[r0 : r0 + len(rows), c0 : c0 + len(cols)]
        return q.float() * full

    def heads(self, name: str, heads: range, head_dim: int, total: int, cols: int | None,
              dtype: torch.dtype | None = None, packed: bool = False) -> Weight:
        """Rows of the heads ``heads`` of a projection with ``total`` heads (a bias when ``cols``
        is None)."""
        shape = (total * head_dim,) if cols is None else (total * head_dim, cols)
        return self.get(name, shape, rows=range(heads.start * head_dim, heads.stop * head_dim), dtype=dtype,
                        packed=packed)


def _fuse(parts: list[Weight]) -> Weight:
    """Row blocks of one projection stacked (q/k/v, gate/up): int4 kept where every part is."""
    if all(isinstance(p, Int4Weight) for p in parts):
        zs = [p.z if p.z is not None else torch.full_like(p.d, 8, dtype=torch.uint8) for p in parts]
        z = None if all(p.z is None for p in parts) else torch.cat(zs)
        return Int4Weight(torch.cat([p.u for p in parts]), torch.cat([p.d for p in parts]),
                          parts[0].in_features, z)
    return torch.cat([dequantize_int4(p.u, p.d, p.in_features, torch.float32, p.z)
                      if isinstance(p, Int4Weight) else p for p in parts]).contiguous()


def load_weights(model_dir: str | Path, config: Qwen3Config, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE, progress: Progress | None = None,
                 fmt: CheckpointFormat = PLAIN, quantize: Quantizer | None = None) -> Qwen3Weights:
    """Read and fuse a Qwen3 checkpoint into ``dtype`` tensors on the CPU: the whole model, or
    one tensor-parallel rank's share of it (``worker/model/tensor_parallel.py``), reading only
    that share from the files. ``progress(done, total)`` is told after each layer and after the
    embeddings (``total``: layers + 1), so a bar can move while a large model loads. ``fmt``: the
    checkpoint's format (FP8 tensors dequantized on read); ``quantize``: applied to each
    projection as its layer is read, from the checkpoint's values in fp32 (not rounded to
    ``dtype`` first)."""
    reader = _Reader(Path(model_dir), dtype, fmt, int4=quantize is not None and quantize.mode == "int4")
    q_ = quantize or (lambda t: t)
    pd = EXACT if quantize is not None else None  # the projections' read dtype
    pk = True  # projections: packed in AWQ/GPTQ checkpoints, int4 already where the model runs int4
    c = config
    tp.check(c)
    hidden = c.hidden_size
    inter = tp.split(c.intermediate_size)

    def gate_up_down(prefix: str, width: int, share: range | None) -> tuple[torch.Tensor, torch.Tensor]:
        """An MLP's fused gate/up (column-parallel) and down (row-parallel), or ``share`` of them."""
        gate = reader.get(prefix + "gate_proj.weight", (width, hidden), rows=share, dtype=pd, packed=pk)
        up = reader.get(prefix + "up_proj.weight", (width, hidden), rows=share, dtype=pd, packed=pk)
        return (q_(_fuse([gate, up])),
                q_(reader.get(prefix + "down_proj.weight", (hidden, width), cols=share, dtype=pd, packed=pk)))

    # A Qwen3.5 ``...ForConditionalGeneration`` checkpoint keeps its language model under
    # ``model.language_model.`` (its vision tower is not read).
    # A sentence-transformers save of the bare ``Qwen3Model`` (Qwen3-Embedding) has no prefix at all.
    root = next((r for r in ("model.language_model.", "model.") if reader.has(r + "embed_tokens.weight")), "")
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"{root}layers.{i}."
        router = experts = gate_up = down = None
        if c.sparse(i):
            mi = c.moe_intermediate_size
            router = reader.get(p + "mlp.gate.weight", (c.num_experts, hidden))
            share = None if tp.expert_parallel else tp.split(mi)
            experts = [gate_up_down(f"{p}mlp.experts.{e}.", mi, share) if tp.owns_expert(e, c.num_experts)
                       else None for e in range(c.num_experts)]
        else:
            gate_up, down = gate_up_down(p + "mlp.", c.intermediate_size, inter)
        mlp = dict(gate_up=gate_up, down=down, router=router, experts=experts)
        if c.hybrid:
            layers.append(_hybrid_layer(reader, i, p, c, tp, pd, q_, mlp))
        else:
            layers.append(_attention_layer(reader, p, c, tp, pd, pk, q_, mlp))
        if progress is not None:
            progress(i + 1, c.num_hidden_layers + 1)
    embed = _vocab_rows(reader, root + "embed_tokens.weight", c, tp)
    lm_head = None  # an embedding or classification checkpoint: no logits
    if c.tie_word_embeddings:
        lm_head = embed
    elif reader.has("lm_head.weight") or not (root == "" or reader.has("score.weight")):
        lm_head = _vocab_rows(reader, "lm_head.weight", c, tp)
    classifier = None
    if reader.has("score.weight"):  # ...ForSequenceClassification: a head of one row per label
        rows = reader.shape("score.weight")[0]
        classifier = reader.get("score.weight", (rows, hidden))
    if progress is not None:
        progress(c.num_hidden_layers + 1, c.num_hidden_layers + 1)
    return Qwen3Weights(
        embed=embed,
        layers=layers,
        final_norm=(hybrid_loader.norm(reader, root + "norm.weight", hidden, dtype) if c.hybrid
                    else reader.get(root + "norm.weight", (hidden,))),
        lm_head=lm_head,
        classifier=classifier,
    )


def _attention_layer(reader: _Reader, p: str, c: Qwen3Config, tp: TensorParallel, pd, pk, q_,
                     mlp: dict) -> LayerWeights:
    """A Qwen3 layer: attention (this rank's heads) and the MLP read already."""
    a = p + "self_attn."
    hidden, hd = c.hidden_size, c.head_dim
    heads, kv_heads = tp.heads(c), tp.kv_heads(c)
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    q = reader.heads(a + "q_proj.weight", heads, hd, nh, hidden, pd, pk)
    k = reader.heads(a + "k_proj.weight", kv_heads, hd, nkv, hidden, pd, pk)
    v = reader.heads(a + "v_proj.weight", kv_heads, hd, nkv, hidden, pd, pk)
    bias = None
    if c.attention_bias:
        bias = torch.cat([reader.heads(a + "q_proj.bias", heads, hd, nh, None),
                          reader.heads(a + "k_proj.bias", kv_heads, hd, nkv, None),
                          reader.heads(a + "v_proj.bias", kv_heads, hd, nkv, None)])
    q_cols = range(heads.start * hd, heads.stop * hd)  # o_proj's inputs from this rank's heads
    return LayerWeights(
        input_norm=reader.get(p + "input_layernorm.weight", (hidden,)),
        qkv=q_(_fuse([q, k, v])),
        qkv_bias=bias,
        q_norm=reader.get(a + "q_norm.weight", (hd,)),
        k_norm=reader.get(a + "k_norm.weight", (hd,)),
        o_proj=q_(reader.get(a + "o_proj.weight", (hidden, c.q_size), cols=q_cols, dtype=pd, packed=pk)),
        post_norm=reader.get(p + "post_attention_layernorm.weight", (hidden,)),
        **mlp,
    )


def _hybrid_layer(reader: _Reader, i: int, p: str, c: Qwen3Config, tp: TensorParallel, pd, q_,
                  mlp: dict) -> LayerWeights:
    """A hybrid's layer: Gated DeltaNet or gated full attention, zero-centred norms, the MLP read
    already (and a MoE layer's shared expert)."""
    hidden, dtype = c.hidden_size, reader.dtype
    shared = hybrid_loader.shared_expert(reader, p, c, pd, q_, tp) if mlp["experts"] is not None else {}
    common = dict(input_norm=hybrid_loader.norm(reader, p + "input_layernorm.weight", hidden, dtype),
                  post_norm=hybrid_loader.norm(reader, p + "post_attention_layernorm.weight", hidden, dtype),
                  qkv_bias=None, **mlp, **shared)
    if c.linear_layer(i):
        la = hybrid_loader.linear_attention(reader, p + "linear_attn.", c, pd, q_, tp)
        return LayerWeights(qkv=None, q_norm=None, k_norm=None, o_proj=None, linear_attn=la, **common)
    a = p + "self_attn."
    q, gate, k, v, o = hybrid_loader.gated_attention(reader, a, c, pd, tp)
    q_norm, k_norm = hybrid_loader.qk_norms(reader, a, c, dtype)
    return LayerWeights(qkv=q_(torch.cat([q, k, v]).contiguous()), q_norm=q_norm, k_norm=k_norm,
                        o_proj=q_(o), attn_gate=q_(gate), **common)


def _vocab_rows(reader: _Reader, name: str, c: Qwen3Config, tp: TensorParallel) -> torch.Tensor:
    """The whole [V, D] table, or this rank's ``ceil(V / N)`` rows of it (zeros past the vocab)."""
    if tp.size == 1:
        return reader.get(name, (c.vocab_size, c.hidden_size))
    rows = tp.vocab(c.vocab_size)
    part = reader.get(name, (c.vocab_size, c.hidden_size), rows=rows)
    pad = tp.vocab_rows(c.vocab_size) - len(rows)
    return torch.cat([part, part.new_zeros(pad, c.hidden_size)]) if pad else part
