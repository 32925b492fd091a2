"""Text <-> token ids for a model directory's ``tokenizer.json``."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    """A thin wrapper over a ``tokenizers`` tokenizer; None where a model has none."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextTokenizer | None:
        path = Path(model_dir) / "tokenizer.json"
        return cls(Tokenizer.from_file(str(path))) if path.is_file() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
