"""AWQ and GPTQ checkpoints: their packed 4/8-bit tensors onto fusedserve's kernels.

Both store a projection as ``qweight`` (int32 words of packed integers), ``qzeros`` (the zero
point of each group, packed the same way along the outputs) and ``scales`` (fp16 per group and
output), groups running along the inputs; GPTQ adds ``g_idx`` (each input's group).

- AWQ (AutoAWQ's GEMM layout): ``qweight`` [in, out / 8], the 8 nibbles of a word holding
  outputs in the order 0, 2, 4, 6, 1, 3, 5, 7; ``qzeros`` likewise; ``w = (q - z) * s``.
- GPTQ: ``qweight`` [in * bits / 32, out], a word holding consecutive inputs; ``qzeros`` packed
  along the outputs in order; the format's zero points are stored less one (``checkpoint_format``
  ``gptq``; ``gptq_v2`` stores them as they are).

A 4-bit weight whose groups cover whole runs of 32 inputs in order (group size 32, 64, 128, ...,
or one group per row; GPTQ without ``desc_act``) is exactly fusedserve's int4 with zero points:
each group of 32 takes its group's scale and zero point. GPTQ with ``desc_act`` (groups follow a
permutation of the inputs) and 8-bit GPTQ run as int8: dequantized and re-quantized per channel
at load (a second 4-bit rounding measured 94% top-1 agreement where int8's keeps 100%).
"""

from __future__ import annotations

import torch

from fusedserve.kernels.linear import Int4Weight
from fusedserve.kernels.model_description.checkpoint_format import GroupQuant
from fusedserve.kernels.quantize import INT4_GROUP

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output j of a word's 8 sits in nibble AWQ_ORDER.index(j)


def unpack_words(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words [R, C] -> their ``32 / bits`` fields each, [R, C * 32 / bits], lowest first (or
    field ``i`` landing at position ``order[i]`` within its word's run)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    fields = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    if order is not None:
        fields = fields[..., torch.tensor([order.index(j) for j in range(per)])]
    return fields.reshape(words.shape[0], -1)


def unpack(gq: GroupQuant, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
           g_idx: torch.Tensor | None, in_features: int) -> tuple[torch.Tensor, ...]:
    """(q [out, in], zero points [groups, out], scales [groups, out] fp32, group of each input)."""
    if gq.method == "awq":
        q = unpack_words(qweight, gq.bits, AWQ_ORDER).t()
        z = unpack_words(qzeros, gq.bits, AWQ_ORDER)
    else:
        q = unpack_words(qweight.t(), gq.bits)  # [out, in]
        z = unpack_words(qzeros, gq.bits) + gq.zero_offset
    q, z = q[:, :in_features], z[:, : scales.shape[1]]
    groups = torch.arange(in_features) // gq.group_rows(in_features) if g_idx is None else g_idx.long()
    return q.contiguous(), z, scales.float(), groups


def dequantize(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
               groups: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in]: (q - z[group]) * s[group] per input."""
    return (q.float() - z[groups].t().float()) * s[groups].t()


def as_int4(gq: GroupQuant, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
            groups: torch.Tensor) -> Int4Weight | None:
    """The same weight as fusedserve's int4 with zero points, bit for bit; None where a run of
    32 inputs straddles groups (the weight is then re-quantized instead)."""
    n, k = q.shape
    if gq.bits != 4 or k % INT4_GROUP:
        return None
    runs = groups.view(-1, INT4_GROUP)
    if not bool((runs == runs[:, :1]).all()):
        return None
    g = runs[:, 0]  # each run's group
    return Int4Weight(q.to(torch.uint8), s[g].t().half().contiguous(), k,
                      z[g].t().to(torch.uint8).contiguous())
