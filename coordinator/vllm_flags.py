"""vLLM's ``serve`` flags that fusedserve does not honour as settings: accepted with a one-line
notice saying what fusedserve does instead, or refused by name with why.

The honoured ones are the settings' own flags (``coordinator/config_flags.py``); together they
make the README's table (``python -m fusedserve.coordinator.cli_parser`` prints it, and a test
keeps the README equal to it).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

NOOP, REFUSED = "no-op", "refused"


@dataclass(frozen=True)
class VllmFlag:
    flag: str
    status: str  # NOOP | REFUSED
    why: str
    takes_value: bool = True
    # NOOP with a value: only these values are a no-op; any other is refused with ``why_not``.
    values: tuple[str, ...] | None = None
    why_not: str = ""

    @property
    def dest(self) -> str:
        return "vllm_" + self.flag.lstrip("-").replace("-", "_")


def _n(flag: str, why: str, takes_value: bool = True, values: tuple[str, ...] | None = None,
       why_not: str = "") -> VllmFlag:
    return VllmFlag(flag, NOOP, why, takes_value, values, why_not)


def _r(flag: str, why: str, takes_value: bool = True) -> VllmFlag:
    return VllmFlag(flag, REFUSED, why, takes_value)


POOLING = ("serve a pooling model with --runner pooling and --pooling-task embed (embeddings) or score (a "
           "reranker or classifier)")
DP_REMOTE = "Ray places the workers across nodes: join a cluster with --ray-address"

FLAGS: tuple[VllmFlag, ...] = (
    # The model and how it loads
    _n("--trust-remote-code", "Qwen3 models run fusedserve's own code; nothing from the hub runs", False),
    _n("--code-revision", "no remote code runs"),
    _n("--tokenizer-mode", "the model directory's tokenizer.json is read with tokenizers",
       values=("auto", "hf", "slow"),
       why_not="the mistral tokenizer is not read; Qwen3's tokenizer.json is"),
    _r("--tokenizer", "the tokenizer is read from the model directory (tokenizer.json beside the weights)"),
    _n("--tokenizer-revision", "the tokenizer comes from the model's --revision"),
    _n("--config-format", "config.json is read as Hugging Face writes it", values=("auto", "hf"),
       why_not="only Hugging Face's config.json is read"),
    _n("--load-format", "safetensors or GGUF, told apart by the files",
       values=("auto", "safetensors", "gguf"),
       why_not="weights load from safetensors or GGUF files only"),
    _n("--model-impl", "one model implementation, fusedserve's", values=("auto", "vllm"),
       why_not="the transformers implementation is not a backend here"),
    _n("--use-tqdm-on-load", "workers log their loading progress", False),
    _n("--no-use-tqdm-on-load", "workers log their loading progress", False),
    _n("--ignore-patterns", "only config, tokenizer and weight files are read"),
    _n("--max-parallel-loading-workers", "each worker reads only its own shard of the weights"),
    _n("--disable-sliding-window", "Qwen3 dense and MoE models have no sliding window", False),
    _n("--disable-cascade-attn", "attention is paged per sequence; no cascade kernel to disable", False),
    _n("--allowed-local-media-path", "text models: no media is read"),
    _n("--limit-mm-per-prompt", "text models: no media inputs"),
    _n("--mm-processor-kwargs", "text models: no media processor"),
    _n("--disable-mm-preprocessor-cache", "text models: no media processor", False),
    _r("--hf-config-path", "config.json is read from the model directory"),
    _r("--hf-overrides", "the checkpoint's config.json is used as written"),
    _r("--hf-token", "set HF_TOKEN in the environment: the hub's client reads it"),
    _r("--rope-scaling", "RoPE scaling (YaRN) is read from config.json; edit it there"),
    _r("--rope-theta", "rope_theta is read from config.json; edit it there"),
    _r("--skip-tokenizer-init", "the server tokenizes and detokenizes; send token ids in 'prompt' instead",
       False),
    _r("--enable-prompt-embeds", "prompts are text or token ids", False),
    _r("--override-generation-config", "give --generation-config a directory holding the "
                                       "generation_config.json "
       "to use"),
    _r("--model-loader-extra-config", "the loader has no extra settings"),
    _r("--enable-sleep-mode", "workers do not release their memory while serving", False),
    _r("--logprobs-mode", "logprobs are always of the processed distribution the sample is drawn from"),
    _n("--task", "vLLM's older spelling: --runner and --pooling-task say it", values=("auto", "generate"),
       why_not=POOLING),
    # Parallelism and placement
    _n("--distributed-executor-backend", "workers are Ray actors, always", values=("ray", "mp", "uni")),
    _n("--pipeline-parallel-size", "no pipeline parallelism: -tp within a node, --workers across nodes",
       values=("1",), why_not="pipeline parallelism is not built: use -tp within a node and --workers "
       "(data parallel) across nodes"),
    _n("-pp", "no pipeline parallelism: -tp within a node, --workers across nodes", values=("1",),
       why_not="pipeline parallelism is not built: use -tp and --workers"),
    _n("--disable-custom-all-reduce", "tensor-parallel sums use torch.distributed's (NCCL/HCCL), or shared "
       "memory on the CPU", False),
    _n("--ray-workers-use-nsight", "profile workers with Ray's own runtime_env instead", False),
    _r("--data-parallel-size-local", DP_REMOTE),
    _r("--data-parallel-address", DP_REMOTE),
    _r("--data-parallel-rpc-port", DP_REMOTE),
    _r("--data-parallel-start-rank", DP_REMOTE),
    _r("--headless", DP_REMOTE, False),
    _r("--enable-eplb", "expert load balancing is not built; --enable-expert-parallel places experts whole",
       False),
    _r("--worker-cls", "workers are fusedserve's Ray actors"),
    # The KV cache and the scheduler
    _n("--swap-space", "a preempted sequence is recomputed from its cached prefix, never swapped"),
    _n("--calculate-kv-scales", "int8 KV (--kv-cache-dtype int8) has a scale per token and head, computed as "
       "written", False),
    _n("--prefix-caching-hash-algo", "blocks are named by a content hash of their tokens and prefix"),
    _n("--max-seq-len-to-capture", "decode graphs are captured per batch bucket, whatever the length"),
    _n("--cuda-graph-sizes", "decode graphs are captured per power-of-two batch bucket"),
    _n("--enable-chunked-prefill", "always on: prompts are split into chunks within --max-num-batched-tokens",
       False),
    _n("--no-enable-chunked-prefill", "chunked prefill is always on", False),
    _n("--max-num-partial-prefills", "one prompt chunk per sequence and launch; as many sequences as fit"),
    _n("--long-prefill-token-threshold", "prompt chunks fill what the decode rows leave of the budget"),
    _n("--num-lookahead-slots", "speculative rows are sized by --speculative-config"),
    _n("--num-scheduler-steps", "one launch per step; two in flight with --async-scheduling"),
    _n("--scheduling-policy", "first come, first served", values=("fcfs",),
       why_not="priority scheduling is not built: requests are served first come, first served"),
    _r("--scheduler-cls", "the scheduler is fusedserve's"),
    _r("--cpu-offload-gb", "weights stay in device memory"),
    _r("--kv-cache-dtype-fp8", "use --kv-cache-dtype int8"),
    # Observability and compilation
    _n("--disable-log-stats", "no periodic stats log: read /metrics or `fusedserve stats`", False),
    _n("--show-hidden-metrics-for-version", "every metric is exported"),
    _r("--otlp-traces-endpoint", "OpenTelemetry tracing is not built: /metrics has the request timings"),
    _r("--collect-detailed-traces", "OpenTelemetry tracing is not built"),
    _n("--compilation-config", "the native kernels are compiled ahead for this CPU; decode graphs per "
                               "--graphs"),
    _n("-O", "the native kernels are compiled ahead for this CPU; decode graphs per --graphs"),
    _r("--kv-transfer-config", "disaggregated prefill is not built"),
    _r("--kv-events-config", "KV cache events are not published"),
    _r("--additional-config", "no platform plugins"),
    _n("--guided-decoding-backend", "llguidance compiles every grammar"),
    _n("--structured-outputs-config", "llguidance compiles every grammar"),
    # LoRA
    # LoRA (--enable-lora, --lora-modules, --max-loras, --max-lora-rank, --max-cpu-loras are fusedserve's own)
    _n("--fully-sharded-loras", "each tensor-parallel rank holds its share of every adapter already", False),
    _n("--lora-dtype", "adapters run in the model's dtype", values=("auto",),
       why_not="adapters run in the model's dtype (auto)"),
    # The HTTP front end
    _n("--disable-uvicorn-access-log", "access lines are off unless --uvicorn-log-level info", False),
    _n("--disable-frontend-multiprocessing", "the HTTP API runs on a thread of the serve process", False),
    _n("--api-server-count", "one HTTP server: the coordinator's loop, not HTTP, bounds throughput"),
    _n("--chat-template-content-format", "message content is taken as a string or a list of text parts",
       values=("auto", "string", "openai")),
    _n("--enable-prompt-tokens-details", "usage always has prompt_tokens_details.cached_tokens", False),
    _n("--enable-server-load-tracking", "/load always answers", False),
    _n("--enable-request-id-headers", "requests may name their id (request_id); responses carry it", False),
    _n("--disable-fastapi-docs", "the HTTP API serves no documentation pages", False),
    _n("--max-log-len", "request logs name ids, clients and settings, not prompts"),
    _n("--log-error-stack", "errors are logged with their stacks", False),
    _n("--tokenizer-pool-size", "tokenizing runs on the gateway's threads"),
    _n("--response-role", "assistant", values=("assistant",), why_not="responses are the assistant's"),
    _r("--enable-force-include-usage", "ask stream_options.include_usage per request"),
    _r("--tool-parser-plugin", "tool parsers are built in (hermes)"),
    _r("--uds", "the HTTP API listens on TCP (--host, --port)"),
    _r("--root-path", "no path prefix: put a proxy in front"),
    _r("--middleware", "no ASGI middleware is loaded from outside"),
    _r("--ssl-ca-certs", "client certificates are not checked: use --api-key"),
    _r("--ssl-cert-reqs", "client certificates are not checked: use --api-key"),
    _r("--log-config-file", "set FUSEDSERVE_LOG to the log level"),
)
BY_FLAG = {f.flag: f for f in FLAGS}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Accept every flag of the table (its handling runs after parsing: ``notices``)."""
    group = parser.add_argument_group("vLLM flags accepted for compatibility (a notice says what happens "
                                      "instead, or why one is refused)")
    for f in FLAGS:
        if f.takes_value:
            group.add_argument(f.flag, dest=f.dest, default=None, metavar="VALUE", help=argparse.SUPPRESS)
        else:
            group.add_argument(f.flag, dest=f.dest, action="store_true", default=False,
                               help=argparse.SUPPRESS)


def notices(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(notices, refusals) for the table's flags the command line gave."""
    notes, refusals = [], []
    for f in FLAGS:
        value = getattr(args, f.dest, None)
        if value is None or value is False:
            continue
        shown = f.flag if value is True else f"{f.flag} {value}"
        if f.status == REFUSED:
            refusals.append(f"{shown}: not supported: {f.why}")
        elif f.values is not None and value is not True and str(value) not in f.values:
            refusals.append(f"{shown}: not supported: {f.why_not or f.why}")
        else:
            notes.append(f"{shown}: accepted, no effect: {f.why}")
    return notes, refusals


def table(honoured: list[tuple[str, str]]) -> str:
    """The README's table: the honoured flags (flag, what it sets), then this module's."""
    lines = ["| vLLM flag | here | what fusedserve does |", "|---|---|---|"]
    for flag, what in honoured:
        lines.append(f"| `{flag}` | honoured | {what} |")
    for f in sorted(FLAGS, key=lambda f: (f.status, f.flag)):
        why = f.why
        if f.status == NOOP and f.values is not None:
            why = f"{why}; a value other than {', '.join(f.values)} is refused: {f.why_not or f.why}"
        lines.append(f"| `{f.flag}` | {f.status} | {why} |")
    return "\n".join(lines)

