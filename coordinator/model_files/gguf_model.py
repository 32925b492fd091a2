"""``--model FILE.gguf``: a GGUF file (llama.cpp, Ollama) served as it is, its config, tokenizer
and chat template taken from its metadata, as llama.cpp and vLLM do.

The file is recognised by its magic. A sidecar directory in the cache holds what the rest of
the server reads from a Hugging Face directory (``config.json``, ``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``); its ``config.json`` names the file in
``quantization_config`` (``quant_method: "gguf"``), and the weights are read from the file itself
(``worker/model/gguf_tensors.py``), never copied.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from fusedserve.kernels.model_description.config import ConfigError

MAGIC = b"GGUF"
# llama.cpp's pre-tokenizer names -> the split pattern before byte-level BPE.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("qwen2", "gpt-2", "default")
ARCHITECTURES = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
                 "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
                 "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
                 "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next")}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types that are special tokens
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_qkv",
               "attn_gate", "ssm_out")


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with p.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def gguf_model_dir(path: str | Path, cache: Path) -> Path:
    """The sidecar directory of a GGUF file, written once per file version under ``cache``."""
    path = Path(path).resolve()
    st = path.stat()
    key = hashlib.sha1(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    final = cache / f"gguf-{path.stem}-{key}"
    if (final / "config.json").is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-", dir=cache))
    try:
        write_sidecar(path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process wrote it first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


class _Meta:
    """A GGUF file's key-value metadata, typed."""

    def __init__(self, reader: Any):
        self.fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return value.decode() if isinstance(value, bytes) else value


def write_sidecar(path: Path, out: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(path), "r")
    meta = _Meta(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                          f"{', '.join(ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}
    out.joinpath("config.json").write_text(json.dumps(_config(path, arch, meta, tensors), indent=1))
    tok, tok_config = _tokenizer(path, meta)
    tok.save(str(out / "tokenizer.json"))
    out.joinpath("tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    gen = {"eos_token_id": eos} if eos is not None else {}
    out.joinpath("generation_config.json").write_text(json.dumps(gen))


def weight_type(tensors: dict[str, Any]) -> str:
    """The most common type among the projections (the file's quantization, e.g. Q4_0, Q8_0)."""
    kinds = Counter(t.tensor_type.name for n, t in tensors.items()
                    if n.startswith("blk.") and n.rsplit(".", 2)[-2] in PROJECTIONS)
    if not kinds:
        raise ConfigError("GGUF file has no projection tensors (blk.N.attn_q.weight, ...)")
    return kinds.most_common(1)[0][0]


def _config(path: Path, arch: str, meta: _Meta, tensors: dict[str, Any]) -> dict:
    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ConfigError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ConfigError(f"{path}: GGUF file has no token_embd.weight")
    cls, model_type = ARCHITECTURES[arch]
    cfg = {
        "architectures": [cls], "model_type": model_type,
        "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "intermediate_size": int(meta.get(f"{arch}.feed_forward_length", 0)
                                 or meta.get(f"{arch}.expert_feed_forward_length", 0)),
        "num_hidden_layers": int(need("block_count")),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 1_000_000.0)),
        "vocab_size": int(embed.shape[1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu", "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "gguf", "file": str(path), "weights": weight_type(tensors)},
    }
    if meta.get(f"{arch}.rope.scaling.type") == "yarn":
        original = int(meta.get(f"{arch}.rope.scaling.original_context_length"))
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": float(meta.get(f"{arch}.rope.scaling.factor")),
                               "original_max_position_embeddings": original}
    for key in ("bos_token_id", "eos_token_id"):
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            cfg[key] = int(meta.get(f"tokenizer.ggml.{key}"))
    if meta.get(f"{arch}.expert_count"):
        cfg.update(_moe_config(need, meta, arch))
    if arch in ("qwen35", "qwen35moe", "qwen3next"):
        cfg.update(_hybrid_config(need, cfg))
    return cfg


def _moe_config(need, meta: _Meta, arch: str) -> dict:
    """An MoE file's experts (llama.cpp normalises the chosen experts' weights for these
    architectures, as their Hugging Face configs say); every layer sparse."""
    out = {"num_experts": int(need("expert_count")), "num_experts_per_tok": int(need("expert_used_count")),
           "moe_intermediate_size": int(need("expert_feed_forward_length")), "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": []}
    shared = meta.get(f"{arch}.expert_shared_feed_forward_length")
    if shared:
        out["shared_expert_intermediate_size"] = int(shared)
    return out


def _hybrid_config(need, cfg: dict) -> dict:
    """A ``qwen35`` file's Gated DeltaNet fields, as transformers' Qwen3.5 config names them (the
    metadata llama.cpp's converter writes: ``ssm.*``, ``attention.recurrent_layers``, the rotary
    dims; its mrope sections reduce to plain rotary for text, as the loader checks)."""
    heads, groups = int(need("ssm.time_step_rank")), int(need("ssm.group_count"))
    recurrent = list(need("attention.recurrent_layers"))[: cfg["num_hidden_layers"]]
    rotary = int(need("rope.dimension_count"))
    return {"linear_num_key_heads": groups, "linear_num_value_heads": heads,
            "linear_key_head_dim": int(need("ssm.state_size")),
            "linear_value_head_dim": int(need("ssm.inner_size")) // heads,
            "linear_conv_kernel_dim": int(need("ssm.conv_kernel")),
            "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                "partial_rotary_factor": rotary / cfg["head_dim"]}}


def _tokenizer(path: Path, meta: _Meta):
    """A ``tokenizers`` byte-level BPE from ``tokenizer.ggml.*`` (model ``gpt2``), and its
    tokenizer_config (chat template, special tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise ConfigError(f"{path}: GGUF tokenizer model {model!r} is not supported "
                          "(byte-level BPE, 'gpt2', only)")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported "
                          f"({', '.join(PRE_TOKENIZERS)})")
    tokens = [t.decode() if isinstance(t, bytes) else t for t in meta.get("tokenizer.ggml.tokens")]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    if pre == "qwen2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                           "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}
    for key, name in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id")):
        idx = meta.get(f"tokenizer.ggml.{name}")
        if idx is not None and 0 <= int(idx) < len(tokens):
            cfg[key] = tokens[int(idx)]
    template = meta.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return tok, cfg
