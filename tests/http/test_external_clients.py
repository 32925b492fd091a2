"""Clients that speak the OpenAI API with no code of ours, against ``fusedserve serve``.

lm-eval's ``local-completions`` scores a multiple-choice task through ``/v1/completions``
with ``echo`` and ``logprobs`` (the prompt's own logprobs: its loglikelihood requests). Its
accuracy must equal the one the offline engine's prompt logprobs give on the same questions;
before ``echo`` was honoured it read generated tokens' logprobs as the prompt's, and before the
model directory named its tokenizer class, lm-eval split digits where the server did not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.coordinator.sampling_params import SamplingParams
from tests.serve_proc import ServeProcess

pytest.importorskip("lm_eval")

# Questions in the default model's domain (Python's documentation): which word follows.
QUESTIONS = [
    ("The function that returns the length of a sequence is", ["len", "size", "count", "width"], 0),
    ("To read a file, first", ["open", "close", "delete", "paint"], 0),
    ("A dictionary maps keys to", ["values", "colors", "files", "threads"], 0),
    ("The keyword that defines a function is", ["def", "fun", "lambda", "class"], 0),
    ("An exception is raised with the", ["raise", "throw", "yield", "pass"], 0),
    ("Lists are", ["mutable", "immutable", "frozen", "constant"], 0),
    ("The module for regular expressions is", ["re", "os", "sys", "math"], 0),
    ("The default encoding of source files is", ["UTF-8", "ASCII", "Latin-1", "EBCDIC"], 0),
    ("A loop over items is written with", ["for", "goto", "until", "loop"], 0),
    ("Strings are", ["immutable", "mutable", "lists", "numbers"], 0),
    ("The value of None is", ["falsy", "truthy", "zero", "empty"], 0),
    ("To import a module, use", ["import", "include", "require", "using"], 0),
    # Digits: a client whose tokenizer split them differently from the server's would score these
    # on misaligned tokens (lm-eval counts the context's tokens with its own tokenizer).
    ("Python 3.11 was released in", ["2022", "1999", "2050", "1066"], 0),
    ("The first index of a list is", ["0", "1", "-1", "100"], 0),
    ("In 4096 bytes there are", ["4 KiB", "12 bits", "2 MiB", "7 pages"], 0),
]


def _offline_scores(model_dir) -> list[list[float]]:
    """Each choice's loglikelihood given its question, from the offline engine's prompt logprobs."""
    with LLMEngine(model_dir, dtype="float32") as eng:
        scores = []
        for question, choices, _ in QUESTIONS:
            context = eng.input.encode(f"{question}\nAnswer:")
            row = []
            for choice in choices:
                ids = eng.input.encode(f"{question}\nAnswer: {choice}")
                out = eng.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
                row.append(sum(out.prompt_logprobs[len(context):]))
            scores.append(row)
    return scores


def test_lm_eval_loglikelihood_accuracy_equals_offline(ray_session, tmp_path):
    model_dir = resolve_model("default")
    data = tmp_path / "questions.jsonl"
    rows = [json.dumps({"question": q, "choices": c, "answer": a}) for q, c, a in QUESTIONS]
    data.write_text("\n".join(rows) + "\n")
    (tmp_path / "pydoc_mc.yaml").write_text(f"""task: pydoc_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    srv = ServeProcess.start(tmp_path / "serve.log", "--workers", "1", "--dtype", "float32",
                             "--http-port", "0")
    try:
        args = (f"model=default,base_url={srv.http}/v1/completions,tokenizer={model_dir},"
                "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=2")
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                              args, "--tasks", "pydoc_mc", "--include_path", str(tmp_path),
                              "--output_path", str(tmp_path / "out"), "--batch_size", "4", "--log_samples"],
                             capture_output=True, text=True, timeout=600, env=env)
    finally:
        srv.stop()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    (samples,) = (tmp_path / "out").rglob("samples_pydoc_mc_*.jsonl")
    want = _offline_scores(model_dir)
    right = 0
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        got = [float(r[0]) for r in sample["filtered_resps"]]
        assert got == pytest.approx(want[sample["doc_id"]], abs=2e-3)  # float32 sums, in another order
        right += max(range(len(got)), key=want[sample["doc_id"]].__getitem__) == int(sample["target"])
    acc = json.loads(results.read_text())["results"]["pydoc_mc"]["acc,none"]
    assert acc == pytest.approx(right / len(QUESTIONS)) and 0 < acc < 1
