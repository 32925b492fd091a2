"""Offline ``generate``: an ``EngineCore`` over a model runner in this process.

This is the reference the server is checked against: the same engine core, the same
scheduler, launch contract and arena, with no Ray and no sockets in between.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fusedserve.coordinator.engine import kv_sizing, pooling_output
from fusedserve.coordinator.engine.config_resolution import dtype_name, hybrid_settings, resolve_config
from fusedserve.coordinator.engine.engine_core import EngineCore
from fusedserve.coordinator.engine.executor import InProcessExecutor
from fusedserve.coordinator.engine.input_processor import InputProcessor
from fusedserve.coordinator.engine.lora_registry import LoraRegistry, parse_module
from fusedserve.coordinator.engine.output_processor import OutputProcessor
from fusedserve.coordinator.engine.pooling_resolution import resolve_pooling
from fusedserve.coordinator.engine.request_limits import RequestLimits
from fusedserve.coordinator.engine.sequence import Sequence
from fusedserve.coordinator.model_files import reranker_prompt
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.engine_config import EngineConfig
from fusedserve.shared_memory.slots import step_table
from fusedserve.worker.device import probe, torch_device
from fusedserve.worker.launch_runtime import LaunchRuntime
from fusedserve.worker.load_progress import weight_progress
from fusedserve.worker.model.qwen3 import Qwen3Model, prepare_kernels
from fusedserve.worker.model_runner import ModelRunner


@dataclass
class GenerationOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # asked: None first
    num_preemptions: int = 0
    error: str = ""  # finish_reason "error": what failed


@dataclass
class PoolingOutput:
    """``embed()``'s or ``score()``'s result for one prompt: ``value`` is the embedding (float32) or
    the score; None with ``error`` set where the request failed."""

    request_id: str
    prompt_ids: list[int]
    value: np.ndarray | float | None
    error: str = ""


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against each text_2 (1 to N), or equal lists pairwise (N to N)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not seconds or not firsts:
        raise ValueError("score() needs at least one text on each side")
    if len(firsts) == 1:
        return [(firsts[0], d) for d in seconds]
    if len(firsts) != len(seconds):
        raise ValueError(f"score(): {len(firsts)} first texts and {len(seconds)} second ones (give one "
                         "first text, or equal lists)")
    return list(zip(firsts, seconds))


def load_model(model: str | Path, dtype: str | None = None, device: str = "cpu",
               max_model_len: int | None = None,
               quantization: str | None = None) -> tuple[Qwen3Model, TextTokenizer | None]:
    """A model and its tokenizer as ``LLMEngine`` loads them (tests share one model across engines)."""
    cfg = EngineConfig.build(model=str(model), dtype=dtype, max_model_len=max_model_len,
                             quantization=quantization)
    resolved = resolve_config(cfg, torch.device(device).type).config
    return _load(resolved, torch.device(device)), TextTokenizer.from_dir(resolved.model.model)


def _load(cfg: EngineConfig, device: torch.device) -> Qwen3Model:
    m = cfg.model
    prepare_kernels(device)
    progress, bar = weight_progress("loading weights", in_ray_worker=False)
    try:
        return Qwen3Model.from_pretrained(m.model, m.dtype, device, m.max_model_len, m.quantization,
                                          progress=progress, gemm=cfg.device.cpu_gemm)
    finally:
        bar.close()


class LLMEngine:
    """``LLMEngine(model, **settings)``: ``settings`` are ``EngineConfig`` field names
    (``dtype="float32", max_batch=8``), over ``config`` when given; the device defaults to the CPU.
    ``model`` may also be a loaded ``Qwen3Model`` (its dtype and context length then stand)."""

    def __init__(self, model: str | Path | Qwen3Model = "default", *, config: EngineConfig | None = None,
                 tokenizer: TextTokenizer | None = None, **settings: object):
        cfg = (config or EngineConfig.build(device="cpu")).replace(**settings)
        if isinstance(model, Qwen3Model):
            self.model, self.tokenizer = model, tokenizer
            cfg = cfg.replace(max_model_len=model.max_model_len, dtype=dtype_name(model.dtype),
                              quantization=model.quantization)
            cfg.check()
            if model.config.hybrid:  # its state slots and snapshots, as resolve_config gives them
                cfg = hybrid_settings(cfg)
            cfg = resolve_pooling(cfg, model.source, model.config)
            if cfg.cache.num_blocks is None:  # sized from memory, for this model as it is
                kv = kv_sizing.plan(model.config, model.dtype, cfg.cache, device_kind=model.device.type,
                                    max_batch=cfg.scheduler.max_batch, max_model_len=model.max_model_len,
                                    weight_bytes=0, ranks_on_node=1, tp=model.tp.size)
                cfg = cfg.replace(num_blocks=kv.num_blocks)
        else:
            device = probe(cfg.device.device)
            cfg = resolve_config(cfg.replace(model=str(model)), device.kind).config
            self.model = _load(cfg, torch_device(device.kind))
            self.tokenizer = tokenizer or TextTokenizer.from_dir(cfg.model.model)
        self.config = cfg
        c = self.model.config
        dims = cfg.max_dims(c.vocab_size)
        self.arenas = [HostArena.create(step_table(), dims, tag="engine") for _ in range(cfg.banks)]
        try:
            self.runner = ModelRunner(self.model, cfg, self.arenas)
        except BaseException:  # nothing of a failed engine stays in shared memory
            self.close()
            raise
        self.input = InputProcessor.for_model(c, self.tokenizer, RequestLimits.for_worker(cfg, c.vocab_size),
                                              pooling=cfg.pooling)
        output = OutputProcessor(c.eos_token_ids, cfg.max_model_len)
        executor = InProcessExecutor(self.runner)
        self.core = EngineCore.for_worker(cfg, c.vocab_size, output, self.arenas, executor)
        self._ids = itertools.count(1)
        self.loras = LoraRegistry(c, cfg.lora, (Path(cfg.model.model).name or "base",))
        for spec in cfg.lora.lora_modules:
            self.loras.add(*parse_module(spec))

    def add_lora(self, name: str, path: str | Path) -> None:
        """Serve the PEFT adapter in ``path`` as ``name`` (``generate(..., lora=name)``); LoraError
        naming what cannot be served."""
        self.loras.add(name, str(path))

    @property
    def runtime(self) -> LaunchRuntime:
        return self.runner.runtime

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, lora: str | None = None) -> Sequence:
        """Queue one request (``step()`` on ``core`` runs it) under the LoRA adapter named ``lora``
        (None: the base model); RequestError if it cannot be served."""
        n = next(self._ids)
        served = None if lora is None else self.loras.get(lora)
        seq = self.input.process(request_id or f"req-{n}", n, prompt, params)
        seq.lora = served
        self.core.scheduler.enqueue(seq)
        return seq

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 lora: str | list[str | None] | None = None) -> list[GenerationOutput]:
        """Generate for every prompt with continuous batching; outputs in prompt order. ``lora``:
        the adapter (``add_lora``) of every prompt, or of each."""
        if not isinstance(params, list):
            params = [copy.deepcopy(params or SamplingParams()) for _ in prompts]
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(params) != len(prompts) or len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params and {len(loras)} "
                             "adapters")
        if self.config.pooling:
            raise ValueError("this engine runs a pooling model (runner pooling): use embed() or score()")
        seqs, errors = self._run(prompts, params, loras)
        return [self._output(s, errors.get(s.seq_id, "")) for s in seqs]

    def embed(self, prompts: list[str | list[int]], dimensions: int | None = None,
              normalize: bool = True) -> list[PoolingOutput]:
        """Each prompt's embedding (a pooling runner's embed task): its last token's final hidden
        state, its first ``dimensions`` values, L2-normalised (``pooling_output.embedding``)."""
        self._need_task("embed")
        seqs, errors = self._run(prompts, [SamplingParams() for _ in prompts])
        vector = pooling_output.embedding
        return [PoolingOutput(s.seq_id, s.prompt_ids,
                              None if s.pooled is None else vector(s.pooled, dimensions, normalize),
                              errors.get(s.seq_id, "")) for s in seqs]

    def score(self, text_1: str | list[str], text_2: str | list[str],
              instruction: str | None = None) -> list[PoolingOutput]:
        """Relevance of each (text_1, text_2) pair (a pooling runner's score task), vLLM's
        ``LLM.score``: one query against many documents, or pairs of equal lists. Pairs are written
        in Qwen3-Reranker's prompt (``reranker_prompt.py``); ``value`` is the score in [0, 1]."""
        self._need_task("score")
        pairs = score_pairs(text_1, text_2)
        if self.tokenizer is None:
            raise ValueError("scoring text pairs needs the model's tokenizer")
        prompts = [reranker_prompt.pair_ids(self.tokenizer, q, d, instruction) for q, d in pairs]
        seqs, errors = self._run(prompts, [SamplingParams() for _ in prompts])
        return [PoolingOutput(s.seq_id, s.prompt_ids, None if s.pooled is None else
                              pooling_output.score(s.pooled), errors.get(s.seq_id, "")) for s in seqs]

    def _need_task(self, task: str) -> None:
        m = self.config.model
        if not self.config.pooling or m.pooling_task != task:
            what = f"the {m.pooling_task} task" if self.config.pooling else "a generating model"
            raise ValueError(f"{task}() needs a pooling model with pooling_task {task}; this engine runs "
                             f"{what}")

    def _run(self, prompts: list[str | list[int]], params: list[SamplingParams],
             loras: list[str | None] | None = None) -> tuple[list[Sequence], dict[str, str]]:
        """Queue every prompt and step until all are done; each failed request's error by id."""
        sched = self.core.scheduler
        seqs: list[Sequence] = []
        errors: dict[str, str] = {}
        try:
            for prompt, p, lora in zip(prompts, params, loras or [None] * len(prompts)):
                seqs.append(self.add_request(prompt, p, lora=lora))
            while self.core.has_work():
                for ev in self.core.step():
                    if ev.error is not None:
                        errors[ev.seq.seq_id] = f"{ev.error.code}: {ev.error}"
        except BaseException:  # an exception leaves nothing of this call queued or in flight
            for s in seqs:
                sched.abort(s.seq_id)
            self.core.drain()
            raise
        return seqs, errors

    @staticmethod
    def _output(s: Sequence, error: str) -> GenerationOutput:
        return GenerationOutput(s.seq_id, s.prompt_ids, list(s.output_ids), s.text,
                                s.finish_reason or "abort", list(s.logprobs), list(s.prompt_logprobs),
                                s.num_preemptions, error)

    def close(self) -> None:
        if getattr(self, "runner", None) is not None:
            self.runner.close()
        for arena in self.arenas:
            arena.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
