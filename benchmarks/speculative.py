"""Speculative decoding: tokens per second with speculation off, with n-gram proposals and with a
small draft model, at batch 1 and 16, on three workloads, with the acceptance rates.

Acceptance depends on what the model writes, and no real checkpoint can be downloaded here: random
weights copy nothing. So the target runs Qwen3-0.6B's shape (random weights, the embedded trained
model's tokenizer) in full every launch, and its choice of token is then set to the workload's
reference text (``forced``: each row's logit of the reference's next token raised past every other;
the proposer, the verification, the rollback and the scheduling never see the reference). The
figures are what fusedserve does for a model that writes that text. The draft is the embedded
trained model (4 layers, hidden 256, trained on the documentation the prose comes from), its
vocabulary padded to the target's: its proposals are its own guesses of the text (its first 2
layers alone, the issue's 2-layer draft, agree with almost nothing: a truncated model is not a
trained 2-layer one).

  (a) edit: a ~400-token Python file in the prompt; the output rewrites it with a rename;
  (b) tool: tool calls and responses in the prompt; the output is the next calls;
  (c) prose: held-out documentation text (from the embedded model's corpus) continued.

Greedy, ``ignore_eos``; the same output length in every mode. Decode tokens per second exclude the
prefill: batch x (N - 1) / (time of N tokens - time of 1 token). Each figure is the median (min-max)
of ``--runs`` runs, the modes alternating within each run.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fusedserve.benchmarks.common import RUNS, fmt, machine, median, spread
from fusedserve.coordinator.engine.llm_engine import LLMEngine, load_model
from fusedserve.coordinator.model_files.default_model import TRAINED_DIR, cache_root, default_model_dir
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.forward_batch import ForwardBatch
from fusedserve.worker.model.qwen3 import Qwen3Model

TARGET_FORMAT = 1
log = logging.getLogger(__name__)

EDIT_FILE = '''import os
import sys
import json
import logging

log = logging.getLogger(__name__)


class Config:
    """Settings read from a JSON file, with defaults."""

    def __init__(self, path, defaults=None):
        self.path = path
        self.values = dict(defaults or {})

    def load(self):
        if not os.path.exists(self.path):
            log.warning("no config file at %s", self.path)
            return self.values
        with open(self.path) as f:
            self.values.update(json.load(f))
        return self.values

    def get(self, key, default=None):
        return self.values.get(key, default)


def read_lines(path):
    """Return the lines of a file, without their newlines."""
    with open(path) as f:
        return [line.rstrip("\\n") for line in f]


def count_words(lines):
    counts = {}
    for line in lines:
        for word in line.split():
            counts[word] = counts.get(word, 0) + 1
    return counts


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    config = Config(argv[0] if argv else "config.json", {"verbose": False})
    config.load()
    for name in argv[1:]:
        counts = count_words(read_lines(name))
        for word, n in sorted(counts.items()):
            print(word, n)
    if config.get("verbose"):
        log.info("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

TOOLS = ('[{"name": "get_weather", "description": "Current weather for a city", "parameters": {"type": '
         '"object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": '
         '["celsius", "fahrenheit"]}}, "required": ["city"]}}, {"name": "search_files", "description": '
         '"Find files by pattern", "parameters": {"type": "object", "properties": {"pattern": {"type": '
         '"string"}, "path": {"type": "string"}}, "required": ["pattern"]}}]')
TOOL_PROMPT = "Tools: " + TOOLS + '''
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
</tool_call>
<tool_response>
{"city": "Paris", "temperature": 18, "unit": "celsius", "conditions": "cloudy"}
</tool_response>
<tool_call>
{"name": "search_files", "arguments": {"pattern": "*.py", "path": "src"}}
</tool_call>
<tool_response>
{"files": ["src/main.py", "src/config.py", "src/util.py"]}
</tool_response>
<tool_call>
{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}
</tool_call>
<tool_response>
{"city": "Berlin", "temperature": 15, "unit": "celsius", "conditions": "rain"}
</tool_response>
<tool_call>
{"name": "get_weather", "arguments": {"city": "'''


TOOL_MORE = '''Madrid", "unit": "celsius"}}
</tool_call>
<tool_response>
{"city": "Madrid", "temperature": 24, "unit": "celsius", "conditions": "sunny"}
</tool_response>
<tool_call>
{"name": "search_files", "arguments": {"pattern": "*.json", "path": "src"}}
</tool_call>
<tool_response>
{"files": ["src/config.json"]}
</tool_response>
<tool_call>
{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}
</tool_call>'''


def workloads() -> dict[str, tuple[str, str]]:
    """Each workload's prompt and the reference text its output is."""
    heldout = (TRAINED_DIR / "heldout.txt").read_text()
    edited = EDIT_FILE.replace("count_words", "word_counts")
    return {
        "edit": ("Rename count_words to word_counts in this file:\n\n" + EDIT_FILE
                 + "\n\nThe file after the change:\n\n", edited),
        "tool": (TOOL_PROMPT, TOOL_MORE),
        "prose": (heldout[:1500], heldout[1500:3500]),
    }


# ------------------------------------------------------------------------------------ the target

def _cached_dir(name: str, write: Callable[[Path], None]) -> Path:
    """``cache_root()/name``, written once by ``write`` into a temp dir (with the trained model's
    tokenizer) and renamed into place."""
    final = cache_root() / name
    if (final / "config.json").is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_root()))
    try:
        write(tmp)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TRAINED_DIR / f, tmp / f)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def target_dir() -> Path:
    """Qwen3-0.6B's shape (the random-weight preset) with the embedded trained model's tokenizer."""
    def write(out: Path) -> None:
        preset = default_model_dir("qwen3-0.6b")
        (out / "model.safetensors").symlink_to(preset / "model.safetensors")
        config = json.loads((preset / "config.json").read_text())
        config["eos_token_id"] = json.loads((TRAINED_DIR / "config.json").read_text())["eos_token_id"]
        (out / "config.json").write_text(json.dumps(config, indent=2))

    return _cached_dir(f"spec-target-v{TARGET_FORMAT}", write)


def draft_dir(layers: int = 4) -> Path:
    """The draft: the embedded trained model's first ``layers`` layers (all 4 by default; hidden
    256), its vocabulary padded to the target's 151,936 (the padded tokens' logits are 0)."""
    def write(out: Path) -> None:
        src = load_file(str(TRAINED_DIR / "model.safetensors"))
        config = json.loads((TRAINED_DIR / "config.json").read_text())
        vocab = json.loads((default_model_dir("qwen3-0.6b") / "config.json").read_text())["vocab_size"]
        keep = {k: v for k, v in src.items()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
        embed = keep["model.embed_tokens.weight"]
        pad = embed.new_zeros(vocab - embed.shape[0], embed.shape[1])
        keep["model.embed_tokens.weight"] = torch.cat([embed, pad])
        config.update(num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=4096)
        config.pop("layer_types", None)
        save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config, indent=2))

    return _cached_dir(f"spec-draft{layers}-v{TARGET_FORMAT}", write)


def forced(model: Qwen3Model, all_ids: list[int]) -> None:
    """After each forward, raise every row's logit of the reference's next token (``all_ids``:
    prompt then reference) past the rest: the full model ran, and the text is the reference."""
    table = torch.tensor(all_ids[1:] + [all_ids[-1]], dtype=torch.int64)
    real = model.__dict__.setdefault("unforced_forward", model.forward)

    def forward(batch: ForwardBatch, kv, ws, logits: torch.Tensor):
        hidden = real(batch, kv, ws, logits)
        b = logits.shape[0]
        last = batch.query_start_loc[1 : b + 1].long() - 1
        nxt = table[batch.positions.index_select(0, last).long().clamp(max=len(table) - 1)]
        logits.scatter_(1, nxt.unsqueeze(1), 1e4)
        return hidden

    model.forward = forward


# ------------------------------------------------------------------------------------ measuring

NGRAM = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)


def modes() -> dict[str, dict]:
    return {"off": {}, "ngram": NGRAM,
            "draft": dict(speculative_method="draft", speculative_model=str(draft_dir()),
                          num_speculative_tokens=4)}


def _timed(eng: LLMEngine, prompts: list[list[int]], n: int) -> float:
    t0 = time.perf_counter()
    eng.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    return time.perf_counter() - t0


def once(model: Qwen3Model, tok: TextTokenizer, prompt: list[int], batch: int, tokens: int) -> dict:
    """One run of every mode: decode tokens/s and the acceptance."""
    out = {}
    for mode, settings in modes().items():
        rc = dict(max_batch=max(16, batch * 5), block_size=16, enable_prefix_caching=False,
                  kv_cache_memory=1 << 30, **settings)
        with LLMEngine(model, tokenizer=tok, **rc) as eng:
            prompts = [prompt] * batch
            _timed(eng, prompts, 2)  # warm-up
            first = _timed(eng, prompts, 1)
            spec = eng.core.scheduler.speculation
            full = _timed(eng, prompts, tokens)
            out[f"{mode}_tok_s"] = batch * (tokens - 1) / (full - first)
            if spec:  # the three runs' counts: the forced text is the same in each
                st = spec.stats
                out[f"{mode}_acceptance"] = st.accepted / st.proposed if st.proposed else 0.0
                out[f"{mode}_accepted_per_draft"] = st.accepted / st.drafts if st.drafts else 0.0
    for mode in modes():
        if mode != "off":
            out[f"{mode}_speedup"] = out[f"{mode}_tok_s"] / out["off_tok_s"]
    log.info("%s", {k: round(v, 2) for k, v in out.items()})
    return out


def run(batches: list[int], tokens: int | None, runs: int = RUNS, tokens_b16: int | None = None) -> dict:
    model, tok = load_model(target_dir(), max_model_len=4096)
    results = {}
    for name, (prompt, reference) in workloads().items():
        ids, ref = tok.encode(prompt), tok.encode(reference)
        n = min(tokens or len(ref), len(ref))
        forced(model, ids + ref)
        for b in batches:
            n = min(n, tokens_b16) if b > 1 and tokens_b16 else n
            log.info("%s at batch %d: %d prompt tokens, %d out", name, b, len(ids), n)
            each = [once(model, tok, ids, b, n) for _ in range(runs)]
            results[f"{name}_b{b}"] = {"prompt_tokens": len(ids), "tokens": n,
                                       **{k: spread([e[k] for e in each]) for k in each[0]}}
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=None,
                    help="output tokens (default: the whole reference)")
    ap.add_argument("--batched-tokens", type=int, default=128,
                    help="output tokens per request at batch > 1 (default 128)")
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = run([int(b) for b in args.batches.split(",")], args.tokens, args.runs, args.batched_tokens)
    report = {"machine": machine(), "runs": args.runs, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print("\n".join(table(report)))
    return report


def table(report: dict) -> list[str]:
    """The results as a Markdown table: tokens/s per mode, speedup and acceptance."""
    lines = [f"Machine: {report['machine']}. Qwen3-0.6B shape, bf16, forced to each workload's text; k = 4; "
             f"greedy; decode tokens/s, median (min-max) of {report['runs']}; acceptance = accepted / "
             "proposed tokens.", "",
             "| workload | batch | tokens | off tok/s | n-gram tok/s | n-gram x | n-gram acceptance | "
             "draft tok/s | draft x | draft acceptance |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in report["results"].items():
        name, batch = key.rsplit("_b", 1)
        lines.append(f"| {name} | {batch} | {r['tokens']} | {fmt(r['off_tok_s'])} | "
                     f"{fmt(r['ngram_tok_s'])} | {fmt(r['ngram_speedup'], '.2f')} | "
                     f"{median(r['ngram_acceptance']):.2f} | "
                     f"{fmt(r['draft_tok_s'])} | {fmt(r['draft_speedup'], '.2f')} | "
                     f"{median(r['draft_acceptance']):.2f} |")
    return lines


TARGETS = (("edit", 1, 2.0, "n-gram at batch 1 on a code edit >= 2.0x"),
           ("tool", 1, 1.5, "n-gram at batch 1 on tool-call JSON >= 1.5x"),
           ("prose", 1, 0.95, "n-gram at batch 1 on free prose >= 0.95x"))


def targets(report: dict) -> list[tuple[str, bool, str]]:
    """The issue's targets against the medians: (what, met, figure)."""
    out = []
    res = report["results"]
    for name, batch, floor, what in TARGETS:
        if f"{name}_b{batch}" in res:
            x = median(res[f"{name}_b{batch}"]["ngram_speedup"])
            out.append((what, x >= floor, f"{x:.2f}x"))
    batched = [median(r["ngram_speedup"]) for k, r in res.items() if not k.endswith("_b1")]
    if batched:
        out.append(("n-gram at batch 16 no slower than off", min(batched) >= 0.98,
                    f"lowest {min(batched):.2f}x (0.98: the runs' noise)"))
    return out


if __name__ == "__main__":
    main()
