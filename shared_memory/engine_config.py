"""What an engine is built with, in named parts: the start-time half of the coordinator/worker
contract.

The coordinator resolves it once (the model's path, ``max_model_len``, dtype; quantization
checked) and hands the same frozen object to every worker actor, so both sides size the arena
banks and the scratch pool from one ``max_dims``. Flat field names are unique across the parts:
``EngineConfig.build(max_batch=8, dtype="float32")`` is how the CLI, the server config and the
offline engine spell one (vLLM's ``EngineArgs`` -> ``VllmConfig``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fusedserve.shared_memory.setting import parse_size, parse_workers, setting
from fusedserve.shared_memory.slots import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, bitmask_words, table_width

MAX_SPECULATIVE_TOKENS = 16  # proposals per row and launch


@dataclass(frozen=True)
class ModelConfig:
    model: str = setting(
        "default",
        "a Qwen3 directory, a Hugging Face id (ORG/NAME: the hub's cache first, then a download where the "
        "network allows; HF_HUB_OFFLINE is honoured), or 'default' (the embedded model); also the first "
        "argument of serve, as vLLM takes it")
    revision: str | None = setting(None, "of a Hugging Face id: a branch, tag or commit")
    download_dir: str | None = setting(None, "the Hugging Face cache to use (default: the hub's own)")
    dtype: str | None = setting(
        None,
        "float32, bfloat16, float16, or auto (the fastest here for the checkpoint); default: the "
        "checkpoint's")
    quantization: str | None = setting(
        None,
        "quantized by each worker at load: int8 per channel, int4 in groups of 32 (lm_head int8); on the "
        "CPU both multiply with int8 activations (per token); int8-weight-only keeps the activations "
        "16-bit. fp8 (vLLM's name): an FP8 checkpoint runs its own path, another is quantized to int8 (a "
        "notice says so)",
        aliases=("-q",))
    max_model_len: int | None = setting(
        None,
        "the longest sequence, as 4096, 32k or 1M (k: 1000, K: 1024); default: the model's own context, "
        "YaRN included, or what the KV cache holds if less")
    allow_long_max_model_len: bool = setting(
        False,
        "let --max-model-len exceed the model's own context (positions past its training may give wrong "
        "outputs; vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 sets it too); without it a longer one is cut to "
        "the context")
    runner: str = setting(
        "auto",
        "generate: requests sample tokens; pooling: each request's prompt runs once and its last token's "
        "hidden state (embed) or score comes back, nothing is sampled (embedding and reranker models); "
        "auto: pooling for a sentence-transformers checkpoint (modules.json), a "
        "...ForSequenceClassification or a directory named as a reranker, else generate",
        choices=("auto", "generate", "pooling"))
    pooling_task: str = setting(
        "auto",
        "embed (last-token pooling; /v1/embeddings) or score (a reranker: the yes/no logit difference of a "
        "causal LM, as Qwen3-Reranker's card scores, or a sequence-classification head; /score, /rerank; "
        "classify is the same); naming one implies --runner pooling; auto: score for a classification or "
        "reranker checkpoint, else embed",
        choices=("auto", "embed", "score", "classify"), aliases=("--convert",))
    # Set by resolution, not flags: the floats one pooled row hands back (hidden size for embed, the
    # labels for score; 0 when generating), and a causal-LM reranker's (no, yes) token ids.
    pooled_width: int = setting(0, cli=False)
    score_tokens: tuple[int, ...] = setting((), cli=False)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = setting(16, "tokens per KV block")
    num_blocks: int | None = setting(
        None,
        "KV blocks per worker (one spare more is allocated for padding rows); default: sized from memory "
        "(--kv-cache-memory)",
        aliases=("--num-gpu-blocks-override",))
    kv_cache_memory: int | None = setting(
        None,
        "KV cache per worker, in bytes or with a suffix (8GiB, 512MiB); default on the CPU: 40% of this "
        "host's available memory over its workers",
        aliases=("--kv-cache-memory-bytes",), parse=parse_size)
    gpu_memory_utilization: float = setting(
        0.9, "on a GPU: the share of its memory a worker uses, weights and KV cache")
    enable_prefix_caching: bool = setting(
        True,
        "keep full KV blocks after their sequence ends, content-hashed, and reuse them as prompt prefixes "
        "(coordinator/engine/block_manager.py)",
        negations=("--no-prefix-caching",))
    kv_cache_dtype: str = setting(
        "auto",
        "auto: K/V in the model's dtype; int8: int8 values and a float32 scale per token and head (native "
        "CPU kernels, kernels/kv_cache.py): half the bytes a decode step reads, twice the tokens in the "
        "same memory",
        choices=("auto", "int8"))
    # Set by resolution, not a flag: the model keeps a recurrent state per running sequence (a
    # hybrid's linear-attention layers), so each launch carries its rows' state slots.
    recurrent_state: bool = setting(False, cli=False)
    # With prefix caching: the worker's pool of state snapshots at block boundaries (one per
    # request it may run), also set by resolution.
    state_snapshots: int = setting(0, cli=False)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = setting(
        128,
        "sequences a worker runs at once (rows of a launch)",
        flag="--max-num-seqs", aliases=("--max-batch",))
    max_num_batched_tokens: int = setting(
        2048,
        "the token budget of one launch: every running stream's decode row first, then prompt chunks in the "
        "rest, so a long prompt is split across launches and never stalls the streams; more than "
        "--max-num-seqs. It sizes the arena's token slots")
    async_scheduling: bool = setting(
        True,
        "two launches in flight per worker: the next is scheduled and sent while one runs, fed the ids it "
        "leaves on the device (one arena bank per launch); --no-async-scheduling: one at a time")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = setting("auto", "where workers run", choices=("auto", "cpu", "cuda", "npu"))
    graphs: str = setting(
        "auto",
        "auto: capture decode graphs per batch bucket where the device has graphs (CUDA, NPU); padded: the "
        "same bucketed, padded decode run eagerly; off: exact shapes (--enforce-eager means off)",
        choices=("auto", "padded", "off"))
    sampler_candidates: int = setting(
        64,
        "candidates the sampler sorts per row: a stochastic row whose top_k is 1..this is sampled among "
        "them, others over the whole vocabulary")
    threads_per_worker: int = setting(
        0,
        "torch threads per rank, each pinned to cores of its own (0: the cores this process may use, "
        "affinity and cgroup quota, divided among the node's ranks)")
    cpus_per_worker: int = setting(1, "Ray CPUs each worker (each rank of a group) reserves")
    cpu_gemm: str = setting(
        "auto",
        "auto: oneDNN's GEMM (AMX where the CPU has it) at the launch sizes where it measured faster at "
        "load, and SDPA for the prompt chunk sizes where it did, the native kernels elsewhere; native: the "
        "native kernels always (16-bit outputs bit-equal whatever the batch)",
        choices=("auto", "native"))


@dataclass(frozen=True)
class ParallelConfig:
    workers: int = setting(
        1,
        "data-parallel workers, or 'auto' for one per device in the cluster",
        aliases=("--data-parallel-size", "-dp"), parse=parse_workers)
    tensor_parallel_size: int = setting(
        1,
        "devices per worker, one Ray actor each, placed on one node; --workers groups of them (data "
        "parallel on top)",
        aliases=("-tp",))
    enable_expert_parallel: bool = setting(
        False,
        "with --tensor-parallel-size: place a MoE model's experts whole across the group instead of "
        "splitting every expert")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (coordinator/engine/speculative/): a decode row carries its newest token
    and up to ``num_speculative_tokens`` proposed ones, verified in the same launch. Set from
    ``--speculative-config`` (JSON, vLLM's names), not a flag per field."""

    # off | ngram (prompt lookup over the request's own tokens) | draft (a smaller Qwen3 sharing the
    # vocabulary, run by each worker inside the launch)
    speculative_method: str = setting("off", cli=False)
    speculative_model: str | None = setting(None, cli=False)  # draft: its directory, HF id or embedded name
    num_speculative_tokens: int = setting(4, cli=False)  # k: proposals per row and launch
    prompt_lookup_max: int = setting(4, cli=False)  # ngram: the longest suffix n-gram looked up
    prompt_lookup_min: int = setting(2, cli=False)  # ngram: the shortest
    # The policy: rows speculate only while the worker holds at most this many requests, running or
    # waiting (at larger batches a step is no longer bound by reading the weights; rows run ahead).
    speculative_max_batch: int = setting(4, cli=False)


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA serving: requests name an adapter (``model`` over HTTP, ``lora`` over ZeroMQ) and
    each launch applies every row's own (kernels/lora.py)."""

    enable_lora: bool = setting(False, "serve LoRA adapters on the base model (--lora-modules, and loaded "
                                "at run time through /v1/load_lora_adapter)")
    lora_modules: tuple[str, ...] = setting(
        (), "adapters served from the start: NAME=PATH (a PEFT directory), or JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; one or more', metavar="NAME=PATH")
    max_loras: int = setting(1, "adapters resident in each worker's slots at once: a launch mixes rows of "
                             "at most this many; another is loaded into the least recently used free slot")
    max_lora_rank: int = setting(16, "the highest adapter rank served; each slot is sized for it")
    max_cpu_loras: int | None = setting(None, "adapters each worker keeps read in host memory (default: "
                                        "--max-loras)")


PARTS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "device": DeviceConfig,
         "parallel": ParallelConfig, "speculative": SpeculativeConfig, "lora": LoraConfig}


def _owner(name: str) -> str:
    for part, cls in PARTS.items():
        if name in {f.name for f in dataclasses.fields(cls)}:
            return part
    raise TypeError(f"unknown engine setting {name!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    @classmethod
    def fields(cls) -> set[str]:
        """Every flat setting name."""
        return {f.name for part in PARTS.values() for f in dataclasses.fields(part)}

    @classmethod
    def build(cls, **settings: object) -> EngineConfig:
        """From flat setting names (``max_batch=8, dtype="float32"``); TypeError for unknown ones."""
        return cls().replace(**settings)

    def replace(self, **settings: object) -> EngineConfig:
        """A copy with flat settings changed."""
        by_part: dict[str, dict] = {}
        for name, value in settings.items():
            by_part.setdefault(_owner(name), {})[name] = value
        parts = {p: dataclasses.replace(getattr(self, p), **kw) for p, kw in by_part.items()}
        return dataclasses.replace(self, **parts)

    def check(self) -> None:
        """Refuse, at start, settings no launch could honour."""
        s, c, d, p = self.scheduler, self.cache, self.device, self.parallel
        for name, value in (("max_batch", s.max_batch), ("block_size", c.block_size),
                            ("num_blocks", 1 if c.num_blocks is None else c.num_blocks),
                            ("sampler_candidates", d.sampler_candidates),
                            ("tensor_parallel_size", p.tensor_parallel_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        n = s.max_num_batched_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n <= s.max_batch:
            raise ValueError(f"max_num_batched_tokens must be more than max_batch ({s.max_batch}): "
                             f"room for every decode row and a prompt token; got {n}")
        if d.graphs not in ("auto", "padded", "off"):
            raise ValueError(f"graphs must be auto, padded or off, got {d.graphs!r}")
        if p.enable_expert_parallel and p.tensor_parallel_size == 1:
            raise ValueError("enable_expert_parallel places experts across a tensor-parallel group: "
                             "it needs tensor_parallel_size > 1")
        m = self.model.max_model_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {m!r}")
        if c.kv_cache_memory is not None and c.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {c.kv_cache_memory!r}")
        if c.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto or int8, got {c.kv_cache_dtype!r}")
        if not 0 < c.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")
        if d.threads_per_worker < 0:
            raise ValueError(f"threads_per_worker must be >= 0, got {d.threads_per_worker}")
        self._check_speculative()
        self._check_pooling()
        self._check_lora()

    def _check_pooling(self) -> None:
        m = self.model
        if m.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling, got {m.runner!r}")
        if m.pooling_task not in ("auto", "embed", "score", "classify"):
            raise ValueError(f"pooling_task must be auto, embed, score or classify, got {m.pooling_task!r}")

    def _check_lora(self) -> None:
        lo = self.lora
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(lo, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if lo.lora_modules and not lo.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        if lo.enable_lora and self.pooling:
            raise ValueError("LoRA adapters are served on a generating model, not a pooling one")

    def _check_speculative(self) -> None:
        sp = self.speculative
        if sp.speculative_method not in ("off", "ngram", "draft"):
            raise ValueError(f"speculative_method must be off, ngram or draft, got {sp.speculative_method!r}")
        if (sp.speculative_method == "draft") != (sp.speculative_model is not None):
            raise ValueError("a draft model (speculative_model) goes with speculative_method draft, and only "
                             "with it")
        if sp.speculative_method == "draft" and self.parallel.tensor_parallel_size > 1:
            raise ValueError("a draft model runs on one device: not with tensor_parallel_size > 1")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "speculative_max_batch"):
            value = getattr(sp, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if sp.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {sp.num_speculative_tokens}")
        if sp.prompt_lookup_min > sp.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({sp.prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({sp.prompt_lookup_max})")
        if self.speculating and self.scheduler.max_batch < 2:
            raise ValueError("speculative decoding needs max_batch >= 2: a row's proposals ride as rows")

    @property
    def pooling(self) -> bool:
        """A pooling runner: prompts in, pooled rows out (resolved; ``auto`` is not yet)."""
        return self.model.runner == "pooling"

    @property
    def speculating(self) -> bool:
        return self.speculative.speculative_method != "off"

    @property
    def rows_per_request(self) -> int:
        """K1: the most rows one request's decode takes in a launch (its token and its proposals)."""
        return 1 + self.speculative.num_speculative_tokens if self.speculating else 1

    @property
    def banks(self) -> int:
        """Arena banks per worker: one per launch that may be in flight."""
        return 2 if self.scheduler.async_scheduling else 1

    @property
    def num_blocks(self) -> int:
        """The resolved KV blocks per worker."""
        if self.cache.num_blocks is None:
            raise ValueError("num_blocks is not resolved yet")
        return self.cache.num_blocks

    @property
    def pad_slot(self) -> int:
        """The KV slot past every allocatable block: padding and warm-up rows write there."""
        return self.num_blocks * self.cache.block_size

    @property
    def max_model_len(self) -> int:
        """The resolved context length (the coordinator resolves it before anything is sized)."""
        if self.model.max_model_len is None:
            raise ValueError("max_model_len is not resolved yet")
        return self.model.max_model_len

    def max_dims(self, vocab: int) -> dict[str, int]:
        """The largest dims any launch may use; arena and pool are sized from these."""
        b, t = self.scheduler.max_batch, self.scheduler.max_num_batched_tokens
        return {
            "B": b,
            "B1": b + 1,
            "T": t,
            "W": table_width(self.max_model_len, self.cache.block_size),
            "NL": b,  # rows asking for logprobs
            "N": MAX_TOP_LOGPROBS,  # top logprobs per row
            "TL": t,  # prompt tokens asking for their logprob
            "NP": MAX_TOP_LOGPROBS,
            "V": vocab,
            "G": b,  # rows of token bitmask (structured outputs)
            "VW": bitmask_words(vocab),
            "PR": b,  # penalty slots reset
            "PT": t,  # chunk tokens counted for penalties
            "PB": b,  # penalized rows
            "LB": b * MAX_LOGIT_BIAS,  # logit-bias entries
            "S": b,  # speculating requests
            "K1": self.rows_per_request,  # rows of one speculating request
            "BD": b,  # rows a draft model's first pass reads
            "RS": b,  # rows with a recurrent-state slot (a hybrid model's: every row)
            "SR": b,  # state slots a launch starts from zero
            "SRS": b,  # (snapshot, state slot) restored before the launch
            "SSV": b,  # (state slot, snapshot) saved after it
            "PL": b if self.pooling else 0,  # rows pooled (a pooling runner's finished prompts)
            "H": self.model.pooled_width,  # floats per pooled row
            "LT": t if self.lora.enable_lora else 0,  # tokens with an adapter slot (LoRA)
        }
