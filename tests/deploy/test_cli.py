"""The command line as a user runs it: ``fusedserve demo`` on a fresh Ray head, and ``serve``
with the scheduling flags, whose effect is read back from ``stats``."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fusedserve.coordinator.cli import DEMO_PROMPTS
from fusedserve.coordinator.client import Client
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import cache_root
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.native import build as native
from tests.serve_proc import ServeProcess
from tests.support import settled

LONG = " ".join(f"item {i} is the number {i * 7 % 13}." for i in range(30))


def test_demo_serves_every_prompt_and_prints_stats(tmp_path):
    # As on a machine where an earlier local ray.init left ~/.ray/auth_token and nothing chose an
    # auth mode: `ray start` would turn token auth on and a driver would not; the CLI picks one.
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    built = native.kernels()  # the caches stay where they are: no rebuild of the kernels
    keep = {"FUSEDSERVE_CACHE": str(cache_root())}
    if built is not None:
        keep["TORCH_EXTENSIONS_DIR"] = str(Path(built.__file__).parent.parent)
    env = {**keep, **os.environ, "HOME": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    for var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(var, None)

    def demo(*flags: str) -> str:
        r = subprocess.run([sys.executable, "-m", "fusedserve.coordinator.cli", "demo", "--max-tokens", "6",
                            *flags], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        out = r.stdout
        assert out.startswith("fusedserve demo: 2 cpu workers")
        for prompt in DEMO_PROMPTS:
            assert f"{prompt!r} -> " in out, prompt
        assert out.count("6 tokens, ttft") + out.count("[stop,") == len(DEMO_PROMPTS)
        return out

    short = demo()  # a person's screen: the outputs, then a few lines of summary
    assert len(short.splitlines()) <= 40 and "\n{" not in short
    assert f"{len(DEMO_PROMPTS)} requests, " in short and "tokens/s; time to first token" in short
    assert short.count("KV cache") == 2 and "--json" in short
    out = demo("--json")  # the stats document, as before
    stats = json.loads(out[out.index("\n{") + 1 :])
    assert stats["completed"] == len(DEMO_PROMPTS) and len(stats["workers"]) == 2
    assert sum(w["tokens"] for w in stats["workers"]) == stats["tokens"]


def test_demo_on_a_clean_cache_says_it_builds_before_any_bar(tmp_path):
    """A fresh machine's first run: nothing built, nothing cached. The native build announces
    itself (and its time) before the weight-loading bar starts, and the demo still fits a screen."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions"),
           "FUSEDSERVE_CACHE": str(tmp_path / "cache")}
    for var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(var, None)
    r = subprocess.run([sys.executable, "-m", "fusedserve.coordinator.cli", "demo", "--max-tokens", "4",
                        "--workers", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:]
    out = r.stdout
    build, ready, bar = (out.find(s) for s in ("building the native CPU kernels", "native CPU kernels for",
                                                "loading weights"))
    assert 0 <= build < bar and ready > build, out[-4000:]
    assert re.search(r"native CPU kernels for \w+ ready in \d+ s", out)
    assert len(out.splitlines()) <= 40, out  # everything the terminal shows, the build's lines included


@pytest.fixture(scope="module")
def flagged(ray_session, tmp_path_factory):
    proc = ServeProcess.start(tmp_path_factory.mktemp("flags") / "serve.log", "--workers", "1", "--dtype",
                              "float32", "--max-batch", "4", "--num-blocks", "128",
                              "--max-num-batched-tokens", "24", "--no-prefix-caching")
    yield proc
    proc.stop()


def test_serve_flags_take_effect(flagged):
    prompts = ["Hello", LONG, "def hello(name):", LONG]  # the long prompt twice: no cache to hit
    rc = dict(max_batch=4, num_blocks=128, max_num_batched_tokens=24, enable_prefix_caching=False)
    with LLMEngine("default", dtype="float32", **rc) as eng:
        want = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))]
        assert len(eng.input.encode(LONG)) > 24

    def one(p: str) -> list[int]:
        with Client(flagged.address, timeout_s=300) as c:
            return c.generate(p, max_tokens=10, ignore_eos=True)["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    assert got == want
    with Client(flagged.address) as c:
        w = settled(c)["workers"][0]
    assert 0 < w["max_launch_tokens"] <= 24, "--max-num-batched-tokens caps every launch"
    assert w["prefix_cache"]["enabled"] is False and w["kv_blocks_cached"] == 0
    assert w["prefix_cache"]["hits"] == 0, "--no-prefix-caching: the repeated prompt is computed again"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_serve_on_cuda_equals_offline_on_cuda(ray_session, tmp_path):  # pragma: no cover - GPU machines
    proc = ServeProcess.start(tmp_path / "serve.log", "--workers", "1", "--device", "cuda", "--dtype",
                              "float32", "--max-batch", "4", "--num-blocks", "64")
    try:
        with Client(proc.address, timeout_s=300) as c:
            got = [c.generate(p, max_tokens=12, ignore_eos=True)["token_ids"] for p in DEMO_PROMPTS[:3]]
            kernels = c.stats()["workers"][0]["kernels"]
    finally:
        proc.stop()
    with LLMEngine("default", dtype="float32", device="cuda",
                   **dict(max_batch=4, num_blocks=64)) as eng:
        want = [o.token_ids for o in eng.generate(DEMO_PROMPTS[:3], SamplingParams(max_tokens=12,
                                                                                    ignore_eos=True))]
    assert got == want and kernels["attention"] == "aten-gather"


def test_parallel_flags_reach_the_server_config():
    from fusedserve.coordinator.cli_parser import build_parser, server_config

    cfg = server_config(build_parser().parse_args(["serve", "-tp", "2", "--enable-expert-parallel",
                                                    "--workers", "3"]))
    p = cfg.engine.parallel
    assert (p.workers, p.tensor_parallel_size, p.enable_expert_parallel) == (3, 2, True)
    cfg.check()
    alone = server_config(build_parser().parse_args(["serve", "--enable-expert-parallel"]))
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        alone.check()


def test_grammar_and_fairness_flags_reach_the_server_config():
    from fusedserve.coordinator.cli_parser import build_parser, server_config

    cfg = server_config(build_parser().parse_args([
        "serve", "--grammar-step-max-items", "1000", "--grammar-compile-timeout-s", "2.5",
        "--max-queued-requests", "7", "--max-prompt-chars", "900", "--max-requests-per-client", "3"]))
    assert cfg.grammar.step_max_items == 1000 and cfg.grammar.compile_timeout_s == 2.5
    assert cfg.grammar.max_items_in_row == 2000  # llguidance's default where no flag is given
    assert (cfg.limits.max_queued_requests, cfg.limits.max_prompt_chars) == (7, 900)
    assert cfg.limits.max_requests_per_client == 3


def test_port_is_the_http_port_as_in_vllm_and_zeromq_has_its_own():
    from fusedserve.coordinator.cli_parser import build_parser, http_config, server_config

    args = build_parser().parse_args(["serve", "--port", "8080"])
    assert http_config(args).port == 8080 and server_config(args).port == 5557  # ZeroMQ keeps its default
    older = build_parser().parse_args(["serve", "--http-port", "8081", "--zmq-port", "6000"])
    assert http_config(older).port == 8081 and server_config(older).port == 6000
    assert http_config(build_parser().parse_args(["serve"])).port == 8000
