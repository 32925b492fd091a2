"""AWQ and GPTQ checkpoints (worker/model/group_quant.py), packed here as AutoAWQ (GEMM) and
GPTQ (v1: zero points stored less one) pack them, from the embedded trained model: loaded onto
the int4 kernel with zero points bit for bit where groups cover runs of 32 inputs, re-quantized
where they do not (desc_act) or where the bits are 8; logits against transformers on the
dequantized weights; tensor-parallel shares."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import TRAINED_DIR
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.model_description.checkpoint_format import checkpoint_format
from fusedserve.kernels.model_description.config import ConfigError, Qwen3Config
from fusedserve.kernels.quantize import dequantize_int4
from fusedserve.worker.model.loader import load_weights
from fusedserve.worker.model.qwen3 import Qwen3Model
from fusedserve.worker.model.tensor_parallel import TensorParallel
from tests.model.test_checkpoint_formats import PROJECTIONS, _tensors, write_dequantized
from tests.model.test_quantization import _last_logits, agreement, heldout_positions, hf_logits

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(fields: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] small ints -> int32 words [R, C * bits / 32], field i of a word at bits * i (AutoAWQ:
    the word's field i holds column ``order[i]`` of its run)."""
    per = 32 // bits
    f = fields.astype(np.uint32).reshape(fields.shape[0], -1, per)
    if order is not None:
        f = f[:, :, list(order)]
    words = np.zeros(f.shape[:2], dtype=np.uint32)
    for i in range(per):
        words |= (f[:, :, i] & ((1 << bits) - 1)) << np.uint32(bits * i)
    return torch.from_numpy(words.view(np.int32).copy())


def _quantize_groups(w: torch.Tensor, groups: torch.Tensor, n_groups: int, bits: int, sym: bool,
                     zero_min: int = 0):
    """Min-max asymmetric (or symmetric) quantization per (group, output): q [out, in],
    z [G, out], s [G, out] fp16 and the dequantized weight."""
    top = (1 << bits) - 1
    wt = w.float()
    s = torch.empty(n_groups, w.shape[0])
    z = torch.empty(n_groups, w.shape[0], dtype=torch.int64)
    for g in range(n_groups):
        cols = wt[:, groups == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            s[g] = torch.maximum(hi, -lo).clamp(min=1e-8) * 2 / top
            z[g] = (top + 1) // 2
        else:
            s[g] = (hi - lo).clamp(min=1e-8) / top
            z[g] = torch.round(-lo / s[g]).clamp(zero_min, top).long()
    s = s.half()
    sg, zg = s.float()[groups].t(), z[groups].t()
    q = torch.clamp(torch.round(wt / sg) + zg, 0, top).long()
    return q, z, s, (q - zg).float() * sg


def write_group_quant(src: Path, dst: Path, method: str, bits: int = 4, group: int = 128, sym: bool = False,
                      desc_act: bool = False, projections: tuple[str, ...] = PROJECTIONS,
                      config: dict | None = None) -> dict[str, torch.Tensor]:
    """``src`` as AutoAWQ or GPTQ write it (the weights of modules named in ``projections`` packed;
    ``config`` added to its quantization_config); returns the dequantized projections."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    out, deq = {}, {}
    gen = torch.Generator().manual_seed(3)
    for name, w in _tensors(src).items():
        if not (name.endswith(".weight") and name.split(".")[-2] in projections):
            out[name] = w
            continue
        prefix, k = name[: -len(".weight")], w.shape[1]
        n_groups = k // group
        groups = torch.arange(k) // group
        if desc_act:  # GPTQ's act order: groups follow a permutation of the inputs
            groups = groups[torch.argsort(torch.randperm(k, generator=gen))]
        zero_min = 1 if method == "gptq" else 0  # GPTQ v1 cannot store a zero point of 0
        q, z, s, deq[name] = _quantize_groups(w, groups, n_groups, bits, sym, zero_min)
        if method == "awq":
            out[prefix + ".qweight"] = _pack(q.t().numpy(), 4, AWQ_ORDER)
            out[prefix + ".qzeros"] = _pack(z.numpy(), 4, AWQ_ORDER)
        else:
            out[prefix + ".qweight"] = _pack(q.numpy(), bits).t().contiguous()  # [in * bits / 32, out]
            out[prefix + ".qzeros"] = _pack((z - 1).numpy(), bits)  # v1: stored less one
            out[prefix + ".g_idx"] = groups.int()
        out[prefix + ".scales"] = s
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if method == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                      "zero_point": True, "version": "gemm"}
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group,
                                      "desc_act": desc_act, "sym": sym, "checkpoint_format": "gptq"}
    cfg["quantization_config"].update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return deq


CASES = {  # name: (method, bits, sym, desc_act, quantization it runs as, exact int4)
    "awq": ("awq", 4, False, False, "int4", True),
    "gptq4-sym": ("gptq", 4, True, False, "int4", True),
    "gptq4-asym-act-order": ("gptq", 4, False, True, "int8", False),
    "gptq8": ("gptq", 8, False, False, "int8", False),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, Path, dict]]:
    root = tmp_path_factory.mktemp("gq")
    made = {}
    for name, (method, bits, sym, act, _, _) in CASES.items():
        deq = write_group_quant(TRAINED_DIR, root / name, method, bits, sym=sym, desc_act=act)
        made[name] = (root / name, write_dequantized(TRAINED_DIR, root / f"{name}-deq", deq), deq)
    return made


@pytest.mark.parametrize("case", list(CASES))
def test_logits_agree_with_transformers_on_the_dequantized_weights(checkpoints, case):
    """int4 bound of tests/model/test_quantization.py (a 4-bit step); 8-bit within int8's."""
    path, deq_dir, _ = checkpoints[case]
    *_, runs_as, _ = CASES[case]
    ids, ends = heldout_positions()
    ref = hf_logits(deq_dir, ids, ends)
    model = Qwen3Model.from_pretrained(path, dtype="bfloat16")
    assert model.quantization == runs_as
    agree, err = agreement(_last_logits(model, [ids[:e] for e in ends]), ref)
    assert agree >= 0.95 and err < (1.0 if runs_as == "int4" else 0.5), (case, agree, err)


@pytest.mark.parametrize("case", ["awq", "gptq4-sym"])
def test_in_order_groups_are_int4_with_zero_points_bit_for_bit(checkpoints, case):
    path, _, deq = checkpoints[case]
    c = Qwen3Config.from_dir(path)
    from fusedserve.worker.model.weights import Quantizer

    w = load_weights(path, c, torch.bfloat16, fmt=checkpoint_format(path),
                     quantize=Quantizer("int4", torch.bfloat16, torch.device("cpu")))
    down = w.layers[1].down
    assert down.z is not None and down.d.dtype == torch.float16
    want = deq["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(dequantize_int4(down.u, down.d, down.in_features, torch.float32, down.z), want)


@pytest.mark.parametrize("case", ["gptq4-asym-act-order", "gptq8"])
def test_act_order_and_8_bit_are_requantized_to_int8_within_half_a_step(checkpoints, case):
    """g_idx in a permuted order (every input its own group's scale and zero point) is exact
    before re-quantizing: the int8 weights are within max |row| / 254 of the checkpoint's."""
    path, _, deq = checkpoints[case]
    from fusedserve.worker.model.weights import Quantizer

    assert checkpoint_format(path).quantization(None, "cpu") == "int8"
    w = load_weights(path, Qwen3Config.from_dir(path), torch.bfloat16, fmt=checkpoint_format(path),
                     quantize=Quantizer("int8", torch.bfloat16, torch.device("cpu")))
    down, want = w.layers[0].down, deq["model.layers.0.mlp.down_proj.weight"]
    err = (down.q.float() * down.scale[:, None] - want).abs()
    assert (err <= want.abs().amax(1, keepdim=True) / 254 * (1 + 1e-4)).all()


def test_group_quant_tensor_parallel_ranks_read_their_share(checkpoints):
    path, _, _ = checkpoints["gptq4-sym"]
    c, fmt = Qwen3Config.from_dir(path), checkpoint_format(path)
    full = load_weights(path, c, torch.float32, fmt=fmt)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        part = load_weights(path, c, torch.float32, tp, fmt=fmt)
        inter = tp.split(c.intermediate_size)
        assert torch.equal(part.layers[0].down, full.layers[0].down[:, inter.start : inter.stop])
        gate = full.layers[0].gate_up[inter.start : inter.stop]
        assert torch.equal(part.layers[0].gate_up[: len(inter)], gate)


def test_served_greedy_equals_the_direct_model(checkpoints):
    path, _, _ = checkpoints["awq"]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with LLMEngine(str(path), max_batch=2, num_blocks=64) as eng:
        assert "w4a8" in eng.model.kernel_info()["linear"]
        served = [o.token_ids for o in eng.generate(["The cat sat on", "Once upon a time"], params)]
    direct = Qwen3Model.from_pretrained(path, dtype="bfloat16")
    with LLMEngine(direct, tokenizer=TextTokenizer.from_dir(path), max_batch=2, num_blocks=64) as eng:
        again = [o.token_ids for o in eng.generate(["The cat sat on", "Once upon a time"], params)]
    assert served == again and all(len(t) == 16 for t in served)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "AWQ 8-bit"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ 3-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
])
def test_unsupported_variants_are_refused(checkpoints, tmp_path, qc, match):
    path = tmp_path / "m"
    shutil.copytree(checkpoints["awq"][0], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match):
        Qwen3Model.from_pretrained(path)


def test_a_conflicting_quantization_is_refused(checkpoints):
    with pytest.raises(ConfigError, match="conflicts with this AWQ checkpoint"):
        Qwen3Model.from_pretrained(checkpoints["awq"][0], quantization="int8")
