"""Incremental detokenization: deltas add up to ``decode``, never split a character,
and never let a stop string (or a piece of one) out, even across tokens."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fusedserve.coordinator.engine.detokenizer import Detokenizer
from fusedserve.coordinator.engine.stop_strings import StopMatcher
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.coordinator.model_files.tokenizer import ByteStream, TextTokenizer, WindowStream
from fusedserve.coordinator.sampling_params import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SamplingError,
    SamplingParams,
)

PROPS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
CORPUS = ["naïve café déjà vu — 東京 and 北京 are cities 🙂🚀", "the quick brown fox jumps over it",
          "Grüße aus Köln, ça va? ½ ≠ ¾", "emoji: 👩‍💻 🧪 and more text here"] * 20


@pytest.fixture(scope="module")
def byte_level() -> TextTokenizer:
    return TextTokenizer.from_dir(resolve_model("default"))


@pytest.fixture(scope="module")
def metaspace() -> TextTokenizer:
    """A SentencePiece-style tokenizer (not byte-level): the window path."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    return TextTokenizer(tok)


def _run(stream, ids: list[int]) -> list[str]:
    return [stream.push(i) for i in ids] + [stream.flush()]


def test_stream_kind_follows_the_decoder(byte_level, metaspace):
    assert isinstance(byte_level.stream(), ByteStream)
    assert isinstance(metaspace.stream(), WindowStream)


@PROPS
@given(data=st.data())
def test_deltas_add_up_to_decode_and_never_split_a_character(byte_level, metaspace, data):
    for tok in (byte_level, metaspace):
        vocab = tok._tok.get_vocab_size(with_added_tokens=True)
        ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
        parts = _run(tok.stream(), ids)
        full = tok.decode(ids)
        assert "".join(parts) == full
        if "\ufffd" not in full:
            assert not any("\ufffd" in p for p in parts), (ids, parts)


def test_multibyte_text_streams_whole_characters(byte_level):
    text = "東京 🙂 café"
    ids = byte_level.encode(text)
    assert len(ids) > len(text.split()), "the text must span byte-level pieces"
    parts = _run(byte_level.stream(), ids)
    assert "".join(parts) == text and not any("\ufffd" in p for p in parts)


@PROPS
@given(data=st.data())
def test_stop_strings_never_reach_the_stream(byte_level, data):
    words = ["alpha", " beta", " gamma", " delta", "END", " stop", "\n"]
    text = "".join(data.draw(st.lists(st.sampled_from(words), min_size=1, max_size=12)))
    stops = data.draw(st.lists(st.sampled_from(["END", "a g", "ta\n", " st", "zzz"]), min_size=1, max_size=2))
    ids = byte_level.encode(text)
    d = Detokenizer(byte_level, stops)
    streamed = ""
    for i, tok in enumerate(ids):
        d.push(tok)
        final = d.stopped or i == len(ids) - 1
        if final:
            d.finish()
        streamed += d.delta(final)
        if d.stopped:
            break
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    want = text[: min(cuts)] if cuts else text
    assert d.text == want and streamed == want
    assert d.stopped == bool(cuts)


def test_a_stop_string_split_over_two_tokens_is_held_back(byte_level):
    d = Detokenizer(byte_level, ["llo w"])
    out = []
    for piece in ["he", "l", "lo", " w", "orld"]:
        for tok in byte_level.encode(piece):
            d.push(tok)
        out.append(d.delta(final=d.stopped))
        if d.stopped:
            break
    assert d.stopped and d.text == "he"
    assert "".join(out) == "he" and "l" not in "".join(out)


def _first_stop(text: str, stops: list[str]) -> int | None:
    """Brute force: where the first stop string to end in ``text`` starts (the longest of those
    ending at the same character)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if s and text[:end].endswith(s)]
        if ending:
            return end - max(len(s) for s in ending)
    return None


def _held(text: str, stops: list[str]) -> int:
    """Brute force: the longest tail of ``text`` that begins some stop string."""
    return max((n for s in stops for n in range(1, min(len(s), len(text)) + 1) if text.endswith(s[:n])),
               default=0)


@PROPS
@given(data=st.data())
def test_the_stop_automaton_matches_brute_force(data):
    alphabet = st.sampled_from("abcé東 ")
    stops = data.draw(st.lists(st.text(alphabet, min_size=1, max_size=5), min_size=1, max_size=6))
    pieces = data.draw(st.lists(st.text(alphabet, max_size=4), min_size=1, max_size=12))
    m, text = StopMatcher(stops), ""
    for piece in pieces:
        found = m.feed(piece)
        want = _first_stop(text + piece, stops)  # none ended in ``text``: checked at earlier pieces
        if found is not None or want is not None:
            assert found is not None and len(text) + found[0] == want, (stops, text, piece)
            assert (text + piece)[len(text) + found[0] : len(text) + found[1]] in stops
            return
        text += piece
        assert m.held == _held(text, stops), (stops, text)


def test_stop_strings_beyond_the_caps_are_refused():
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)
    with pytest.raises(SamplingError, match=f"at most {MAX_STOP_STRINGS}"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(SamplingError, match=f"{MAX_STOP_CHARS + 1} characters; at most {MAX_STOP_CHARS}"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(SamplingError, match="list of strings"):
        SamplingParams(stop=[1])


def test_many_long_stop_strings_still_stop_where_they_should(byte_level):
    """The most a request may carry, one of them in the output: the text is cut before it."""
    stops = [f"{i:03d}" + "q" * (MAX_STOP_CHARS - 3) for i in range(MAX_STOP_STRINGS - 1)] + ["fox"]
    d = Detokenizer(byte_level, stops)
    for tok in byte_level.encode("the quick brown fox jumps"):
        d.push(tok)
        if d.stopped:
            break
    assert d.stopped and d.text == "the quick brown "
