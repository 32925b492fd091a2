"""A Qwen3-0.6B-shaped checkpoint (the real config: 40,960 positions, Qwen3's generation_config.json;
random weights) served as a vLLM user serves it: ``fusedserve serve --model DIR``, with only a KV
memory small enough for this machine. The context is the model's own or what the KV cache holds,
stated; a 6,000-token prompt is served; the official client works on port 8000; /tokenize and
/detokenize round-trip; each penalty and logit_bias changes the output as the offline engine, which
applies the formulas tests/engine/test_sampling_fields.py checks, says it should."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import openai
import pytest

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import default_model_dir
from fusedserve.coordinator.sampling_params import SamplingParams
from tests.serve_proc import ServeProcess

KV = "1GiB"
LINE = re.compile(r"max_model_len (\d+)")
KV_LINE = re.compile(r"KV cache: (\d+) blocks x 16 tokens = (\d+) tokens per worker .*maximum "
                     r"concurrency for (\d+) tokens per request")


@pytest.fixture(scope="module")
def served(ray_session, tmp_path_factory):
    model = default_model_dir("qwen3-0.6b")
    srv = ServeProcess.start(tmp_path_factory.mktemp("real") / "serve.log", "--model", str(model),
                             "--kv-cache-memory", KV, "--http-port", "8000", timeout_s=600)
    yield srv, model
    srv.stop()


def test_the_context_is_what_the_kv_cache_holds_and_is_stated(served):
    srv, _ = served
    out = "".join(srv.lines)
    stated = int(LINE.search(out).group(1))
    blocks, tokens, per_request = map(int, KV_LINE.search(out).groups())
    # 1 GiB at 28 layers x 2 x 8 KV heads x 128 x 2 bytes = 114,688 bytes a token: 9,362 tokens, fewer
    # than the model's 40,960: the context is cut to what fits, and said so.
    assert tokens == blocks * 16 == (1 << 30) // (114_688 * 16) * 16 and stated == per_request == tokens
    models = httpx.get("http://127.0.0.1:8000/v1/models", timeout=30).json()
    assert models["data"][0]["max_model_len"] == stated


def test_a_6000_token_prompt_through_the_official_client_on_port_8000(served):
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none", max_retries=0, timeout=900)
    prompt = [(i * 37) % 1000 + 10 for i in range(6000)]
    r = client.completions.create(model=str(served[1]), prompt=prompt, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 6000 and r.usage.completion_tokens == 4


def test_tokenize_then_detokenize_round_trips(served):
    text = "The capital of France is Paris. Numbers: 0 1 2 3."
    tokens = httpx.post("http://127.0.0.1:8000/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
    back = httpx.post("http://127.0.0.1:8000/detokenize", json={"tokens": tokens}, timeout=30).json()
    assert back == {"prompt": text}


def test_penalties_and_logit_bias_change_the_output_as_the_formulas_say(served):
    """Served over HTTP as the offline engine gives them (its formulas are checked against
    transformers' and OpenAI's in tests/engine/test_sampling_fields.py), and each unlike the plain output."""
    from fusedserve.coordinator.model_files.tokenizer import TextTokenizer

    srv, model = served
    tok = TextTokenizer.from_dir(model)
    prompt = [(i * 13) % 900 + 20 for i in range(24)]
    plain = dict(max_tokens=16, ignore_eos=True, temperature=0)
    with LLMEngine(model, dtype="bfloat16", num_blocks=64, max_batch=4, max_model_len=512) as eng:
        base = eng.generate([prompt], SamplingParams(**plain))[0].token_ids
        cases = [dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=1.8),
                 dict(logit_bias={base[0]: -100.0})]
        want = [eng.generate([prompt], SamplingParams(**plain, **c))[0].token_ids for c in cases]
    for case, ids in zip(cases, want):
        fields = {k: ({str(t): v for t, v in x.items()} if k == "logit_bias" else x) for k, x in case.items()}
        body = {"model": str(model), "prompt": prompt, "logprobs": 0, **plain, **fields}
        r = httpx.post("http://127.0.0.1:8000/v1/completions", json=body, timeout=300).json()
        assert r["choices"][0]["logprobs"]["tokens"] == [tok.token_text(t) for t in ids], case
    assert want[3][0] != base[0], "a bias of -100 rules its token out"
    assert want[2] != base, "a repetition penalty of 1.8 changes this model's greedy output"
    # Random weights make this model's greedy choice certain (its logprob rounds to 0: a margin of
    # tens of logits), beyond what OpenAI's largest presence or frequency penalty (2 per occurrence)
    # can move in 16 tokens: those two are shown changing outputs on the trained default model, over
    # HTTP (tests/http/test_request_fields.py) and against transformers
    # (tests/engine/test_sampling_fields.py).


def _hub_cache(root, repo: str, source, sha: str = "0123456789abcdef0123456789abcdef01234567"):
    """The Hugging Face cache's layout for one snapshot of ``repo`` (``refs/main`` names it)."""
    base = root / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / sha
    snap.mkdir(parents=True)
    for f in source.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(sha)
    return sha


def test_a_hugging_face_id_is_served_from_the_hub_cache_without_the_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read when the cache is consulted: no request is made
    sha = _hub_cache(tmp_path, "Qwen/Qwen3-Tiny", default_model_dir("tiny"))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLMEngine("default:tiny", dtype="float32", max_batch=2, num_blocks=16) as eng:
        want = eng.generate(["The capital of France is"], params)[0].token_ids
    for revision in (None, sha):
        with LLMEngine("Qwen/Qwen3-Tiny", dtype="float32", max_batch=2, num_blocks=16,
                       revision=revision, download_dir=str(tmp_path)) as eng:
            assert eng.config.model.model == str(tmp_path / "models--Qwen--Qwen3-Tiny" / "snapshots" / sha)
            assert eng.generate(["The capital of France is"], params)[0].token_ids == want


def test_a_model_that_is_nowhere_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for model, says in (("nobody/no-such-model", "is not in the Hugging Face cache at"),
                        ("./no/such/dir", "no such directory, and not a Hugging Face id")):
        out = subprocess.run([sys.executable, "-m", "fusedserve.coordinator.cli", "serve", "--model", model,
                              "--download-dir", str(tmp_path), "--no-http", "--zmq-port", "0"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and says in out.stderr, out.stderr
        assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
