"""llguidance against xgrammar on what a serving step asks of a grammar library: the time to
build a constraint's matcher (on the coordinator's loop, before a request's first token) and
the time to fill one row's token mask, per generated token.

    python -m fusedserve.benchmarks.grammar_libs            # needs xgrammar too: pip install xgrammar

Vocabularies: the default model's (4,096 tokens) and a Qwen3-sized one (151,643 byte-level
BPE tokens, trained here once on the Python standard library's sources and cached: Qwen3's
own tokenizer cannot be downloaded on these machines). Workloads: a schema with free strings
along natural JSON, and the decode benchmark's schema (strings of at most 10 characters)
along mixed-script strings like those a random-weight model writes. A constraint is walked
along its document token by token; each figure is the median (min-max) over ``--runs`` walks
of the walk's mean (and worst) mask time, and of the build time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fusedserve.benchmarks.common import fmt, machine, spread
from fusedserve.coordinator.model_files.default_model import cache_root, resolve_model
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "required": ["city", "zip"],
                                     "properties": {
                                         "city": {"type": "string"},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
DOC = {"name": "Ada Lovelace", "age": 36,
       "tags": ["math", "engines", "poetry", "notes on the analytical engine"],
       "address": {"city": "London", "zip": "12345"}}


# The decode benchmark's schema (``structured_decode.SCHEMA``) along a document of bounded
# strings of mixed scripts, what a random-weight model writes into them: the hard case for a
# mask, every string state a different count of characters left.
BOUNDED_WORDS = ["𝆹𝅥 abel", "∸▸▸▸▸▸▸▸▸▒", "僽FDPass", "; 5 broupY", "؆ capital", "__m__, ", "+", " span",
                 "ζ∂ x→0", "λx.x y"]


def workloads() -> dict[str, tuple[dict, str]]:
    from fusedserve.benchmarks.structured_decode import SCHEMA as BOUNDED

    items = [{"id": 17 * i % 1000, "word": w} for i, w in enumerate(BOUNDED_WORDS)]
    return {"natural JSON": (SCHEMA, json.dumps(DOC)),
            "bounded mixed-script strings": (BOUNDED, json.dumps(items, ensure_ascii=False))}


def wide_tokenizer() -> Path:
    """A 151,643-token byte-level BPE (Qwen3's vocabulary size), trained once and cached."""
    path = cache_root() / "bench-tokenizer-151643.json"
    if path.is_file():
        return path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=151643,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def texts():
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            try:
                yield f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    tok.train_from_iterator(texts(), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def _llguidance(tok: TextTokenizer, vocab: int, schema: dict):
    import llguidance
    import llguidance.numpy as llnp

    from fusedserve.coordinator.structured.grammar_compiler import JSON_LAYOUT

    lltok = llguidance.LLTokenizer(tok.to_json(), n_vocab=vocab, eos_token=0)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    mask = llnp.allocate_token_bitmask(1, vocab)

    def build():
        return llguidance.LLMatcher(lltok, grammar)

    def step(m, token):
        llnp.fill_next_token_bitmask(m, mask, 0)
        assert m.consume_token(token), m.get_error()
    return build, step


def _xgrammar(tok: TextTokenizer, vocab: int, schema: dict):
    import xgrammar as xgr

    info = xgr.TokenizerInfo([tok.token_bytes(i) or (tok.token_text(i) or "").encode() for i in range(vocab)],
                             xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[0])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    mask = xgr.allocate_token_bitmask(1, vocab)
    text = json.dumps(schema)

    def build():
        compiled = compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))
        return xgr.GrammarMatcher(compiled)

    def step(m, token):
        m.fill_next_token_bitmask(mask, 0)
        if not m.accept_token(token):
            raise ValueError("refused")
    return build, step


def measure(tok: TextTokenizer, vocab: int, lib: str, runs: int, schema: dict, doc: str) -> dict:
    """A library's build time and mask time per token along ``doc`` (until a token it refuses:
    the libraries differ on some corners, such as what a character is for maxLength)."""
    t0 = time.perf_counter()
    build, step = (_llguidance if lib == "llguidance" else _xgrammar)(tok, vocab, schema)
    setup = time.perf_counter() - t0
    ids = tok.encode(doc)
    builds, means, worst, walked = [], [], [], len(ids)
    for _ in range(runs):
        t0 = time.perf_counter()
        m = build()
        builds.append((time.perf_counter() - t0) * 1e3)
        times = []
        for t in ids[:walked]:
            t0 = time.perf_counter()
            try:
                step(m, t)
            except (AssertionError, ValueError):
                walked = len(times)
                break
            times.append((time.perf_counter() - t0) * 1e6)
        means.append(statistics.mean(times))
        worst.append(max(times))
    return {"tokenizer_ms": setup * 1e3, "build_ms": spread(builds), "mask_us_mean": spread(means),
            "mask_us_max": spread(worst), "tokens": walked}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    vocabs = {"default model (4,096)": resolve_model("default") / "tokenizer.json",
              "Qwen3-sized (151,643)": wide_tokenizer()}
    print(f"{machine()}; a JSON schema walked along a valid document, token by token")
    print(f"{'workload':29s} {'vocabulary':22s} {'library':11s} {'build ms':>20s} "
          f"{'mask us/token mean':>20s} {'mask us worst':>18s} {'tokens':>6s}")
    res: dict = {"machine": machine()}
    for work, (schema, doc) in workloads().items():
        for name, path in vocabs.items():
            tok = TextTokenizer(Tokenizer.from_file(str(path)))
            vocab = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
            for lib in ("llguidance", "xgrammar"):
                try:
                    r = measure(tok, vocab, lib, args.runs, schema, doc)
                except ImportError:
                    print(f"{work:29s} {name:22s} {lib:11s} not installed")
                    continue
                res[f"{work} / {name} / {lib}"] = r
                print(f"{work:29s} {name:22s} {lib:11s} {fmt(r['build_ms'], '.2f'):>20s} "
                      f"{fmt(r['mask_us_mean']):>20s} {fmt(r['mask_us_max'], '.0f'):>18s} {r['tokens']:6d}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
