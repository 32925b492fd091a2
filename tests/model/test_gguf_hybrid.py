"""GGUF files of Qwen3-MoE (``qwen3moe``), Qwen3.5 dense and MoE (``qwen35``, ``qwen35moe``) and
Qwen3-Next (``qwen3next``), written here as llama.cpp's converter writes them (``conversion/qwen.py``:
tensor names from the ``gguf`` package's own map, experts stacked, zero-centred norms stored as
1 + w, ``ssm_a = -exp(A_log)``, the conv squeezed, Qwen3-Next's in_proj_qkvz split, Qwen3.5's value
heads reordered from grouped by key head to tiled): an F32 file's logits equal transformers' on
the checkpoint it was written from; a Q8_0 file runs as int8 near them; a file is served."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.worker.model.qwen3 import Qwen3Model
from tests.model.test_checkpoint_formats import _tensors
from tests.model.test_gguf import add_model_metadata
from tests.model.test_hybrid_models import COMMON, VOCAB, _classes, _logits, _randomise

gguf = pytest.importorskip("gguf")


def _tiled(t: torch.Tensor, dim: int, nk: int, per: int, head: int) -> torch.Tensor:
    """The converter's ``_reorder_v_heads``: value heads grouped by key head -> tiled."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nk, per, head, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def write_qwen_gguf(src, dst, qtype: str, arch: str):
    """``src`` (a Qwen3-MoE or hybrid HF directory) as convert_hf_to_gguf.py (+ llama-quantize)
    writes it as ``arch`` (qwen3moe, qwen35, qwen35moe, qwen3next): experts stacked per projection,
    the router and shared-expert gate kept F32, Qwen3-Next's in_proj_qkvz split into attn_qkv and
    attn_gate, Qwen3.5's value heads tiled."""
    c = Qwen3Config.from_dir(src)
    w = gguf.GGUFWriter(str(dst), arch)
    add_model_metadata(w, c)
    if c.num_experts:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if c.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    la = c.linear_attention
    if la is not None:
        w.add_ssm_conv_kernel(la.conv_kernel)
        w.add_ssm_state_size(la.key_head_dim)
        w.add_ssm_group_count(la.num_key_heads)
        w.add_ssm_time_step_rank(la.num_value_heads)
        w.add_ssm_inner_size(la.value_head_dim * la.num_value_heads)
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
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), c.num_hidden_layers)
    t = getattr(gguf.GGMLQuantizationType, qtype)

    def add(gname: str, x: torch.Tensor) -> None:
        a = np.ascontiguousarray(x.numpy(), dtype=np.float32)
        # kept F32 as llama-quantize keeps them: vectors, the conv, the routers, rows not of whole blocks
        kept = a.ndim == 1 or "ssm_conv1d" in gname or "ffn_gate_inp" in gname or a.shape[-1] % 32
        if kept or qtype == "F32":
            w.add_tensor(gname, a)
        else:
            q = gguf.quants.quantize(a, t)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=t)

    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in _tensors(src).items():
        x = tensor.float()
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight", name)
        if m:
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = x
            continue
        if la is not None and ".linear_attn." in name:
            x = _linear_attn_tensor(name, x, c, tiled=arch != "qwen3next")
            if name.endswith("in_proj_qkvz.weight"):  # per key head [q, k, v, z] -> [q, k, v], [z]
                nk, dk = la.num_key_heads, la.key_head_dim
                r_dv = la.num_value_heads // nk * la.value_head_dim
                q, k, v, z = x.t().reshape(-1, nk, 2 * dk + 2 * r_dv).split([dk, dk, r_dv, r_dv], dim=-1)
                blk = name.split(".")[2]
                qkv = torch.cat([p.reshape(c.hidden_size, -1) for p in (q, k, v)], -1)
                add(f"blk.{blk}.attn_qkv.weight", qkv.t())
                add(f"blk.{blk}.attn_gate.weight", z.reshape(c.hidden_size, -1).t())
                continue
        base = name.removesuffix(".weight")
        suffix = ".weight"
        if name.endswith(".A_log"):
            x, suffix = -torch.exp(x), ""
        elif name.endswith(".dt_bias"):
            base, suffix = name.removesuffix(".dt_bias") + ".dt_proj", ".bias"
        elif "conv1d" in name:
            x = x.squeeze()
        elif la is not None and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + 1
        add(names.get_name(base) + suffix, x)
    for (layer, proj), by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in range(c.num_experts)])
        add(names.get_name(f"model.layers.{layer}.mlp.experts.{proj}") + ".weight", stacked)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _linear_attn_tensor(name: str, x: torch.Tensor, c: Qwen3Config, tiled: bool) -> torch.Tensor:
    """Qwen3.5's converter: value heads grouped by key head -> tiled, on every value-head axis."""
    la = c.linear_attention
    nk, nv, dv = la.num_key_heads, la.num_value_heads, la.value_head_dim
    per, qk = nv // nk, 2 * nk * la.key_head_dim
    if not tiled or per == 1:
        return x
    if name.endswith("in_proj_qkv.weight") or name.endswith("conv1d.weight"):
        return torch.cat([x[:qk], _tiled(x[qk:], 0, nk, per, dv)])
    if name.endswith("in_proj_z.weight"):
        return _tiled(x, 0, nk, per, dv)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return _tiled(x, 0, nk, per, 1)
    if name.endswith("out_proj.weight"):
        return _tiled(x, 1, nk, per, dv)
    return x


QWEN3_MOE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                 max_position_embeddings=512, tie_word_embeddings=False)
# GGUF architecture -> the Hugging Face model it comes from
ARCHES = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next", "qwen3moe": "qwen3_moe"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """arch -> (transformers' fp32 model, {qtype: GGUF file}); the hybrids with 2 key heads and 4
    value heads (Qwen3.5's files tile them)."""
    import transformers as tf

    out = {}
    for i, (arch, hf_arch) in enumerate(ARCHES.items()):
        torch.manual_seed(11 + i)
        if hf_arch == "qwen3_moe":
            model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**QWEN3_MOE)).eval()
        else:
            cfg_cls, model_cls, extra = _classes(hf_arch)
            model = model_cls(cfg_cls(**COMMON, **extra)).eval()
        _randomise(model, 11 + i)
        root = tmp_path_factory.mktemp(arch)
        model.save_pretrained(root / "hf")
        out[arch] = (model, {q: write_qwen_gguf(root / "hf", root / f"m-{q}.gguf", q, arch)
                             for q in ("F32", "Q8_0")})
    return out


IDS = [(i * 37 + 11) % VOCAB for i in range(40)]


@pytest.mark.parametrize("arch", list(ARCHES))
def test_an_f32_file_equals_transformers_on_its_checkpoint(files, arch):
    hf, paths = files[arch]
    model = Qwen3Model.from_pretrained(resolve_model(str(paths["F32"])), dtype="float32")
    assert model.config.num_experts == (0 if arch == "qwen35" else 4)
    assert model.config.hybrid == (arch != "qwen3moe")
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0, 29:].float()
    torch.testing.assert_close(_logits(model, IDS, 30), ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_a_q8_0_file_runs_as_int8_near_transformers(files, arch):
    hf, paths = files[arch]
    model = Qwen3Model.from_pretrained(resolve_model(str(paths["Q8_0"])), dtype="float32")
    assert model.quantization == "int8"
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0, 29:].float()
    cos = torch.nn.functional.cosine_similarity(_logits(model, IDS, 30), ref, dim=-1)
    assert cos.min() >= 0.95, cos


def test_a_qwen35_file_is_served_as_its_model(files):
    path = files["qwen35"][1]["F32"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [IDS[:7], IDS[:33]]
    with LLMEngine(str(path), dtype="float32", max_batch=2, num_blocks=64) as eng:
        served = [o.token_ids for o in eng.generate(prompts, params)]
    model_dir = resolve_model(str(path))
    direct = Qwen3Model.from_pretrained(model_dir, dtype="float32")
    with LLMEngine(direct, tokenizer=TextTokenizer.from_dir(model_dir), max_batch=2, num_blocks=64) as eng:
        assert [o.token_ids for o in eng.generate(prompts, params)] == served
