"""Offline ``generate``: an ``EngineCore`` over a model runner in this process.

This is the reference the server is checked against: the same engine core, the same
scheduler, launch contract and arena, with no Ray and no sockets in between.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.engine.detokenizer import Detokenizer
from coordinator.engine.engine_core import EngineCore
from coordinator.engine.executor import InProcessExecutor
from coordinator.engine.request_limits import RequestLimits
from coordinator.engine.scheduler import Scheduler
from coordinator.engine.sequence import Sequence
from coordinator.sampling_params import SamplingParams
from coordinator.structured.grammar_compiler import GrammarCompiler
from kernels.model.default_model import resolve_model
from kernels.model.qwen3 import Qwen3Model
from kernels.model.tokenizer import TextTokenizer
from shared_memory.arena import HostArena
from shared_memory.contract import RunnerConfig
from shared_memory.runtime import LaunchRuntime
from shared_memory.slots import step_table
from worker.model_runner import ModelRunner, model_dims


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


def load_model(model: str | Path, dtype: str | None = None, device: str = "cpu",
               max_model_len: int | None = None,
               quantization: str | None = None) -> tuple[Qwen3Model, TextTokenizer | None]:
    model_dir = resolve_model(str(model))
    return (Qwen3Model.from_pretrained(model_dir, dtype, device, max_model_len, quantization),
            TextTokenizer.from_dir(model_dir))


class LLMEngine:
    def __init__(self, model: str | Path | Qwen3Model = "default", *, dtype: str | None = None,
                 max_model_len: int | None = None, runner: RunnerConfig | None = None,
                 tokenizer: TextTokenizer | None = None, quantization: str | None = None,
                 device: str = "cpu"):
        if isinstance(model, Qwen3Model):
            self.model, self.tokenizer = model, tokenizer
        else:
            self.model, tok = load_model(model, dtype, device, max_model_len, quantization)
            self.tokenizer = tokenizer or tok
        self.rc = runner or RunnerConfig()
        self.rc.check()
        dims = model_dims(self.model, self.rc)
        self.arenas = [HostArena.create(step_table(), dims, tag="engine") for _ in range(self.rc.banks)]
        self.runner = ModelRunner(self.model, self.rc, self.arenas)
        c = self.model.config
        self.limits = RequestLimits.for_worker(c, self.rc, self.model.max_model_len)
        self.core = EngineCore(self.new_scheduler(), self.arenas, InProcessExecutor(self.runner),
                               self.rc.top_k, c.vocab_size, self.rc.async_scheduling)
        self._ids = itertools.count(1)
        self.grammars = GrammarCompiler.for_model(self.tokenizer, c)

    @property
    def arena(self) -> HostArena:
        """The first arena bank (the only one without async scheduling)."""
        return self.arenas[0]

    @property
    def runtime(self) -> LaunchRuntime:
        return self.runner.runtime

    def new_scheduler(self) -> Scheduler:
        return Scheduler.for_worker(self.model.config, self.rc, self.model.max_model_len)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: give prompts as token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def detokenizer(self, params: SamplingParams) -> Detokenizer | None:
        return Detokenizer(self.tokenizer, params.stop) if self.tokenizer is not None else None

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[GenerationOutput]:
        """Generate for every prompt with continuous batching; outputs in prompt order."""
        if not isinstance(params, list):
            params = [copy.deepcopy(params or SamplingParams()) for _ in prompts]
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        sched = self.core.scheduler
        seqs: list[Sequence] = []
        errors: dict[str, str] = {}
        try:
            for prompt, p in zip(prompts, params):
                ids = self.encode(prompt)
                self.limits.check(ids, p)
                seq = sched.add(f"req-{next(self._ids)}", ids, p, self.detokenizer(p))
                seqs.append(seq)
                if p.structured is not None:
                    if self.grammars is None:
                        raise ValueError("structured outputs need the model's tokenizer")
                    seq.grammar = self.grammars.state(p.structured)
            while self.core.has_work():
                for ev in self.core.step():
                    if ev.error is not None:
                        errors[ev.seq.seq_id] = f"{ev.error.code}: {ev.error}"
        except BaseException:  # an exception leaves nothing of this call queued or in flight
            for s in seqs:
                sched.abort(s.seq_id)
            self.core.drain()
            raise
        return [self._output(s, errors.get(s.seq_id, "")) for s in seqs]

    @staticmethod
    def _output(s: Sequence, error: str) -> GenerationOutput:
        return GenerationOutput(s.seq_id, s.prompt_ids, list(s.output_ids), s.text,
                                s.finish_reason or "abort", list(s.logprobs), list(s.prompt_logprobs),
                                s.num_preemptions, error)

    def close(self) -> None:
        for arena in self.arenas:
            arena.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
