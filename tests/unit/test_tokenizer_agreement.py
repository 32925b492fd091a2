"""A client's tokenizer and the server's give the same ids: transformers' AutoTokenizer on a model
directory encodes as fusedserve does (lm-eval and other clients count tokens with it)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from fusedserve.coordinator.model_files.default_model import default_model_dir, resolve_model
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer

CORPUS = ["The year 4096 had 12345 items and 3.14159 of a pie.",
          "def f(x):\n    return x**2  # 0x1F, 1e-9", "東京は日本の首都です。北京 and 上海.",
          "emoji 🙂🚀👩‍💻 done", "  leading spaces\tand\ttabs\n\n\nnewlines ",
          "Ünïcödé café naïve résumé", "a+b=c; x[0]->y != z", "phone 555-0100, ZIP 02139, 1,000,000.5",
          "<|im_start|>user\nhi<|im_end|>"]
# Qwen2's pre-tokenizer as its tokenizer.json writes it: digits one at a time, then bytes.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _transformers_ids(model_dir, texts: list[str]) -> tuple[str, list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return type(tok).__name__, [tok.encode(t, add_special_tokens=False) for t in texts]


@pytest.mark.parametrize("model", ["default", "default:tiny"])
def test_the_embedded_models_tokenize_as_transformers_reads_them(model):
    model_dir = resolve_model(model)
    ours = TextTokenizer.from_dir(model_dir)
    _, theirs = _transformers_ids(model_dir, CORPUS)
    assert [ours.encode(t) for t in CORPUS] == theirs
    assert any(len(ours.encode(t)) > 1 for t in ("4096", "12345")), "the corpus exercises digits"


def test_a_qwen2_pre_tokenizer_gives_the_same_ids_both_ways(tmp_path):
    """A Qwen-style directory (its own tokenizer class, Qwen2's split) encodes the same in
    transformers' Qwen2Tokenizer and in fusedserve, which reads its tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((default_model_dir("tiny") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": tok.get_vocab_size()}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 512}))
    kind, theirs = _transformers_ids(tmp_path, CORPUS)
    assert kind.startswith("Qwen2Tokenizer")
    assert [TextTokenizer.from_dir(tmp_path).encode(t) for t in CORPUS] == theirs
