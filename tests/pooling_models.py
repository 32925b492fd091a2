"""Small random-weight Qwen3 pooling checkpoints written with transformers, each with a tokenizer
that has what its model card relies on: an embedding model (a sentence-transformers save of the
bare ``Qwen3Model``, last-token pooling, its tokenizer appending ``<|endoftext|>``), a causal-LM
reranker (Qwen3-Reranker's layout: scored by its ``yes``/``no`` tokens) and a sequence-
classification conversion of one (``score.weight``, one label)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer
from tokenizers.processors import TemplateProcessing

from fusedserve.coordinator.model_files.default_model import resolve_model

SHAPE = dict(vocab_size=4160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
             rms_norm_eps=1e-6, rope_theta=10000.0)
ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def _tokenizer(out: Path, append_eos: bool) -> None:
    tok = Tokenizer.from_file(str(resolve_model("default") / "tokenizer.json"))
    tok.add_tokens([AddedToken("yes", special=False, normalized=False)])  # "no" is in the vocabulary
    if append_eos:  # Qwen3-Embedding's tokenizer ends every text with <|endoftext|>
        eos = tok.token_to_id("<|endoftext|>")
        tok.post_processor = TemplateProcessing(single="$A <|endoftext|>",
                                                special_tokens=[("<|endoftext|>", eos)])
    tok.save(str(out / "tokenizer.json"))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in n else p.normal_(0.0, 0.15)


def write_embedding_model(out: Path, seed: int = 0) -> Path:
    from transformers import Qwen3Config, Qwen3Model

    model = Qwen3Model(Qwen3Config(**SHAPE, tie_word_embeddings=True)).eval()
    _randomize(model, seed)
    model.save_pretrained(out)
    (out / "modules.json").write_text(json.dumps(ST_MODULES))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": SHAPE["hidden_size"], "pooling_mode_lasttoken": True,
         "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False}))
    _tokenizer(out, append_eos=True)
    return out


def write_reranker_model(out: Path, seed: int = 1) -> Path:
    """A causal LM in a directory named as a reranker (how Qwen3-Reranker is detected)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, tie_word_embeddings=False)).eval()
    _randomize(model, seed)
    model.save_pretrained(out)
    _tokenizer(out, append_eos=False)
    return out


def write_classifier_model(out: Path, seed: int = 2) -> Path:
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    model = Qwen3ForSequenceClassification(Qwen3Config(**SHAPE, num_labels=1, pad_token_id=0)).eval()
    _randomize(model, seed)
    model.save_pretrained(out)
    _tokenizer(out, append_eos=False)
    return out


def reference_scores(path: Path | str, query: str, docs: list[str],
                     instruction: str | None = None) -> list[float]:
    """Qwen3-Reranker's card with transformers: P(yes) from the yes/no logits at the last position
    of each pair's prompt."""
    from transformers import Qwen3ForCausalLM

    from fusedserve.coordinator.model_files import reranker_prompt
    from fusedserve.coordinator.model_files.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(path)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    no, yes = tok.token_id("no"), tok.token_id("yes")
    out = []
    with torch.no_grad():
        for d in docs:
            logits = model(torch.tensor([reranker_prompt.pair_ids(tok, query, d, instruction)])).logits[0, -1]
            out.append(float(torch.log_softmax(torch.stack([logits[no], logits[yes]]), 0)[1].exp()))
    return out
