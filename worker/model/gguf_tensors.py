"""The tensors of a GGUF file (llama.cpp's and Ollama's format) under their Hugging Face names,
read through a memory map: only the rows asked for are touched (a tensor-parallel rank's share).

Mapping onto the kernels, with no new arithmetic:
- F32 / F16 / BF16: the 16-bit path;
- Q4_0 (groups of 32, an fp16 scale, ``w = (q - 8) d``): exactly fusedserve's int4 scheme, so
  its bytes become an ``Int4Weight`` unchanged when the model runs int4;
- anything else ``gguf`` can dequantize (Q8_0, Q4_K, Q5_K, Q6_K, ...): dequantized to fp32 and
  re-quantized at load by the model's quantization (Q8_0 and Q6_K: int8 per channel; the 4/5-bit
  K-quants: int4), the error bounded by that quantization's own step.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from fusedserve.kernels.linear import Int4Weight
from fusedserve.kernels.quantize import INT4_GROUP
from fusedserve.worker.model.gguf_hybrid import NAMES as HYBRID_NAMES
from fusedserve.worker.model.gguf_hybrid import HybridLayout

# Hugging Face name -> GGUF name (llama.cpp's convert_hf_to_gguf.py, Qwen2/Qwen3 architectures).
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
           "model.norm.weight": "output_norm.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias",
          "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# An MoE layer's experts, stacked by the converter into one tensor per projection: [experts, out, in].
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
HYBRID_ARCHES = ("qwen35", "qwen35moe", "qwen3next")
_HYBRID_LAYER = {**_LAYER, **HYBRID_NAMES}
FLOAT_TYPES = ("F32", "F16", "BF16")


def gguf_name(hf: str, hybrid: bool = False) -> str | None:
    """``hf``'s GGUF name; ``hybrid``: in a qwen35 / qwen35moe / qwen3next file."""
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    layer = _HYBRID_LAYER if hybrid else _LAYER
    m = _LAYER_RE.fullmatch(hf)
    if m and m.group(2) in layer:
        return f"blk.{m.group(1)}.{layer[m.group(2)]}"
    return None


class GGUFTensors:
    """A GGUF file's tensors by Hugging Face name: shapes, types, fp32 reads and Q4_0 as int4. A
    ``qwen35`` file's (Qwen3.5) names and values are undone as ``gguf_hybrid.py`` says."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        self._gguf = gguf
        self.reader = gguf.GGUFReader(str(self.path), "r")
        self.tensors = {t.name: t for t in self.reader.tensors}
        arch = self._meta("general.architecture")
        self.hybrid = HybridLayout.from_metadata(self._meta, arch) if arch in HYBRID_ARCHES else None

    def _meta(self, key: str):
        f = self.reader.fields.get(key)
        if f is None:
            raise KeyError(f"{self.path}: GGUF metadata lacks {key}")
        value = f.contents()
        return value.decode() if isinstance(value, bytes) else value

    def _lookup(self, name: str):
        """(the GGUF tensor holding ``name``, the expert's index in it or None), or None."""
        m = _EXPERT_RE.fullmatch(name)
        if m:
            t = self.tensors.get(f"blk.{m.group(1)}.ffn_{m.group(3)}_exps.weight")
            return None if t is None or int(m.group(2)) >= int(t.shape[-1]) else (t, int(m.group(2)))
        g = gguf_name(name, self.hybrid is not None)
        t = None if g is None else self.tensors.get(g)
        return None if t is None else (t, None)

    def _tensor(self, name: str):
        found = self._lookup(name)
        return None if found is None else found[0]

    def _data(self, name: str):
        """The stored data of ``name`` (an expert's slice of its stacked tensor)."""
        t, expert = self._lookup(name)
        return t.data if expert is None else t.data[expert]

    def _fix(self, name: str):
        return None if self.hybrid is None else self.hybrid.fix(name)

    def has(self, name: str) -> bool:
        return self._tensor(name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        """Row-major (GGUF lists dimensions innermost first); a hybrid's conv as ``[C, 1, K]``."""
        t, expert = self._lookup(name)
        shape = tuple(int(d) for d in reversed(t.shape))[0 if expert is None else 1 :]
        conv = self.hybrid is not None and name.endswith(".conv1d.weight")
        return (shape[0], 1, shape[1]) if conv else shape

    def qtype(self, name: str) -> str:
        return self._tensor(name).tensor_type.name

    def read(self, name: str, rows: range | None = None, cols: range | None = None) -> torch.Tensor:
        """fp32 values of ``rows`` x ``cols`` (only those rows' bytes are read and dequantized, but
        for a tensor whose stored values need undoing: all of it, then the share)."""
        fix = self._fix(name)
        if fix is not None:
            values = fix(self.read_stored(name))
            values = values if rows is None else values[rows.start : rows.stop]
            return values if cols is None else values[:, cols.start : cols.stop].contiguous()
        return self.read_stored(name, rows, cols)

    def read_stored(self, name: str, rows: range | None = None, cols: range | None = None) -> torch.Tensor:
        t, stored = self._tensor(name), self._data(name)
        data = stored if rows is None else stored[rows.start : rows.stop]
        if t.tensor_type.name in ("F32", "F16"):
            values = np.asarray(data, dtype=np.float32)
        else:
            values = self._gguf.quants.dequantize(np.asarray(data), t.tensor_type)
        values = np.ascontiguousarray(values, dtype=np.float32)
        out = torch.from_numpy(values if values.flags.writeable else values.copy())
        return out if cols is None else out[:, cols.start : cols.stop].contiguous()

    def read_int4(self, name: str, rows: range | None = None, cols: range | None = None) -> Int4Weight | None:
        """A Q4_0 tensor's ``rows`` x ``cols`` as fusedserve's int4, bit for bit; None where the
        tensor is not Q4_0 or ``cols`` does not fall on whole groups."""
        t = self._tensor(name)
        if t.tensor_type.name != "Q4_0" or self._fix(name) is not None:
            return None
        n, k = self.shape(name)
        cols = cols or range(k)
        if cols.start % INT4_GROUP or (cols.stop % INT4_GROUP and cols.stop != k):
            return None
        stored = self._data(name)
        raw = np.asarray(stored if rows is None else stored[rows.start : rows.stop])  # [rows, blocks * 18]
        blocks = raw.reshape(raw.shape[0], -1, 18)[:, cols.start // INT4_GROUP : -(-cols.stop // INT4_GROUP)]
        d = torch.from_numpy(np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[:, :, 0].copy())
        qs = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]))  # [rows, groups, 16]
        u = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(qs.shape[0], -1)  # elements 0-15, then 16-31
        return Int4Weight(u.contiguous(), d.contiguous(), len(cols))
