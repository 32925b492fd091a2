"""The ``fusedserve`` command line: every subcommand's flags, and the ``serve`` flags as a
``ServerConfig``."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from fusedserve.coordinator.client import DEFAULT_ADDRESS, TOKEN_ENV
from fusedserve.coordinator.server.config import Limits, ServerConfig
from fusedserve.coordinator.server.routing_policy import POLICIES, RoutingConfig
from fusedserve.coordinator.structured.grammar_compiler import GrammarLimits
from fusedserve.kernels.model_description.quantization import QUANTIZATIONS
from fusedserve.shared_memory.engine_config import EngineConfig, SchedulerConfig

DEFAULT_MAX_NUM_BATCHED_TOKENS = SchedulerConfig.max_num_batched_tokens


def read_file(path: str | None) -> str | None:
    """A secret from a file (a token, a key), stripped; None when no file is named."""
    if not path:
        return None
    with open(path) as f:
        return f.read().strip() or None


def parse_size(value: str) -> int:
    """A size: bytes, or a number with KiB/MiB/GiB/TiB (or K/M/G/T, KB/MB/GB: powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = value.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1] if text and text[-1] in "KMGT" else ""
    try:
        n = float(text[: len(text) - len(unit)]) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {value!r} (bytes, or e.g. 8GiB)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {value!r}")
    return int(n)


def _workers(value: str) -> int:
    if value == "auto":
        return 0
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("--workers must be >= 1 or 'auto'")
    return n


AUTH_HELP = (f"a file holding the shared auth token (or set ${TOKEN_ENV}); required to bind beyond "
             "loopback. Every frame must then carry it. The token is checked, not encrypted: beyond a "
             "trusted network, reach the port through an SSH tunnel or a VPN.")


def server_config(args: argparse.Namespace, token: str | None = None) -> ServerConfig:
    """The ``serve`` flags as the server's config (``token``: the client auth token read)."""
    limits = Limits(max_tokens=args.max_tokens_limit, max_requests_per_client=args.max_requests_per_client,
                    max_prompt_tokens=args.max_prompt_tokens, max_queued_requests=args.max_queued_requests,
                    max_prompt_chars=args.max_prompt_chars)
    grammar = GrammarLimits(**{f.name: getattr(args, f"grammar_{f.name}") for f in fields(GrammarLimits)})
    return ServerConfig.build(
        model=args.model, revision=args.revision, download_dir=args.download_dir,
        workers=args.workers, device=args.device, dtype=args.dtype,
        quantization=args.quantization, max_model_len=args.max_model_len, max_batch=args.max_batch,
        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=not args.no_async_scheduling,
        threads_per_worker=args.threads_per_worker, cpu_gemm=args.cpu_gemm,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, **args.speculative_config,
        host=args.host, port=args.zmq_port, transport=args.transport, auth_token=token, limits=limits,
        grammar=grammar, admin_token=read_file(args.admin_token_file),
        routing=RoutingConfig(args.routing, args.routing_balance_abs, args.routing_balance_rel),
        curve_secret_key=read_file(args.curve_secret_key_file))


GRAMMAR_HELP = {
    "max_items_in_row": "alternatives one grammar production may have",
    "initial_lexer_fuel": "work allowed building a grammar's lexer (about 50k a millisecond)",
    "step_lexer_fuel": "lexer work allowed for one token's mask (about 14k a millisecond)",
    "step_max_items": "Earley items allowed for one token's mask (about 20k a millisecond)",
    "max_lexer_states": "lexer states a grammar may build (1-2 kB each)",
    "max_grammar_size": "symbols a grammar's productions may hold",
    "compile_timeout_s": "seconds a grammar may take to compile (off the loop) before its request is refused",
}


def _grammar_flags(p: argparse.ArgumentParser) -> None:
    """Structured outputs' limits (llguidance's LLParserLimits): a grammar past them is refused at
    admission where the parser can tell, else ends its request alone with grammar_error."""
    for f in fields(GrammarLimits):
        p.add_argument(f"--grammar-{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                       dest=f"grammar_{f.name}", help=f"{GRAMMAR_HELP[f.name]} (default {f.default})")


# On by default where it pays (docs/ARCHITECTURE.md, "Speculative decoding"): n-gram proposals, k = 4,
# at a worker holding at most 4 requests; a request whose proposals do not pay pauses them.
DEFAULT_SPECULATION = '{"method": "ngram"}'


def speculative_settings(text: str) -> dict[str, object]:
    """``--speculative-config``'s JSON (or ``off``) as engine settings (``SpeculativeConfig``'s names)."""
    if text.strip().lower() in ("off", "none", "{}"):
        return {"speculative_method": "off"}
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError("a JSON object, such as {\"method\": \"ngram\"}")
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
  fusedserve serve --model Qwen/Qwen3-0.6B          # then: curl http://127.0.0.1:8000/v1/models
  fusedserve generate "The with statement" --stream
  fusedserve stats
  fusedserve scale 2
  fusedserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 64
  fusedserve curve-keygen keys/
"""


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's flags (tests parse with it too)."""
    ap = argparse.ArgumentParser(prog="fusedserve", epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="LLM serving for Qwen3-family models: ZeroMQ and the "
                                             "OpenAI HTTP API.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for name in ("serve", "demo"):
        p = sub.add_parser(name, help=COMMAND_HELP[name])
        p.add_argument("--model", default="default",
                       help="a Qwen3 directory, a Hugging Face id (ORG/NAME: the hub's cache first, then a "
                       "download where the network allows; HF_HUB_OFFLINE is honoured), or 'default'")
        p.add_argument("--revision", default=None, help="of a Hugging Face id: a branch, tag or commit")
        p.add_argument("--download-dir", default=None, help="the Hugging Face cache to use")
        p.add_argument("--workers", type=_workers, default=2 if name == "demo" else 1,
                       help="number of workers, or 'auto' for one per device in the cluster")
        p.add_argument("--transport", default="auto", choices=["auto", "serial"],
                       help="serial forces the off-node serializing transport")
        p.add_argument("--device", default="cpu" if name == "demo" else "auto",
                       choices=["auto", "cpu", "cuda", "npu"])
        p.add_argument("--host", default="127.0.0.1",
                       help="bind address; anything beyond loopback requires --auth-token-file")
        p.add_argument("--auth-token-file", default=None, help=AUTH_HELP)
        p.add_argument("--admin-token-file", default=None,
                       help="a file holding the admin token, different from the client token: admin frames "
                       "(scale, workers) must carry it; without it a server with a client token refuses them")
        p.add_argument("--curve-secret-key-file", default=None,
                       help="encrypt the ZeroMQ socket with CURVE: the server's secret key (fusedserve "
                       "curve-keygen writes a pair); clients need its public key")
        p.add_argument("--ssl-keyfile", default=None, help="serve the HTTP API over TLS: the key (PEM)")
        p.add_argument("--ssl-certfile", default=None,
                       help="serve the HTTP API over TLS: the certificate (PEM)")
        p.add_argument("--max-tokens-limit", type=int, default=None,
                       help="largest max_tokens a request may ask for (default: max-model-len)")
        p.add_argument("--max-prompt-tokens", type=int, default=None,
                       help="longest prompt in tokens (default: max-model-len - 1)")
        p.add_argument("--max-requests-per-client", type=int, default=Limits.max_requests_per_client,
                       help="requests one client may have in flight: a ZeroMQ connection, or an HTTP "
                       "client (its API key and address); more get 429 with Retry-After")
        p.add_argument("--routing", default=RoutingConfig.policy, choices=POLICIES,
                       help="which worker a request goes to: cache-aware (the one holding most of its "
                       "prefix among those near the least load), session (its session's last worker "
                       "first: X-Session-Id or user over HTTP, session_id on ZeroMQ), least-loaded")
        p.add_argument("--routing-balance-abs", type=int, default=RoutingConfig.balance_abs,
                       help="sequences above the least-loaded worker's load a prefix hit may still go to")
        p.add_argument("--routing-balance-rel", type=float, default=RoutingConfig.balance_rel,
                       help="... or this share of the least load, whichever is more")
        p.add_argument("--max-queued-requests", type=int, default=Limits.max_queued_requests,
                       help="requests in flight on the whole server; more get 429 (server_busy)")
        p.add_argument("--max-prompt-chars", type=int, default=Limits.max_prompt_chars,
                       help="characters of text one request may ask to tokenize (prompts, chat messages "
                       "and the rendered turn), checked before tokenizing; more get 413")
        p.add_argument("--port", "--http-port", dest="http_port", type=int, default=8000,
                       help="the OpenAI-compatible HTTP API's port at --host, as vLLM's --port "
                       "(0: a free one; --http-port is the older name)")
        p.add_argument("--zmq-port", type=int, default=5557,
                       help="the ZeroMQ front end's port at --host (0: a free one)")
        p.add_argument("--no-http", action="store_true", help="serve ZeroMQ alone, no HTTP API")
        p.add_argument("--generation-config", default="auto",
                       help="default sampling values of the HTTP API: auto (the model's "
                       "generation_config.json), none, or a directory holding one")
        p.add_argument("--reasoning-parser", default="auto", choices=["auto", "qwen3", "none"],
                       help="split <think> blocks into reasoning_content (auto: where the chat "
                       "template has them, as Qwen3's does)")
        p.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "none"],
                       help="parse <tool_call> JSON into tool_calls for tool_choice auto (auto: where "
                       "the chat template renders tools that way, as Qwen3's does)")
        p.add_argument("--chat-template", default=None,
                       help="the chat template (a file, or its text); default: the model directory's "
                       "chat_template.jinja, else its tokenizer_config.json's")
        p.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a request's own chat_template render its prompt (Jinja, sandboxed); "
                       "without it such a request gets 400")
        p.add_argument("--served-model-name", default=None,
                       help="the model id of the HTTP API (default: --model as given)")
        p.add_argument("--dtype", default=None,
                       help="float32, bfloat16, float16, or auto (the fastest here for the checkpoint; "
                       "default: the checkpoint's)")
        p.add_argument("--quantization", default=None, choices=["none", *QUANTIZATIONS],
                       help="quantized at load: int8 per channel, int4 in groups of 32 (lm_head int8); "
                       "on the CPU both multiply with int8 activations (per token); int8-weight-only "
                       "keeps the activations 16-bit")
        p.add_argument("--cpu-gemm", default="auto", choices=["auto", "native"],
                       help="auto: oneDNN's GEMM (AMX where the CPU has it) at the launch sizes where it "
                       "measured faster at load, and SDPA for the prompt chunk sizes where it did, the "
                       "native kernels elsewhere; native: the native kernels always (16-bit outputs "
                       "bit-equal whatever the batch)")
        p.add_argument("--max-model-len", type=int, default=None,
                       help="the longest sequence (default: the model's own context, YaRN included, or "
                       "what the KV cache holds if less)")
        p.add_argument("--max-num-seqs", "--max-batch", dest="max_batch", type=int, default=128,
                       help="sequences a worker runs at once (rows of a launch)")
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                       help="auto: K/V in the model's dtype; int8: int8 values and a float32 scale per "
                       "token and head (native CPU kernels): half the bytes a decode step reads from "
                       "the cache, twice the tokens in the same memory")
        p.add_argument("--num-blocks", type=int, default=None,
                       help="KV blocks per worker (default: sized from memory, see --kv-cache-memory)")
        p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                       help="KV cache per worker, in bytes or with a suffix (8GiB, 512MiB); default on the "
                       "CPU: 40%% of this host's available memory over its workers")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="on a GPU: the share of its memory a worker uses, weights and KV cache")
        p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                       help="the token budget of one launch: every running stream's decode row, then "
                       "prompt chunks in the rest (a longer prompt is split across launches); more than "
                       f"--max-batch (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
        p.add_argument("--no-prefix-caching", action="store_true",
                       help="free KV blocks when their sequence ends instead of keeping them as a "
                       "prefix cache")
        p.add_argument("--no-async-scheduling", action="store_true",
                       help="one launch in flight per worker: schedule the next only after reading "
                       "this one's ids (default: two in flight, the next fed on the device)")
        p.add_argument("--speculative-config", type=speculative_settings, default=DEFAULT_SPECULATION,
                       help='speculative decoding, as vLLM spells it: JSON such as {"method": "ngram", '
                       '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
                       '"disable_by_batch_size": 4} (the last: speculate only while a worker holds at '
                       'most this many requests), or {"model": DRAFT_DIR, "num_speculative_tokens": 4} '
                       "for a smaller Qwen3 sharing the tokenizer, run on each worker; off to turn it "
                       f"off. Default {DEFAULT_SPECULATION}: n-gram proposals while a worker holds at "
                       "most 4 requests, each request pausing them while they do not pay")
        p.add_argument("--threads-per-worker", type=int, default=0,
                       help="per rank, each pinned to cores of its own (default 0: the cores this process "
                       "may use divided among the node's ranks)")
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="devices per worker, one Ray actor each, placed on one node; --workers "
                       "groups of them (data parallel on top)")
        p.add_argument("--enable-expert-parallel", action="store_true",
                       help="with --tensor-parallel-size: place a MoE model's experts whole across the "
                       "group instead of splitting every expert")
        p.add_argument("--max-tokens", type=int, default=16)
        if name == "demo":
            p.add_argument("--json", action="store_true", help="print the server's stats document after "
                           "the outputs instead of the short summary")
        _grammar_flags(p)
        p.add_argument("--ray-address", default=None,
                       help="join this Ray cluster ('auto': the one this process runs in); default: "
                       "start a head of this server's own, stopped with it")
        for port in ("gcs", "dashboard-agent", "metrics-export", "runtime-env-agent"):
            p.add_argument(f"--ray-{port}-port", type=int, default=0,
                           help=f"embedded head's {port} port (default: a free port)")
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
