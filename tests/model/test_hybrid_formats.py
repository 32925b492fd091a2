"""A hybrid's (Qwen3.5, Qwen3-Next) AWQ, GPTQ and FP8 checkpoints, written here as AutoAWQ,
GPTQ and Qwen's FP8 releases store them: the Gated DeltaNet's and the gated attention's
projections are read from packed words (or e4m3 blocks) and dequantized before the hybrid layout
regroups them; modules a checkpoint leaves unquantized (``modules_to_not_convert``, a GPTQ
``dynamic`` "-:" rule) are read as 16-bit. The loaded projections equal those of the same model's
dequantized checkpoint under the same quantization, and logits stay near transformers' on the
dequantized weights."""

from __future__ import annotations

import pytest
import torch

from fusedserve.kernels.model_description.config import ConfigError
from fusedserve.worker.model.qwen3 import Qwen3Model
from tests.model.test_checkpoint_formats import write_dequantized, write_fp8
from tests.model.test_group_quant import write_group_quant
from tests.model.test_hybrid_models import COMMON, VOCAB, _classes, _logits, _randomise

LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL = LINEAR + ATTENTION + MLP
# name: (arch, writer, bits, packed projections, quantization_config additions)
CASES = {
    "qwen3_5-awq": ("qwen3_5", "awq", 4, tuple(p for p in LINEAR + ATTENTION if p not in ("in_proj_b",
                                                                                           "in_proj_a")),
                    {"modules_to_not_convert": ["in_proj_b", "in_proj_a", "mlp"]}),
    "qwen3_next-gptq8": ("qwen3_next", "gptq", 8, LINEAR + MLP, {"dynamic": {r"-:.*\.self_attn\..*": {}}}),
    "qwen3_5-fp8": ("qwen3_5", "fp8", 8, ALL, {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple]:
    """case -> (quantized checkpoint, dequantized fp32 checkpoint, transformers on the latter)."""
    out = {}
    for name, (arch, writer, bits, projections, extra) in CASES.items():
        cfg_cls, model_cls, moe = _classes(arch)
        torch.manual_seed(7)
        model = model_cls(cfg_cls(**COMMON, **moe)).eval()
        _randomise(model, 7)
        root = tmp_path_factory.mktemp(name)
        model.save_pretrained(root / "src")
        if writer == "fp8":
            deq = write_fp8(root / "src", root / "q", block=(32, 32), projections=projections)
        else:
            deq = write_group_quant(root / "src", root / "q", writer, bits, group=16, projections=projections,
                                    config=extra)
        deq_dir = write_dequantized(root / "src", root / "deq", deq)
        out[name] = (root / "q", deq_dir, model_cls.from_pretrained(deq_dir, dtype=torch.float32).eval())
    return out


def _outputs(model: Qwen3Model, w, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0])  # every weight kind has its [out, in] shape
    model.kernels.linear(x, w, out)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_projections_equal_the_dequantized_checkpoints(checkpoints, case):
    """Every hybrid projection of the quantized checkpoint computes what the dequantized one's does
    under the same quantization (the same values, quantized the same way), layer by layer."""
    path, deq_dir, _ = checkpoints[case]
    model = Qwen3Model.from_pretrained(path, dtype="float32")
    assert model.quantization == ("int4" if CASES[case][2] == 4 else "int8")
    ref = Qwen3Model.from_pretrained(deq_dir, dtype="float32", quantization=model.quantization)
    x = torch.randn(3, COMMON["hidden_size"], generator=torch.Generator().manual_seed(1))
    checked = 0
    for lw, rw in zip(model.w.layers, ref.w.layers, strict=True):
        pairs = [(lw.linear_attn.in_proj, rw.linear_attn.in_proj)] if lw.linear_attn is not None else \
            [(lw.qkv, rw.qkv), (lw.attn_gate, rw.attn_gate)]
        for got, want in pairs:
            torch.testing.assert_close(_outputs(model, got, x), _outputs(ref, want, x), atol=0, rtol=0)
            checked += 1
    assert checked == COMMON["num_hidden_layers"] + 1  # 3 linear-attention layers, 1 attention (2)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_the_dequantized_checkpoints_and_near_transformers(checkpoints, case):
    """The quantized checkpoint's logits (a 30-token prompt, 10 decodes) equal those of its
    dequantized values under the same quantization; 8-bit ones stay near transformers' on the
    dequantized weights (cosine per position; top-1 tokens of this random model are close calls:
    8 of 11 agree for the 8-bit Qwen3-Next). A 4-bit one runs
    as int4 re-quantized from its values (the hybrid layout regroups rows), which on this 64-wide
    random model is far from fp32 in any case: equality with the dequantized checkpoint is its check."""
    path, deq_dir, hf = checkpoints[case]
    ids = [(i * 37 + 11) % VOCAB for i in range(40)]
    model = Qwen3Model.from_pretrained(path, dtype="float32")
    got = _logits(model, ids, 30)
    deq = Qwen3Model.from_pretrained(deq_dir, dtype="float32", quantization=model.quantization)
    same = _logits(deq, ids, 30)
    torch.testing.assert_close(got, same, atol=1e-4, rtol=1e-4)
    if CASES[case][2] == 8:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, 29:].float()
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        assert cos.min() >= 0.95, cos  # measured: 0.98 (GPTQ 8-bit groups of 16, then int8 per channel)


def test_a_gptq_rule_overriding_bits_is_refused(checkpoints, tmp_path):
    import json
    import shutil

    path = checkpoints["qwen3_next-gptq8"][0]
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"]["dynamic"] = {r"+:.*\.mlp\..*": {"bits": 4}}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="per-module bits"):
        Qwen3Model.from_pretrained(tmp_path / "m")
