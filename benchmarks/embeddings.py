"""Embeddings throughput: fusedserve's pooling runner against sentence-transformers and OpenVINO.

``python -m fusedserve.benchmarks.embeddings [--openvino-python PY] [--json FILE]``

The model is Qwen3-0.6B's shape with random weights (``default:qwen3-0.6b``, the checkpoint
``cpu_peers`` writes), served as an embedding model: last-token pooling, L2-normalised, as
Qwen3-Embedding-0.6B is. Each engine embeds batches of 32 texts of 128 and 512 tokens (random
words of the model's tokenizer; fresh texts each run, so no engine reuses a cached prefix), in a
subprocess of its own, round robin:

- ``fusedserve-bf16``: ``LLMEngine(..., runner="pooling").embed`` (prompt chunks of the default
  2048-token launch budget);
- ``sentence-transformers-bf16``: ``SentenceTransformer`` over the same directory (Transformer,
  last-token Pooling, Normalize; bf16 weights), ``encode`` with the batch as one batch;
- ``openvino``: optimum-intel's feature-extraction export (``optimum-cli export openvino --task
  feature-extraction``, fp16 weights; on a CPU with bf16 OpenVINO computes in bf16), its
  ``OVModelForFeatureExtraction`` and the same pooling, where ``--openvino-python`` is given.

Figure: input tokens/s of one whole batch (the median, min and max of ``RUNS`` runs), and each
engine's ratio of medians against fusedserve's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fusedserve.benchmarks.common import RUNS, fmt, machine, median, spread
from fusedserve.coordinator.model_files.default_model import cache_root, default_model_dir

PRESET = "qwen3-0.6b"
ENGINES = ("fusedserve-bf16", "sentence-transformers-bf16", "openvino")
BATCH = 32
LENGTHS = (128, 512)


def texts(n: int, length: int, seed: int, model_dir: Path) -> list[str]:
    """``n`` texts of about ``length`` tokens: words the tokenizer keeps as one token each."""
    from fusedserve.coordinator.model_files.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(model_dir)
    words = [w for w in (tok.decode([i]) for i in range(256, min(tok.vocab_size, 4000)))
             if w.startswith(" ") and w[1:].isalpha() and len(tok.encode(w)) == 1]
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(words, length)).strip() for _ in range(n)]


def _fusedserve(model_dir: Path, batches: list[list[str]]) -> list[tuple[float, int]]:
    from fusedserve.coordinator.engine.llm_engine import LLMEngine

    with LLMEngine(model_dir, dtype="bfloat16", runner="pooling", pooling_task="embed", max_batch=64) as eng:
        eng.embed(batches[0][:2])  # warm-up
        out = []
        for batch in batches[1:]:
            t0 = time.perf_counter()
            res = eng.embed(batch)
            dt = time.perf_counter() - t0
            assert all(r.error == "" for r in res)
            out.append((dt, sum(len(r.prompt_ids) for r in res)))
    return out


def _pool_last(hidden, mask):
    """Last-token pooling of a right-padded batch, normalised (sentence-transformers' lasttoken)."""
    import torch

    last = mask.sum(1) - 1
    rows = hidden[torch.arange(hidden.shape[0]), last]
    return torch.nn.functional.normalize(rows.float(), dim=1)


def _sentence_transformers(model_dir: Path, batches: list[list[str]]) -> list[tuple[float, int]]:
    import torch
    from sentence_transformers import SentenceTransformer, models

    word = models.Transformer(str(model_dir), model_args={"dtype": torch.bfloat16})
    dim = getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension
    pool = models.Pooling(dim(), pooling_mode="lasttoken")
    st = SentenceTransformer(modules=[word, pool, models.Normalize()], device="cpu")
    st.encode(batches[0][:2])
    out = []
    for batch in batches[1:]:
        tokens = sum(len(ids) for ids in st.tokenizer(batch)["input_ids"])
        t0 = time.perf_counter()
        st.encode(batch, batch_size=len(batch), convert_to_numpy=True)
        out.append((time.perf_counter() - t0, tokens))
    return out


def _openvino(ov_dir: Path, batches: list[list[str]]) -> list[tuple[float, int]]:
    import torch
    from optimum.intel import OVModelForFeatureExtraction
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ov_dir)
    model = OVModelForFeatureExtraction.from_pretrained(ov_dir)

    def embed(batch: list[str]) -> int:
        enc = tok(batch, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state
        _pool_last(hidden, enc["attention_mask"])
        return int(enc["attention_mask"].sum())

    embed(batches[0][:2])
    out = []
    for batch in batches[1:]:
        t0 = time.perf_counter()
        tokens = embed(batch)
        out.append((time.perf_counter() - t0, tokens))
    return out


def one(engine: str, length: int, runs: int, seed: int) -> list[float]:
    """Input tokens/s of ``runs`` batches (fresh texts each) after a warm-up, in this process."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    model_dir = default_model_dir(PRESET)
    batches = [texts(BATCH, length, seed + i, model_dir) for i in range(runs + 1)]
    if engine == "fusedserve-bf16":
        timed = _fusedserve(model_dir, batches)
    elif engine == "sentence-transformers-bf16":
        timed = _sentence_transformers(model_dir, batches)
    elif engine == "openvino":
        timed = _openvino(cache_root() / f"openvino-embed-{model_dir.name}", batches)
    else:
        raise ValueError(f"unknown engine {engine!r}")
    return [tokens / dt for dt, tokens in timed]


def export_openvino(python: str, model_dir: Path) -> Path:
    """optimum-intel's feature-extraction export, fp16 weights, once (cached next to the model)."""
    out = cache_root() / f"openvino-embed-{model_dir.name}"
    if not (out / "openvino_model.xml").is_file():
        cli = Path(python).parent / "optimum-cli"
        subprocess.run([str(cli), "export", "openvino", "-m", str(model_dir), "--task", "feature-extraction",
                        "--weight-format", "fp16", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


def measure(engines: list[str], threads: int, openvino_python: str | None, runs: int = RUNS) -> dict:
    model_dir = default_model_dir(PRESET)
    if openvino_python and "openvino" in engines:
        export_openvino(openvino_python, model_dir)
    available = [e for e in engines if e != "openvino" or openvino_python]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    raw: dict[str, dict[int, list[float]]] = {e: {n: [] for n in LENGTHS} for e in available}
    for run in range(runs):  # round robin: every engine and length once per run
        for engine in available:
            python = openvino_python if engine == "openvino" else sys.executable
            for n in LENGTHS:
                cmd = [python, "-m", "fusedserve.benchmarks.embeddings", "--one", engine, "--length", str(n),
                       "--seed", str(1000 * run + n)]
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
                if r.returncode != 0:
                    raise RuntimeError(f"{engine} length {n} failed:\n{r.stderr[-3000:]}")
                raw[engine][n] += json.loads(r.stdout.strip().splitlines()[-1])["tokens_per_s"]
        print(f"  run {run + 1} of {runs}: " + ", ".join(
            f"{e} " + "/".join(f"{raw[e][n][-1]:.0f}" for n in LENGTHS) for e in available), flush=True)
    return {"machine": machine(), "model": f"default:{PRESET}", "batch": BATCH, "threads": threads,
            "results": {e: {n: spread(v) for n, v in row.items()} for e, row in raw.items()}}


def table(res: dict) -> list[str]:
    """Input tokens/s per engine and length, and fusedserve's ratio of medians against each peer."""
    results = res["results"]
    ours = results["fusedserve-bf16"]
    lines = ["| engine | " + " | ".join(f"{n} tokens" for n in LENGTHS) + " | fusedserve / it |",
             "|---|" + "---|" * len(LENGTHS) + "---|"]
    for engine, row in results.items():
        ratio = " / ".join(f"{median(ours[n]) / median(row[n]):.2f}x" for n in LENGTHS)
        lines.append(f"| {engine} | " + " | ".join(fmt(row[n], ".0f") for n in LENGTHS)
                     + f" | {'-' if engine == 'fusedserve-bf16' else ratio} |")
    return lines


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, default=128, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--openvino-python", help="an interpreter with the openvino extra (a venv of its own)")
    ap.add_argument("--json", help="store the results here")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps({"tokens_per_s": one(args.one, args.length, 1, args.seed)}))
        return None
    res = measure(args.engines.split(","), args.threads, args.openvino_python, args.runs)
    print("\n".join(table(res)))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
