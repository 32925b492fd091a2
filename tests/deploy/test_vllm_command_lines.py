"""vLLM users' ``serve`` command lines, unchanged: each flag is honoured (read back from the
configs it builds), accepted as a no-op with its notice, or refused by name, as the README's
table says; and ``--port`` serves the HTTP API there, behind ``--api-key``."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import httpx
import openai
import pytest

from fusedserve.coordinator import cli, vllm_flags
from fusedserve.coordinator.cli_parser import (
    VLLM_HONOURED,
    honoured_vllm_flags,
    http_config,
    parse,
    server_config,
)
from tests.serve_proc import ServeProcess

README = Path(__file__).resolve().parents[2] / "README.md"


def settle(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[object, str]:
    """What ``serve`` makes of a command line before it starts anything: the (server, HTTP)
    configs or an exit status, and what it said on stderr."""
    capsys.readouterr()
    out = cli._settings(parse(["serve", *argv]))
    return out, capsys.readouterr().err


# Command lines from vLLM's serving docs and common recipes, with what each must become here.
HONOURED = [
    (["Qwen/Qwen3-0.6B"], lambda s, h: s.engine.model.model == "Qwen/Qwen3-0.6B"),
    (["--model", "Qwen/Qwen3-8B", "--port", "8080"], lambda s, h: h.port == 8080 and s.port == 5557),
    (["Qwen/Qwen3-8B", "--host", "0.0.0.0", "--api-key", "token-abc123"],
     lambda s, h: (h.host, h.api_key, s.host) == ("0.0.0.0", "token-abc123", "127.0.0.1")),
    (["Qwen/Qwen3-8B", "--max-model-len", "32k"], lambda s, h: s.engine.model.max_model_len == 32000),
    (["Qwen/Qwen3-8B", "--max-model-len", "32K"], lambda s, h: s.engine.model.max_model_len == 32768),
    (["Qwen/Qwen3-8B", "--max-num-seqs", "64", "--max-num-batched-tokens", "8192"],
     lambda s, h: (s.engine.scheduler.max_batch, s.engine.scheduler.max_num_batched_tokens) == (64, 8192)),
    (["Qwen/Qwen3-8B", "--gpu-memory-utilization", "0.85", "--dtype", "half"],
     lambda s, h: s.engine.cache.gpu_memory_utilization == 0.85 and s.engine.model.dtype == "half"),
    (["Qwen/Qwen3-8B", "--no-enable-prefix-caching"], lambda s, h: not s.engine.cache.enable_prefix_caching),
    (["Qwen/Qwen3-8B", "--enable-prefix-caching"], lambda s, h: s.engine.cache.enable_prefix_caching),
    (["Qwen/Qwen3-8B", "--seed", "42"], lambda s, h: s.seed == 42),
    (["Qwen/Qwen3-8B", "--served-model-name", "qwen3", "gpt-4o"],
     lambda s, h: h.served_model_name == ("qwen3", "gpt-4o")),
    (["Qwen/Qwen3-8B", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
     lambda s, h: h.enable_auto_tool_choice and h.tool_call_parser == "hermes"),
    (["Qwen/Qwen3-8B", "--reasoning-parser", "deepseek_r1"],
     lambda s, h: h.reasoning_parser == "deepseek_r1"),
    (["Qwen/Qwen3-8B", "--reasoning-parser", "qwen3"], lambda s, h: h.reasoning_parser == "qwen3"),
    (["Qwen/Qwen3-Coder-30B-A3B-Instruct", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"],
     lambda s, h: h.tool_call_parser == "qwen3_coder" and h.enable_auto_tool_choice),
    (["Qwen/Qwen3-8B", "--max-logprobs", "5"], lambda s, h: s.limits.max_logprobs == 5),
    (["Qwen/Qwen3-8B", "--enable-lora", "--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat",
      "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8"],
     lambda s, h: (s.engine.lora.enable_lora, s.engine.lora.lora_modules, s.engine.lora.max_loras,
                   s.engine.lora.max_lora_rank, s.engine.lora.max_cpu_loras)
     == (True, ("sql=/adapters/sql", "chat=/adapters/chat"), 4, 64, 8)),
    (["Qwen/Qwen3-Embedding-0.6B", "--runner", "pooling"], lambda s, h: s.engine.model.runner == "pooling"),
    (["Qwen/Qwen3-Reranker-0.6B", "--runner", "pooling", "--convert", "classify"],
     lambda s, h: (s.engine.model.runner, s.engine.model.pooling_task) == ("pooling", "classify")),
    (["Qwen/Qwen3-8B", "--uvicorn-log-level", "info", "--enable-log-requests"],
     lambda s, h: h.uvicorn_log_level == "info" and h.enable_log_requests),
    (["Qwen/Qwen3-8B", "--disable-log-requests"], lambda s, h: not h.enable_log_requests),
    (["Qwen/Qwen3-8B", "--allowed-origins", '["https://app.example"]', "--allowed-methods", "GET,POST"],
     lambda s, h: h.allowed_origins == ("https://app.example",) and h.allowed_methods == ("GET", "POST")),
    (["Qwen/Qwen3-8B", "--quantization", "fp8"], lambda s, h: s.engine.model.quantization == "fp8"),
    (["Qwen/Qwen3-8B", "-tp", "2", "--data-parallel-size", "2"],
     lambda s, h: (s.engine.parallel.tensor_parallel_size, s.engine.parallel.workers) == (2, 2)),
    (["Qwen/Qwen3-8B", "--enforce-eager"], lambda s, h: s.engine.device.graphs == "off"),
    (["Qwen/Qwen3-8B", "--kv-cache-memory-bytes", "4GiB", "--block-size", "32"],
     lambda s, h: (s.engine.cache.kv_cache_memory, s.engine.cache.block_size) == (4 << 30, 32)),
    (["Qwen/Qwen3-8B", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
     lambda s, h: s.engine.speculative.num_speculative_tokens == 3),
    (["Qwen/Qwen3-8B", "--no-async-scheduling"], lambda s, h: not s.engine.scheduler.async_scheduling),
    (["Qwen/Qwen3-8B", "--generation-config", "vllm"], lambda s, h: h.generation_config == "vllm"),
]
NOOPS = [
    (["Qwen/Qwen3-8B", "--trust-remote-code"], "--trust-remote-code"),
    (["Qwen/Qwen3-8B", "--enable-chunked-prefill"], "--enable-chunked-prefill"),
    (["Qwen/Qwen3-8B", "--disable-custom-all-reduce", "-tp", "2"], "--disable-custom-all-reduce"),
    (["Qwen/Qwen3-8B", "--swap-space", "16"], "--swap-space 16"),
    (["Qwen/Qwen3-8B", "--disable-log-stats"], "--disable-log-stats"),
    (["Qwen/Qwen3-8B", "--distributed-executor-backend", "ray"], "--distributed-executor-backend ray"),
    (["Qwen/Qwen3-8B", "--tokenizer-mode", "auto", "--load-format", "safetensors"],
     "--load-format safetensors"),
    (["Qwen/Qwen3-8B", "--max-seq-len-to-capture", "8192"], "--max-seq-len-to-capture 8192"),
    (["Qwen/Qwen3-8B", "--pipeline-parallel-size", "1"], "--pipeline-parallel-size 1"),
]
REFUSED = [
    (["Qwen/Qwen3-8B", "--lora-modules", "sql=/adapters/sql"], "enable_lora"),
    (["Qwen/Qwen3-8B", "--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
    (["Qwen/Qwen3-8B", "--tool-call-parser", "mistral"], "--tool-call-parser mistral"),
    (["Qwen/Qwen3-8B", "--task", "embed"], "--task embed"),
    (["Qwen/Qwen3-8B", "--max-logprobs", "64"], "max_logprobs"),
    (["Qwen/Qwen3-8B", "--host", "0.0.0.0"], "--api-key"),  # beyond loopback, anyone could call it
]


@pytest.mark.parametrize(("argv", "check"), HONOURED, ids=[" ".join(a[1:]) or a[0] for a, _ in HONOURED])
def test_honoured_flags_reach_the_configs(argv, check, capsys):
    out, err = settle(argv, capsys)
    assert not isinstance(out, int), err
    assert check(*out), out
    if "fp8" not in argv:
        assert err == "", err  # no notice for what is honoured


@pytest.mark.parametrize(("argv", "flag"), NOOPS, ids=[f for _, f in NOOPS])
def test_engine_details_are_accepted_with_a_notice(argv, flag, capsys):
    out, err = settle(argv, capsys)
    assert not isinstance(out, int), err
    assert f"fusedserve: {flag}: accepted, no effect: " in err
    given = [a for a in argv if a in vllm_flags.BY_FLAG]
    assert len(err.strip().splitlines()) == len(given)  # one line each
    assert vllm_flags.BY_FLAG[flag.split()[0]].why in err


@pytest.mark.parametrize(("argv", "named"), REFUSED, ids=[n for _, n in REFUSED])
def test_unbuilt_features_are_refused_by_name(argv, named, capsys):
    out, err = settle(argv, capsys)
    assert out == 2 and named in err, err


def test_the_command_lines_cover_every_flag_this_issue_names():
    named = ["--port", "--api-key", "--trust-remote-code", "--disable-log-requests",
             "--enable-auto-tool-choice",
             "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill", "--seed",
             "--uvicorn-log-level", "--allowed-origins", "--max-model-len", "--enable-lora", "--max-logprobs",
             "--quantization", "--tool-call-parser", "--reasoning-parser", "--served-model-name", "--host",
             "--allowed-methods", "--disable-custom-all-reduce", "--enable-log-requests"]
    lines = [a for a, _ in HONOURED + NOOPS + REFUSED]
    assert len(lines) >= 28
    given = {tok for argv in lines for tok in argv if tok.startswith("-")}
    assert set(named) <= given, set(named) - given


def test_readme_table_lists_every_vllm_flag_as_the_code_treats_it():
    table = vllm_flags.table(honoured_vllm_flags())
    stale = "README's flag table is stale: python -m fusedserve.coordinator.cli_parser prints it"
    assert table in README.read_text(), stale
    rows = re.findall(r"^\| `([^`]+)` \| (honoured|no-op|refused) \|", table, re.M)
    assert len(rows) == len(VLLM_HONOURED) + len(vllm_flags.FLAGS) and len({f for f, _ in rows}) == len(rows)


def test_types_parse_as_vllm_parses_them():
    args = parse(["serve", "--max-model-len", "1M", "--max-num-batched-tokens", "16k",
                  "--no-async-scheduling", "--speculative-config", "off"])
    cfg = server_config(args)
    assert cfg.engine.model.max_model_len == 1 << 20 and cfg.engine.scheduler.max_num_batched_tokens == 16000
    assert not cfg.engine.scheduler.async_scheduling and cfg.engine.speculative.speculative_method == "off"
    with pytest.raises(SystemExit):
        parse(["serve", "--max-model-len", "32q"])
    assert parse(["serve", "--no-prefix-caching"]).enable_prefix_caching is False  # the older spelling


def test_a_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: Qwen/Qwen3-8B\nmax_model_len: 32k\nport: 9000\nenable-prefix-caching: false\n"
                    "served-model-name: [a, b]\n"
                    "speculative_config: {method: ngram, num_speculative_tokens: 2}\n"
                    "enable_auto_tool_choice: true\n")
    args = parse(["serve", "--config", str(path), "--port", "9100"])
    cfg, http = server_config(args), http_config(args)
    assert cfg.engine.model.model == "Qwen/Qwen3-8B" and cfg.engine.model.max_model_len == 32000
    assert http.port == 9100 and http.served_model_name == ("a", "b") and http.enable_auto_tool_choice
    assert not cfg.engine.cache.enable_prefix_caching and cfg.engine.speculative.num_speculative_tokens == 2


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("FUSEDSERVE_API_KEY", "from-the-environment")
    assert http_config(parse(["serve"])).api_key == "from-the-environment"
    assert http_config(parse(["serve", "--api-key", "given"])).api_key == "given"


def test_every_serve_flag_has_help():
    serve = parse.__globals__["build_parser"]()._subparsers._group_actions[0].choices["serve"]
    missing = [a.option_strings for a in serve._actions if a.option_strings and not a.help]
    assert not missing, missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_port_serves_the_openai_api_behind_the_api_key(ray_session, tmp_path):
    port = _free_port()
    proc = ServeProcess.start(tmp_path / "serve.log", "default", "--port", str(port), "--api-key",
                              "sk-test-key",
                              "--served-model-name", "qwen3", "alias", "--dtype", "float32", "--max-num-seqs",
                              "4", "--num-blocks", "64", "--trust-remote-code", "--seed", "3",
                              "--allowed-origins", "https://app.example")
    try:
        assert proc.http == f"http://127.0.0.1:{port}"
        assert any("OpenAI API on" in line and "bearer token required" in line for line in proc.lines)
        assert any("--trust-remote-code: accepted, no effect" in line for line in
                   (tmp_path / "serve.log").read_text().splitlines())
        client = openai.OpenAI(base_url=f"{proc.http}/v1", api_key="sk-test-key")
        assert [m.id for m in client.models.list().data] == ["qwen3", "alias"]
        out = client.completions.create(model="alias", prompt="The capital of France is", max_tokens=4)
        assert out.model == "qwen3" and out.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{proc.http}/v1", api_key="wrong").models.list()
        preflight = httpx.options(f"{proc.http}/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers.get("access-control-allow-origin") == "https://app.example"
        other = httpx.options(f"{proc.http}/v1/completions", headers={
            "Origin": "https://elsewhere.example", "Access-Control-Request-Method": "POST"})
        assert other.headers.get("access-control-allow-origin") is None
    finally:
        proc.stop()
