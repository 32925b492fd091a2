"""Qwen3.5 GGUF files (llama.cpp's ``qwen35``), written here as llama.cpp's converter writes them
(``conversion/qwen.py``: tensor names from the ``gguf`` package's own map, zero-centred norms
stored as 1 + w, ``ssm_a = -exp(A_log)``, the conv squeezed, value heads reordered from grouped
by key head to tiled where they outnumber the key heads): an F32 file's logits equal
transformers' on the checkpoint it was written from; a Q8_0 file runs as int8 near them; a file
is served end to end; MoE hybrids' files are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.model_description.config import ConfigError, Qwen3Config
from fusedserve.worker.model.qwen3 import Qwen3Model
from tests.model.test_checkpoint_formats import _tensors
from tests.model.test_hybrid_models import COMMON, VOCAB, _classes, _logits, _randomise

gguf = pytest.importorskip("gguf")


def _tiled(t: torch.Tensor, dim: int, nk: int, per: int, head: int) -> torch.Tensor:
    """The converter's ``_reorder_v_heads``: value heads grouped by key head -> tiled."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nk, per, head, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def write_qwen35_gguf(src, dst, qtype: str, arch: str = "qwen35"):
    """``src`` (a Qwen3.5 HF directory) as convert_hf_to_gguf.py (+ llama-quantize) writes it."""
    c = Qwen3Config.from_dir(src)
    la = c.linear_attention
    nk, nv, dk, dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
    per, qk = nv // nk, 2 * nk * dk
    w = gguf.GGUFWriter(str(dst), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_ssm_conv_kernel(la.conv_kernel)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(dv * nv)
    # the converter's add_recurrent_layers (a newer gguf package than the pinned one has it)
    w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in c.layer_types])
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(c.rotary_dim)
    w.add_rope_dimension_sections([c.rotary_dim // 2, 0, 0, 0])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges([])
    w.add_eos_token_id(VOCAB - 1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, c.num_hidden_layers)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    for name, tensor in _tensors(src).items():
        x = tensor.float()
        if ".linear_attn." in name and per > 1:
            if name.endswith("in_proj_qkv.weight") or name.endswith("conv1d.weight"):
                x = torch.cat([x[:qk], _tiled(x[qk:], 0, nk, per, dv)])
            elif name.endswith("in_proj_z.weight"):
                x = _tiled(x, 0, nk, per, dv)
            elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
                x = _tiled(x, 0, nk, per, 1)
            elif name.endswith("out_proj.weight"):
                x = _tiled(x, 1, nk, per, dv)
        base = name.removesuffix(".weight")
        if name.endswith(".A_log"):
            x = -torch.exp(x)
        elif name.endswith(".dt_bias"):
            base = name.removesuffix(".dt_bias") + ".dt_proj"
        elif "conv1d" in name:
            x = x.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + 1
        gname = names.get_name(base) + (".bias" if name.endswith(".dt_bias") else
                                        "" if name.endswith(".A_log") else ".weight")
        a = x.numpy()
        if a.ndim == 1 or "conv1d" in name or qtype == "F32":
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
        else:
            q = gguf.quants.quantize(np.ascontiguousarray(a), t)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """(HF directory, transformers' fp32 model, {qtype: GGUF file}); 2 key heads, 4 value heads."""
    cfg_cls, model_cls, extra = _classes("qwen3_5")
    torch.manual_seed(11)
    model = model_cls(cfg_cls(**COMMON, **extra)).eval()
    _randomise(model, 11)
    root = tmp_path_factory.mktemp("qwen35gguf")
    model.save_pretrained(root / "hf")
    files = {q: write_qwen35_gguf(root / "hf", root / f"m-{q}.gguf", q) for q in ("F32", "Q8_0")}
    return root / "hf", model, files


IDS = [(i * 37 + 11) % VOCAB for i in range(40)]


def test_an_f32_file_equals_transformers_on_its_checkpoint(qwen35):
    _, hf, files = qwen35
    model = Qwen3Model.from_pretrained(resolve_model(str(files["F32"])), dtype="float32")
    assert model.config.hybrid and model.config.linear_attention.num_value_heads == 4
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0, 29:].float()
    torch.testing.assert_close(_logits(model, IDS, 30), ref, atol=2e-4, rtol=1e-4)


def test_a_q8_0_file_runs_as_int8_near_transformers(qwen35):
    _, hf, files = qwen35
    model = Qwen3Model.from_pretrained(resolve_model(str(files["Q8_0"])), dtype="float32")
    assert model.quantization == "int8"
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0, 29:].float()
    cos = torch.nn.functional.cosine_similarity(_logits(model, IDS, 30), ref, dim=-1)
    assert cos.min() >= 0.95, cos


def test_a_qwen35_file_is_served_as_its_model(qwen35):
    _, _, files = qwen35
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [IDS[:7], IDS[:33]]
    with LLMEngine(str(files["F32"]), dtype="float32", max_batch=2, num_blocks=64) as eng:
        served = [o.token_ids for o in eng.generate(prompts, params)]
    model_dir = resolve_model(str(files["F32"]))
    direct = Qwen3Model.from_pretrained(model_dir, dtype="float32")
    with LLMEngine(direct, tokenizer=TextTokenizer.from_dir(model_dir), max_batch=2, num_blocks=64) as eng:
        assert [o.token_ids for o in eng.generate(prompts, params)] == served


def test_moe_hybrid_files_are_refused_by_name(qwen35, tmp_path):
    path = write_qwen35_gguf(qwen35[0], tmp_path / "moe.gguf", "F32", arch="qwen35moe")
    with pytest.raises(ConfigError, match="qwen35moe"):
        resolve_model(str(path))
