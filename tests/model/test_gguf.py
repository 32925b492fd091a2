"""GGUF files (llama.cpp's format), written here with the ``gguf`` package's writer from the
embedded trained model: F16, Q8_0 and Q4_0 served through the one loader path, compared with
transformers reading the same file (its own GGUF dequantization and tokenizer conversion); Q4_0
onto the int4 kernels bit for bit; the tokenizer and chat template from the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import TRAINED_DIR, resolve_model
from fusedserve.coordinator.model_files.gguf_model import is_gguf
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.model_description.checkpoint_format import checkpoint_format
from fusedserve.kernels.model_description.config import ConfigError, Qwen3Config
from fusedserve.kernels.quantize import quantize_int8
from fusedserve.worker.model.gguf_tensors import GGUFTensors
from fusedserve.worker.model.qwen3 import Qwen3Model
from tests.model.test_checkpoint_formats import _tensors
from tests.model.test_quantization import _last_logits, agreement, heldout_positions, hf_logits

gguf = pytest.importorskip("gguf")

HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def add_model_metadata(w, c: Qwen3Config) -> None:
    """The model-shape keys convert_hf_to_gguf.py writes for every Qwen architecture."""
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


def write_gguf(src: Path, dst: Path, qtype: str, pre: str = "gpt-2") -> Path:
    """``src`` (a Qwen3 HF directory) as convert_hf_to_gguf.py + llama-quantize write it: the
    projections and the embedding in ``qtype``, norms F32, the tokenizer and chat template in the
    metadata."""
    c = Qwen3Config.from_dir(src)
    tok = json.loads((src / "tokenizer.json").read_text())
    tcfg = json.loads((src / "tokenizer_config.json").read_text())
    t = getattr(gguf.GGMLQuantizationType, qtype)
    w = gguf.GGUFWriter(str(dst), "qwen3")
    add_model_metadata(w, c)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [v for v, _ in vocab]
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_eos_token_id(c.eos_token_ids[0])
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(tcfg["chat_template"])
    for name, tensor in _tensors(src).items():
        a = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{HF_TO_GGUF[rest.rsplit('.', 1)[0]]}.weight"
        if a.ndim == 1:
            w.add_tensor(gname, a)
        elif qtype == "F16":
            w.add_tensor(gname, a.astype(np.float16))
        else:
            q = gguf.quants.quantize(a, t)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf(TRAINED_DIR, root / f"trained-{q}.gguf", q) for q in ("F16", "Q8_0", "Q4_0")}


def _reference(path: Path, ids: list[int], ends: list[int], tmp: Path) -> torch.Tensor:
    """transformers in fp32 on the file's weights as transformers' own GGUF code dequantizes them
    (``transformers.integrations.gguf.dequant``, independent of the ``gguf`` package), written
    back under their Hugging Face names. (Its ``gguf_file=`` loader cannot be used: it ignores
    ``attention.key_length`` and takes head_dim 128.)"""
    from safetensors.torch import save_file
    from transformers.integrations.gguf.dequant import dequantize

    gguf_to_hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
    gguf_to_hf |= {f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight"
                   for i in range(64) for h, g in HF_TO_GGUF.items()}
    tensors = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        raw = torch.from_numpy(np.array(t.data))
        if t.tensor_type.name in ("F32", "F16"):
            values = raw.float()
        else:
            values = dequantize(raw.view(torch.uint8).reshape(-1), int(t.tensor_type), torch.float32)
        tensors[gguf_to_hf[t.name]] = values.reshape(shape).contiguous()
    ref = tmp / "reference"
    ref.mkdir()
    save_file(tensors, str(ref / "model.safetensors"))
    (ref / "config.json").write_text((TRAINED_DIR / "config.json").read_text())
    return hf_logits(str(ref), ids, ends)


@pytest.mark.parametrize("qtype, quantization, bound", [("F16", None, 0.5), ("Q8_0", "int8", 0.5),
                                                        ("Q4_0", "int4", 1.0)])
def test_gguf_logits_agree_with_transformers_on_the_same_file(ggufs, tmp_path, qtype, quantization, bound):
    """The bounds of tests/model/test_quantization.py per kernel (int4: a 4-bit step): top-1 on >= 95%
    of 50 positions and max |logit error| below ``bound``."""
    path = ggufs[qtype]
    model_dir = resolve_model(str(path))
    fmt = checkpoint_format(model_dir)
    assert fmt.method == "gguf" and fmt.weights == qtype
    ids, ends = heldout_positions()
    model = Qwen3Model.from_pretrained(model_dir, dtype="bfloat16")
    assert model.quantization == quantization
    got = _last_logits(model, [ids[:e] for e in ends])
    agree, err = agreement(got, _reference(path, ids, ends, tmp_path))
    assert agree >= 0.95 and err < bound, (qtype, agree, err)


def test_q4_0_bytes_become_int4_weights_bit_for_bit(ggufs):
    """Q4_0 is fusedserve's int4 scheme: (u - 8) * d equals the gguf package's own dequantization."""
    t = GGUFTensors(ggufs["Q4_0"])
    name = "model.layers.2.mlp.down_proj.weight"
    w = t.read_int4(name)
    assert w is not None and w.u.dtype == torch.uint8 and w.d.dtype == torch.float16
    deq = (w.u.float().view(w.u.shape[0], -1, 32) - 8) * w.d.float()[:, :, None]
    assert torch.equal(deq.view(w.u.shape[0], -1), t.read(name))
    part = t.read_int4(name, rows=range(3, 9), cols=range(32, 96))  # a rank's share: whole groups
    assert torch.equal(part.u, w.u[3:9, 32:96]) and torch.equal(part.d, w.d[3:9, 1:3])
    assert t.read_int4(name, cols=range(16, 64)) is None  # not on a group: dequantized instead


def test_q8_0_is_requantized_per_channel_within_half_a_step(ggufs):
    t = GGUFTensors(ggufs["Q8_0"])
    v = t.read("model.layers.0.self_attn.o_proj.weight")
    q, s = quantize_int8(v)
    err = (q.float() * s[:, None] - v).abs()
    assert (err <= v.abs().amax(1, keepdim=True) / 254 * (1 + 1e-4)).all()


def test_gguf_tokenizer_and_chat_template_come_from_the_metadata(ggufs):
    from transformers import AutoTokenizer

    path = ggufs["Q4_0"]
    model_dir = resolve_model(str(path))
    ours, original = TextTokenizer.from_dir(model_dir), TextTokenizer.from_dir(TRAINED_DIR)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = ((TRAINED_DIR / "heldout.txt").read_text()[:3000]
            + "\n<|im_start|>user\nhi<|im_end|>\n  tabs\t\tand 123,456")
    assert ours.encode(text) == original.encode(text) == hf.encode(text, add_special_tokens=False)
    ids = ours.encode(text)
    assert ours.decode(ids) == original.decode(ids)
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    original_cfg = json.loads((TRAINED_DIR / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == original_cfg["chat_template"]
    assert tcfg["eos_token"] == "<|endoftext|>"  # the file's eos id (0, the checkpoint's eos_token_id)
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 0


def test_qwen2_pre_tokenizer_splits_as_transformers_converts_it(ggufs, tmp_path):
    """A file whose pre-tokenizer is llama.cpp's ``qwen2`` (every Qwen3 GGUF): the split
    pattern before the byte-level BPE matches transformers' conversion of the same file."""
    from transformers import AutoTokenizer

    path = write_gguf(TRAINED_DIR, tmp_path / "qwen2pre.gguf", "Q8_0", pre="qwen2")
    ours = TextTokenizer.from_dir(resolve_model(str(path)))
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Hello world's 12345 numbers,\n\n  spaces\tand ÜNÏCODE — done!!\r\n"
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)


def test_gguf_served_end_to_end_with_its_chat_template(ggufs):
    """``LLMEngine("FILE.gguf")``: int4 kernels, greedy equal to the same file's weights loaded
    as a model directly, and a chat prompt rendered by the file's own template."""
    from fusedserve.coordinator.openai.chat_template import ChatTemplate

    path = ggufs["Q4_0"]
    assert is_gguf(path) and not is_gguf(TRAINED_DIR / "config.json")
    template = ChatTemplate.from_dir(resolve_model(str(path)))
    prompt = template.render([{"role": "user", "content": "Say hi"}])
    assert prompt.startswith("<|im_start|>user\nSay hi<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLMEngine(str(path), max_batch=2, num_blocks=64) as eng:
        assert "w4a8" in eng.model.kernel_info()["linear"]
        served = [o.token_ids for o in eng.generate(["The cat sat on", prompt], params)]
    direct = Qwen3Model.from_pretrained(resolve_model(str(path)), dtype="bfloat16")
    tok = TextTokenizer.from_dir(resolve_model(str(path)))
    with LLMEngine(direct, tokenizer=tok, max_batch=2, num_blocks=64) as eng:
        again = [o.token_ids for o in eng.generate(["The cat sat on", prompt], params)]
    assert served == again and all(len(t) == 12 for t in served)


def test_gguf_refusals(ggufs, tmp_path):
    with pytest.raises(ConfigError, match="conflicts with this GGUF file's Q4_0 weights"):
        LLMEngine(str(ggufs["Q4_0"]), quantization="int8", max_batch=1, num_blocks=8)
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="architecture 'llama' is not supported"):
        resolve_model(str(tmp_path / "llama.gguf"))
