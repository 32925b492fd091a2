"""Text <-> token ids for a model directory's ``tokenizer.json``, and streaming decode.

``TextTokenizer.stream()`` gives a per-sequence decoder that turns one token at a
time into the text it completes. For byte-level BPE (Qwen3's kind) every token maps
to raw bytes and an incremental UTF-8 decoder holds back an unfinished character, so
a delta never splits one and costs O(new bytes). Other decoders use a short window of
recent ids, re-decoded each step (what vLLM does for any tokenizer).
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from tokenizers import Tokenizer

# A window decode waits at most this many tokens for an unfinished character to complete.
MAX_PENDING_TOKENS = 8


def _byte_level_chars() -> dict[str, int]:
    """The byte-level alphabet: the printable character standing for each byte (GPT-2's map)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class ByteStream:
    """Byte-level tokens -> text, exactly as ``Tokenizer.decode`` joins them (lossy UTF-8)."""

    def __init__(self, token_bytes: list[bytes]):
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        raw = self._bytes[token] if 0 <= token < len(self._bytes) else b""
        return self._utf8.decode(raw)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class WindowStream:
    """Any tokenizer: decode a window of recent ids and emit what it adds, once its
    last character is complete (no trailing U+FFFD) or it waited long enough."""

    def __init__(self, tok: TextTokenizer):
        self._tok = tok
        self._ids: list[int] = []
        self._read = 0  # ids[:read] are fully emitted

    def push(self, token: int) -> str:
        self._ids.append(token)
        done = self._tok.decode(self._ids[: self._read])
        text = self._tok.decode(self._ids)
        if len(text) <= len(done):
            return ""
        if text.endswith("\ufffd") and len(self._ids) - self._read < MAX_PENDING_TOKENS:
            return ""
        # The window restarts at the last emitted ids, which give the next decode its context.
        del self._ids[: self._read]
        self._read = len(self._ids)
        return text[len(done):]

    def flush(self) -> str:
        done = self._tok.decode(self._ids[: self._read])
        text = self._tok.decode(self._ids)
        self._read = len(self._ids)
        return text[len(done):]


class TextTokenizer:
    """A thin wrapper over a ``tokenizers`` tokenizer; None where a model has none."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._token_bytes = self._byte_table(tok)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextTokenizer | None:
        path = Path(model_dir) / "tokenizer.json"
        return cls(Tokenizer.from_file(str(path))) if path.is_file() else None

    @staticmethod
    def _byte_table(tok: Tokenizer) -> list[bytes] | None:
        """Each id's bytes as the ByteLevel decoder produces them (special tokens: none),
        or None where the decoder is not plain ByteLevel."""
        decoder = json.loads(tok.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            return None
        chars = _byte_level_chars()
        special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        table = []
        for i in range(tok.get_vocab_size(with_added_tokens=True)):
            piece = tok.id_to_token(i)
            if piece is None or i in special:
                table.append(b"")
            elif all(c in chars for c in piece):
                table.append(bytes(chars[c] for c in piece))
            else:  # as the decoder does: a piece outside the alphabet stands for its own UTF-8
                table.append(piece.encode())
        return table

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer has (added tokens included; a model's vocabulary may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what a grammar library builds its own from)."""
        return self._tok.to_str()

    def encode(self, text: str, special: bool = False) -> list[int]:
        """``special``: with the tokenizer's post-processor (an embedding model's appended EOS, which
        its last-token pooling reads); chat templates write their special tokens themselves."""
        return self._tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (what OpenAI's logprobs call ``bytes``)."""
        if self._token_bytes is not None and 0 <= token < len(self._token_bytes):
            return self._token_bytes[token]
        return self.decode([token]).encode()

    def token_piece(self, token: int) -> str:
        """The vocabulary's own string for a token (``Ġ`` for a leading space: vLLM's token_strs)."""
        return self._tok.id_to_token(token) or f"<id:{token}>"

    def token_text(self, token: int) -> str:
        """One token as text, for logprobs: its characters, or ``bytes:\\xNN...`` (OpenAI's
        convention) for a piece of a character; a special token by its name, and an id the
        tokenizer does not have (a model's vocabulary may be larger) as ``<id:N>``."""
        raw = self.token_bytes(token)
        if not raw:
            return self._tok.id_to_token(token) or f"<id:{token}>"
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def stream(self) -> ByteStream | WindowStream:
        """A new incremental decoder for one sequence's output."""
        if self._token_bytes is not None:
            return ByteStream(self._token_bytes)
        return WindowStream(self)
