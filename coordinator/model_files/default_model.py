"""The embedded models: ``default``, a small trained Qwen3 shipped in the package, and the
random-weight presets ``default:tiny`` and ``default:benchmark``, written on first use.

``default`` lives in ``coordinator/model_files/default_model/`` (trained by ``train_default.py``
beside this file on the Python documentation; see its ``training.json``). The presets' weights come from
a fixed seed and their tokenizer is a byte-level BPE trained on a built-in text, so every
machine writes the same files: tests that want a random model, and the benchmarks, use
them. A real model directory with its own ``tokenizer.json`` is used as is.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fusedserve.coordinator.model_files.gguf_model import gguf_model_dir, is_gguf

log = logging.getLogger(__name__)

DEFAULT_NAME = "fusedserve-qwen3"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's chat format: ChatML turns, tools in the system turn, Hermes <tool_call> blocks,
# tool results as <tool_response> in a user turn, <think> blocks, and enable_thinking.
CHAT_TEMPLATE = "".join(  # one line per tag in the file; its text's newlines are '\n' escapes
    line.strip() for line in (Path(__file__).with_name("qwen3_chat_template.jinja")).read_text().splitlines())
FORMAT = 4  # bump when the written files change: a cache of an older format is rewritten

#: Shape of the embedded model; ``benchmark`` is large enough to spill the CPU caches.
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "benchmark": dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072,
                      num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=64),
    # Qwen3-0.6B's real configuration (random weights): the CPU peer benchmark's model.
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960),
}

# Qwen3's released generation_config.json sampling values (the presets that stand for a real model).
GENERATION = {"qwen3-0.6b": {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}}

_CORPUS = """\
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
A serving system batches requests so that one pass over the weights produces many tokens.
Large language models predict the next token from the tokens before it.
Once upon a time there was a small model that wanted to answer every question quickly.
The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
def hello(name):\n    return f"Hello, {name}!"\nprint(hello("world"))
Memory bandwidth limits decoding: each step reads every weight once for the whole batch.
Questions and answers: What is two plus two? Four. What colour is the sky? Blue.
"""


def cache_root() -> Path:
    return Path(os.environ.get("FUSEDSERVE_CACHE", Path.home() / ".cache" / "fusedserve"))


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained deterministically on the built-in corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def write_checkpoint(out_dir: Path, preset: str = "tiny", seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json, model.safetensors and tokenizer.json for a preset."""
    shape = dict(PRESETS[preset])
    tied = shape.pop("tie_word_embeddings", False)
    max_pos = shape.pop("max_position_embeddings", 2048)
    tok = build_tokenizer(min(shape["vocab_size"], 1024))
    eos = tok.token_to_id("<|endoftext|>")
    config = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", **shape,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=max_pos,
        tie_word_embeddings=tied, attention_bias=False, hidden_act="silu",
        eos_token_id=eos, bos_token_id=None, torch_dtype=str(dtype).removeprefix("torch."),
    )
    g = torch.Generator().manual_seed(seed)
    hidden, inter, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd

    def rand(*s: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*s, generator=g) * std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(shape["vocab_size"], hidden, std=1.0),
               "lm_head.weight": rand(shape["vocab_size"], hidden, std=2.0 * hidden**-0.5),
               "model.norm.weight": ones(hidden)}
    if tied:
        del tensors["lm_head.weight"]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": ones(hidden),
            p + "post_attention_layernorm.weight": ones(hidden),
            p + "self_attn.q_proj.weight": rand(q, hidden, std=hidden**-0.5),
            p + "self_attn.k_proj.weight": rand(kv, hidden, std=hidden**-0.5),
            p + "self_attn.v_proj.weight": rand(kv, hidden, std=hidden**-0.5),
            p + "self_attn.o_proj.weight": rand(hidden, q, std=q**-0.5),
            p + "self_attn.q_norm.weight": ones(hd),
            p + "self_attn.k_norm.weight": ones(hd),
            p + "mlp.gate_proj.weight": rand(inter, hidden, std=hidden**-0.5),
            p + "mlp.up_proj.weight": rand(inter, hidden, std=hidden**-0.5),
            p + "mlp.down_proj.weight": rand(hidden, inter, std=inter**-0.5),
        }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(config["max_position_embeddings"]), indent=2))
    if preset in GENERATION:  # the real model's sampling defaults, as its generation_config.json ships them
        generation = {**GENERATION[preset], "eos_token_id": eos}
        (out_dir / "generation_config.json").write_text(json.dumps(generation))


def tokenizer_config(model_max_length: int) -> dict:
    """The embedded models' tokenizer_config.json. ``tokenizer_class`` makes transformers read
    tokenizer.json as written: by the model type alone it would build Qwen2's tokenizer, whose own
    pre-tokenizer splits digits where ours does not, and a client's ids would not be the server's."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
            "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
            "model_max_length": model_max_length}


def default_model_dir(preset: str = "tiny") -> Path:
    """The embedded model's directory, written atomically on first use.

    Several workers may ask at once: each writes a private temp dir and renames it
    into place; a loser of the race just uses the winner's files.
    """
    final = cache_root() / f"{DEFAULT_NAME}-{preset}-v{FORMAT}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        log.info("writing the embedded %s model to %s", preset, final)
        write_checkpoint(tmp, preset)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


TRAINED_DIR = Path(__file__).resolve().parent / "default_model"


# What a served model needs of a Hugging Face repository (not its other formats' weights).
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*"]


class ModelNotFound(FileNotFoundError):
    """No directory, embedded model or Hugging Face repository by that name (one line: the CLI's)."""


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """``default``: the trained embedded model; ``default:PRESET``: a random-weight preset; a
    directory; a GGUF file (its sidecar directory, ``gguf_model.py``); else a Hugging Face id
    (``ORG/NAME``), found in the hub's local cache first
    (``download_dir`` if given) and downloaded where the network allows (not with
    ``HF_HUB_OFFLINE=1``)."""
    if model == "default":
        if not (TRAINED_DIR / "config.json").is_file():
            raise ModelNotFound(f"the embedded default model is missing from {TRAINED_DIR}")
        return TRAINED_DIR
    if model.startswith("default:"):
        return default_model_dir(model.partition(":")[2])
    path = Path(model)
    if path.is_dir():
        return path
    if is_gguf(path):
        return gguf_model_dir(path, cache_root())
    if model.count("/") != 1 or model.startswith((".", "/")) or model.endswith("/"):
        raise ModelNotFound(f"model {model!r}: no such directory, and not a Hugging Face id (ORG/NAME)")
    return _from_hub(model, revision, download_dir)


def _from_hub(repo: str, revision: str | None, download_dir: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE, HF_HUB_OFFLINE

    name = f"{repo!r}" + (f" (revision {revision})" if revision else "")
    where = download_dir or HF_HUB_CACHE
    kw = {"revision": revision, "cache_dir": download_dir, "allow_patterns": HUB_FILES}
    try:  # the cache first: no request at all when the snapshot is there
        return Path(snapshot_download(repo, local_files_only=True, **kw))
    except Exception:  # noqa: BLE001 - not cached (or partly): try the network below
        pass
    if HF_HUB_OFFLINE:
        raise ModelNotFound(f"model {name} is not in the Hugging Face cache at {where}, and HF_HUB_OFFLINE "
                            "is set") from None
    try:
        return Path(snapshot_download(repo, **kw))
    except Exception as exc:  # noqa: BLE001 - no such repository, no network, no access: one line
        raise ModelNotFound(f"model {name} is not in the Hugging Face cache at {where} and could not be "
                            f"downloaded ({type(exc).__name__})") from None
