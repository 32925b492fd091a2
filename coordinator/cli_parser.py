"""The ``fusedserve`` command line: every subcommand's flags, and the ``serve`` flags as a
``ServerConfig``."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from fusedserve.coordinator import vllm_flags
from fusedserve.coordinator.client import DEFAULT_ADDRESS, TOKEN_ENV
from fusedserve.coordinator.config_flags import Section, add_flags, build, parse_json, values
from fusedserve.coordinator.openai.http_config import API_KEY_ENV, HttpConfig
from fusedserve.coordinator.server.config import Limits, ServerConfig
from fusedserve.coordinator.server.routing_policy import RoutingConfig
from fusedserve.coordinator.structured.grammar_compiler import GrammarLimits
from fusedserve.shared_memory.engine_config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


def read_file(path: str | None) -> str | None:
    """A secret from a file (a token, a key), stripped; None when no file is named."""
    if not path:
        return None
    with open(path) as f:
        return f.read().strip() or None


AUTH_HELP = (f"a file holding the shared auth token (or set ${TOKEN_ENV}); required to bind beyond "
             "loopback. Every frame must then carry it. The token is checked, not encrypted: beyond a "
             "trusted network, reach the port through an SSH tunnel or a VPN.")


LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
ENGINE = [Section(ModelConfig, title="the model"), Section(CacheConfig, title="the KV cache"),
          Section(SchedulerConfig, title="the scheduler"), Section(DeviceConfig, title="the device"),
          Section(ParallelConfig, title="parallelism"), Section(LoraConfig, title="LoRA adapters")]
SERVER = [Section(ServerConfig, title="the ZeroMQ front end and the coordinator"),
          Section(Limits, title="request limits"), Section(RoutingConfig, "routing_", "routing"),
          Section(GrammarLimits, "grammar_", "structured outputs' limits (llguidance's LLParserLimits): a "
                  "grammar past them is refused at admission where the parser can tell, else ends its "
                  "request alone with grammar_error")]
HTTP = Section(HttpConfig, title="the OpenAI HTTP API")
SECTIONS = [*ENGINE, *SERVER, HTTP]


def server_config(args: argparse.Namespace, token: str | None = None) -> ServerConfig:
    """The ``serve`` flags as the server's config (``token``: the client auth token read)."""
    engine: dict[str, object] = {}
    for section in ENGINE:
        engine.update(values(args, section))
    engine.update(args.speculative_config)
    if getattr(args, "model_tag", None):
        engine["model"] = args.model_tag
    if args.enforce_eager:
        engine["graphs"] = "off"
    if os.environ.get(LONG_MAX_MODEL_LEN_ENV) == "1":  # vLLM's switch, honoured as the flag
        engine["allow_long_max_model_len"] = True
    limits, routing, grammar = (build(args, s) for s in SERVER[1:])
    return ServerConfig(engine=EngineConfig.build(**engine), limits=limits, routing=routing, grammar=grammar,
                        auth_token=token, admin_token=read_file(args.admin_token_file),
                        curve_secret_key=read_file(args.curve_secret_key_file), **values(args, SERVER[0]))


def http_config(args: argparse.Namespace) -> HttpConfig:
    """The HTTP API's flags (``--api-key``, else ``$FUSEDSERVE_API_KEY``)."""
    settings = values(args, HTTP)
    settings["api_key"] = settings["api_key"] or os.environ.get(API_KEY_ENV) or None
    return HttpConfig(**settings)


# On by default where it pays (docs/ARCHITECTURE.md, "Speculative decoding"): n-gram proposals, k = 4,
# at a worker holding at most 4 requests; a request whose proposals do not pay pauses them.
DEFAULT_SPECULATION = '{"method": "ngram"}'


def speculative_settings(text: str) -> dict[str, object]:
    """``--speculative-config``'s JSON (or ``off``) as engine settings (``SpeculativeConfig``'s names)."""
    if text.strip().lower() in ("off", "none", "{}"):
        return {"speculative_method": "off"}
    spec = parse_json(text)
    names = {"method": "speculative_method", "model": "speculative_model",
             "num_speculative_tokens": "num_speculative_tokens",
             "prompt_lookup_max": "prompt_lookup_max", "prompt_lookup_min": "prompt_lookup_min",
             "disable_by_batch_size": "speculative_max_batch"}
    unknown = sorted(set(spec) - set(names))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown keys {unknown}; known: {sorted(names)}")
    settings = {names[k]: v for k, v in spec.items()}
    settings.setdefault("speculative_method", "draft" if "speculative_model" in settings else "ngram")
    if settings["speculative_method"] == "draft_model":  # vLLM's name for it
        settings["speculative_method"] = "draft"
    try:
        EngineConfig.build(**settings).check()
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return settings


COMMAND_HELP = {
    "serve": "serve a model over ZeroMQ and the OpenAI HTTP API (port 8000)",
    "demo": "start a two-worker server on the embedded model, run a few prompts, stop",
    "generate": "send one prompt to a running server and print its output",
    "bench": "benchmarks against a running server (bench serve: TTFT, TPOT, throughput)",
    "stats": "print a running server's stats document",
    "scale": "add or drain workers of a running server",
    "curve-keygen": "write a CURVE key pair for the ZeroMQ front end",
}
EXAMPLES = """examples:
  fusedserve demo                                   # the embedded model, no download
  fusedserve serve Qwen/Qwen3-0.6B                  # then: curl http://127.0.0.1:8000/v1/models
  fusedserve generate "The with statement" --stream
  fusedserve stats
  fusedserve scale 2
  fusedserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 64
  fusedserve curve-keygen keys/
"""


SERVE_EXAMPLES = """examples (vLLM's command lines work as they are; see the README's flag table):
  fusedserve serve Qwen/Qwen3-0.6B --port 8080 --api-key sk-local-0123456789
  fusedserve serve ./Qwen3-8B --max-model-len 32k --max-num-seqs 64 --enable-auto-tool-choice
  fusedserve serve --config serve.yaml            # YAML: flag names as keys; the command line wins
"""


def _serve_flags(p: argparse.ArgumentParser, demo: bool) -> None:
    """The settings' own flags (from the config classes), then the ones that read files or JSON,
    the Ray cluster's, and vLLM's other flags."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM takes it (the same as --model)")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="settings from a YAML file, flag names as keys (max_model_len: 32k); flags on the "
                   "command line override them")
    defaults = {"workers": 2, "device": "cpu"} if demo else {}
    for section in SECTIONS:
        add_flags(p.add_argument_group(section.title), section, defaults)
    files = p.add_argument_group("secrets, read from files")
    files.add_argument("--auth-token-file", default=None, help=AUTH_HELP)
    files.add_argument("--admin-token-file", default=None,
                       help="a file holding the admin token, different from the client token: admin frames "
                       "(scale, workers) must carry it; without it a server with a client token refuses them")
    files.add_argument("--curve-secret-key-file", default=None,
                       help="encrypt the ZeroMQ socket with CURVE: the server's secret key (fusedserve "
                       "curve-keygen writes a pair); clients need its public key")
    p.add_argument("--speculative-config", type=speculative_settings, default=DEFAULT_SPECULATION,
                   help='speculative decoding, as vLLM spells it: JSON such as {"method": "ngram", '
                   '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
                   '"disable_by_batch_size": 4} (the last: speculate only while a worker holds at '
                   'most this many requests), or {"model": DRAFT_DIR, "num_speculative_tokens": 4} '
                   "for a smaller Qwen3 sharing the tokenizer, run on each worker; off to turn it "
                   f"off. Default {DEFAULT_SPECULATION}: n-gram proposals while a worker holds at "
                   "most 4 requests, each request pausing them while they do not pay")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode eagerly, as vLLM's: the same as --graphs off")
    if demo:
        p.add_argument("--max-tokens", type=int, default=16, help="tokens each demo prompt generates")
        p.add_argument("--json", action="store_true", help="print the server's stats document after "
                       "the outputs instead of the short summary")
    ray = p.add_argument_group("the Ray cluster")
    ray.add_argument("--ray-address", default=None,
                     help="join this Ray cluster ('auto': the one this process runs in); default: "
                     "start a head of this server's own, stopped with it")
    for port in ("gcs", "dashboard-agent", "metrics-export", "runtime-env-agent"):
        ray.add_argument(f"--ray-{port}-port", type=int, default=0,
                         help=f"embedded head's {port} port (default: a free port)")
    vllm_flags.add_flags(p)


# vLLM's flags this parser honours (beside its own names): the README's table lists them first.
VLLM_HONOURED = (
    "--model", "--revision", "--download-dir", "--dtype", "--quantization", "--max-model-len", "--runner",
    "--convert", "--seed",
    "--max-logprobs", "--generation-config", "--served-model-name", "--block-size",
    "--num-gpu-blocks-override", "--kv-cache-memory-bytes", "--gpu-memory-utilization",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--kv-cache-dtype", "--max-num-seqs",
    "--max-num-batched-tokens", "--async-scheduling", "--tensor-parallel-size", "--data-parallel-size",
    "--enable-expert-parallel", "--speculative-config", "--enforce-eager", "--enable-lora", "--lora-modules",
    "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--host", "--port",
    "--ssl-keyfile", "--ssl-certfile", "--api-key", "--allowed-origins", "--allowed-methods",
    "--allowed-headers",
    "--allow-credentials", "--uvicorn-log-level", "--enable-log-requests", "--disable-log-requests",
    "--reasoning-parser", "--tool-call-parser", "--enable-auto-tool-choice", "--chat-template",
    "--trust-request-chat-template", "--return-tokens-as-token-ids", "--config",
)


def honoured_vllm_flags() -> list[tuple[str, str]]:
    """(flag, its help) for every vLLM flag in ``VLLM_HONOURED``, as the serve parser has it."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    by_flag = {o: a for a in serve._actions for o in a.option_strings}
    out = []
    for flag in VLLM_HONOURED:
        action = by_flag[flag]
        text = re.sub(r" \(default [^()]*\)$", "", (action.help or "").replace("%%", "%"))
        if flag.startswith("--no-") and isinstance(action, argparse.BooleanOptionalAction):
            text = "turns it off: " + text
        out.append((flag, text.replace("|", "/")))
    return out


def expand_config_file(argv: list[str]) -> list[str]:
    """``--config FILE.yaml``'s settings as flags, put before the command line's (so those win), as
    vLLM reads it: keys are flag names (dashes or underscores), ``true`` a bare flag, ``false`` its
    ``--no-`` form, lists several values, mappings JSON."""
    if "--config" not in argv:
        return argv
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise SystemExit("fusedserve: --config needs a file")
    import yaml

    path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    try:
        with open(path) as f:
            settings = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"fusedserve: --config {path}: {exc}") from None
    if not isinstance(settings, dict):
        raise SystemExit(f"fusedserve: --config {path}: a mapping of flag names to values")
    flags: list[str] = []
    for key, value in settings.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    at = next((j + 1 for j, a in enumerate(rest) if a in ("serve", "demo")), 0)
    return rest[:at] + flags + rest[at:]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--config`` expanded)."""
    return build_parser().parse_args(expand_config_file(list(sys.argv[1:] if argv is None else argv)))


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's flags (tests parse with it too)."""
    ap = argparse.ArgumentParser(prog="fusedserve", epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="LLM serving for Qwen3-family models: ZeroMQ and the "
                                             "OpenAI HTTP API.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for name in ("serve", "demo"):
        p = sub.add_parser(name, help=COMMAND_HELP[name], description=COMMAND_HELP[name],
                           epilog=SERVE_EXAMPLES if name == "serve" else None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _serve_flags(p, demo=name == "demo")
    g = sub.add_parser("generate", help=COMMAND_HELP["generate"])
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stream", action="store_true")
    bench = sub.add_parser("bench", help=COMMAND_HELP["bench"])
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from fusedserve.coordinator.openai import bench_serve

    bench_serve.add_arguments(bench_sub.add_parser("serve", help="load the OpenAI API; print TTFT/TPOT"))
    s = sub.add_parser("stats", help=COMMAND_HELP["stats"])
    sc = sub.add_parser("scale", help=COMMAND_HELP["scale"])
    sc.add_argument("workers", type=int)
    for p in (g, s, sc):
        p.add_argument("--address", default=DEFAULT_ADDRESS)
        p.add_argument("--auth-token-file", default=None, help=f"the server's token file (or ${TOKEN_ENV})")
        p.add_argument("--admin-token-file", default=None, help="the server's admin token file (scale)")
        p.add_argument("--curve-server-key-file", default=None,
                       help="the server's CURVE public key file, where its socket is encrypted")
    kg = sub.add_parser("curve-keygen", help=COMMAND_HELP["curve-keygen"])
    kg.add_argument("dir")
    return ap


if __name__ == "__main__":  # the README's table of vLLM's flags
    sys.stdout.write(vllm_flags.table(honoured_vllm_flags()) + "\n")
