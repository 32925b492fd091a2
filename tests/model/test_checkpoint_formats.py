"""Checkpoints stored quantized (kernels/model_description/checkpoint_format.py): block-wise FP8 written as
Qwen writes it, loaded onto the int8 kernels with a stated error, against transformers on the
dequantized weights; a Qwen3-MoE in FP8; tensor-parallel shards; and every format the loader
cannot read refused by name instead of loaded as 16-bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import TRAINED_DIR
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.model_description.checkpoint_format import checkpoint_format
from fusedserve.kernels.model_description.config import ConfigError, Qwen3Config
from fusedserve.kernels.quantize import quantize_int8
from fusedserve.worker.model.loader import WeightError, load_weights
from fusedserve.worker.model.qwen3 import Qwen3Model
from fusedserve.worker.model.tensor_parallel import TensorParallel
from fusedserve.worker.model.weights import Quantizer
from tests.model.test_quantization import _last_logits, agreement, heldout_positions, hf_logits

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0


def _tensors(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def write_fp8(src: Path, dst: Path, block: tuple[int, int] = (128, 128),
              projections: tuple[str, ...] = PROJECTIONS) -> dict[str, torch.Tensor]:
    """``src`` as Qwen's FP8 releases store it: every projection (a weight whose module is named in
    ``projections``) e4m3 with ``weight_scale_inv`` (one fp32 multiplier per block, amax / 448), the
    rest as it was; ``quantization_config`` in config.json. Returns the dequantized fp32 value of
    every projection."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, dst / f.name)
    bn, bk = block
    out, deq = {}, {}
    for name, w in _tensors(src).items():
        if not (name.endswith(".weight") and name.split(".")[-2] in projections):
            out[name] = w
            continue
        n, k = w.shape
        pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        pad[:n, :k] = w.float()
        blocks = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX  # [n/bn, k/bk]
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        q = (w.float() / full).to(torch.float8_e4m3fn)
        out[name], out[name + "_scale_inv"] = q, scale.contiguous()
        deq[name] = q.float() * full
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return deq


def write_dequantized(src: Path, dst: Path, deq: dict[str, torch.Tensor]) -> Path:
    """``src`` with its projections replaced by ``deq``, fp32: the reference transformers loads."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, dst / f.name)
    tensors = {n: deq.get(n, t.float()).contiguous() for n, t in _tensors(src).items()}
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def fp8_trained(tmp_path_factory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("fp8")
    deq = write_fp8(TRAINED_DIR, root / "fp8")
    return root / "fp8", write_dequantized(TRAINED_DIR, root / "deq", deq), deq


def test_fp8_weights_are_the_dequantized_blocks_requantized_per_channel(fp8_trained):
    """Bound: each int8 weight is within half a step (max |row| / 254) of its FP8 value, and
    equals quantize_int8 of the dequantized fp32 block values exactly."""
    fp8, _, deq = fp8_trained
    assert checkpoint_format(fp8).describe() == "fp8 e4m3, scale blocks 128x128"
    model = Qwen3Model.from_pretrained(fp8, dtype="bfloat16")  # CPU: int8 without asking
    assert model.quantization == "int8" and "w8a8" in model.kernel_info()["linear"]
    c = Qwen3Config.from_dir(fp8)
    w = load_weights(fp8, c, torch.bfloat16, fmt=checkpoint_format(fp8),
                     quantize=Quantizer("int8", torch.bfloat16, torch.device("cpu")))
    want = deq["model.layers.1.mlp.down_proj.weight"]
    got = w.layers[1].down
    q, s = quantize_int8(want)
    assert torch.equal(got.q, q) and torch.equal(got.scale, s)
    err = (got.q.float() * got.scale[:, None] - want).abs()
    assert (err <= want.abs().amax(1, keepdim=True) / 254 * (1 + 1e-4)).all()  # fp32 rounding on top


def test_fp8_logits_agree_with_transformers_on_the_dequantized_weights(fp8_trained):
    """Within the int8 test's bounds (tests/model/test_quantization.py): top-1 on >= 95% of 50
    positions, max |logit error| < 0.5; and far from the garbage of reading e4m3 as 16-bit."""
    fp8, deq_dir, _ = fp8_trained
    ids, ends = heldout_positions()
    ref = hf_logits(deq_dir, ids, ends)
    got = _last_logits(Qwen3Model.from_pretrained(fp8, dtype="bfloat16"), [ids[:e] for e in ends])
    agree, err = agreement(got, ref)
    assert agree >= 0.95 and err < 0.5, (agree, err)


def test_fp8_served_greedy_equals_the_dequantized_model_at_int8(fp8_trained):
    """Through the engine: the FP8 checkpoint and its dequantized fp32 twin quantized to int8 at
    load give the same int8 weights, so the same greedy tokens."""
    fp8, deq_dir, _ = fp8_trained
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["The cat sat on", "Once upon a time"]
    with LLMEngine(str(fp8), dtype="bfloat16", max_batch=2, num_blocks=32) as eng:
        a = [o.token_ids for o in eng.generate(prompts, params)]
    with LLMEngine(str(deq_dir), dtype="bfloat16", quantization="int8", max_batch=2, num_blocks=32) as eng:
        b = [o.token_ids for o in eng.generate(prompts, params)]
    assert a == b and all(len(t) == 24 for t in a)


def test_fp8_moe_logits_agree_with_transformers(moe_dir, tmp_path):
    from transformers import Qwen3MoeForCausalLM

    deq = write_fp8(moe_dir, tmp_path / "fp8", block=(32, 48))  # several blocks, ragged edges
    ref_dir = write_dequantized(moe_dir, tmp_path / "deq", deq)
    assert any(".experts." in n for n in deq)
    ids = [3, 17, 40, 2, 99, 5, 61, 8, 12, 250]
    hf = Qwen3MoeForCausalLM.from_pretrained(ref_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    ends = [3, 6, 10]
    got = _last_logits(Qwen3Model.from_pretrained(tmp_path / "fp8", dtype="float32"), [ids[:e] for e in ends])
    ref = want[[e - 1 for e in ends]]
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert (got - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def test_fp8_tensor_parallel_ranks_read_their_share(hf_checkpoints, tmp_path):
    """Each rank's dequantized q/k/v heads, o_proj columns and MLP slices are the full model's."""
    deq = write_fp8(hf_checkpoints["gqa2_untied"], tmp_path / "fp8", block=(32, 48))
    assert deq
    path, c = tmp_path / "fp8", Qwen3Config.from_dir(tmp_path / "fp8")
    fmt = checkpoint_format(path)
    full = load_weights(path, c, torch.float32, fmt=fmt)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        part = load_weights(path, c, torch.float32, tp, fmt=fmt)
        inter = tp.split(c.intermediate_size)
        assert torch.equal(part.layers[0].down, full.layers[0].down[:, inter.start : inter.stop])
        heads = tp.heads(c)
        cols = slice(heads.start * c.head_dim, heads.stop * c.head_dim)
        assert torch.equal(part.layers[1].o_proj, full.layers[1].o_proj[:, cols])
        assert torch.equal(part.layers[1].qkv[: cols.stop - cols.start], full.layers[1].qkv[cols])


def _with_config(src: Path, dst: Path, qc: dict | None) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if qc is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "hqq", "nbits": 4}, "'hqq'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
])
def test_formats_the_loader_cannot_read_are_refused_by_name(hf_checkpoints, tmp_path, qc, match):
    path = _with_config(hf_checkpoints["gqa2_untied"], tmp_path / "m", qc)
    with pytest.raises(ConfigError, match=match):
        Qwen3Model.from_pretrained(path)
    with pytest.raises(ConfigError, match=match):
        LLMEngine(str(path), max_batch=1, num_blocks=8)


def test_a_config_declaring_awq_over_16_bit_tensors_is_refused(hf_checkpoints, tmp_path):
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    path = _with_config(hf_checkpoints["gqa2_untied"], tmp_path / "m", awq)
    with pytest.raises(WeightError, match="declares awq but projection .* has no .*qweight"):
        Qwen3Model.from_pretrained(path)


def test_fp8_refuses_a_conflicting_quantization_and_fp8_tensors_without_a_config(fp8_trained, tmp_path):
    fp8, _, _ = fp8_trained
    with pytest.raises(ConfigError, match="conflicts with this FP8 checkpoint"):
        Qwen3Model.from_pretrained(fp8, quantization="int4")
    stripped = _with_config(fp8, tmp_path / "stripped", None)
    with pytest.raises(WeightError, match="is FP8 but config.json declares no"):
        Qwen3Model.from_pretrained(stripped)
