"""Offline ``generate``: the scheduler and one in-process model runner.

This is the reference the server is checked against: the same scheduler, the same
launch contract and arena, with no Ray and no sockets in between.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.batch_io import read_result, write_batch
from coordinator.scheduler import Scheduler, Sequence
from kernels.default_model import resolve_model
from kernels.kv_cache import BlockManager
from kernels.model import Qwen3Model
from kernels.sampling import SamplingParams
from kernels.tokenizer import TextTokenizer
from shared_memory.arena import HostArena
from worker.model_runner import ModelRunner, RunnerConfig, slot_tables

log = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] = field(default_factory=list)
    num_preemptions: int = 0


def load_model(model: str | Path, dtype: str | None = None, device: str = "cpu",
               max_model_len: int | None = None) -> tuple[Qwen3Model, TextTokenizer | None]:
    model_dir = resolve_model(str(model))
    return (Qwen3Model.from_pretrained(model_dir, dtype, device, max_model_len),
            TextTokenizer.from_dir(model_dir))


class LLMEngine:
    def __init__(self, model: str | Path | Qwen3Model = "default", *, dtype: str | None = None,
                 max_model_len: int | None = None, runner: RunnerConfig | None = None,
                 tokenizer: TextTokenizer | None = None):
        if isinstance(model, Qwen3Model):
            self.model, self.tokenizer = model, tokenizer
        else:
            self.model, tok = load_model(model, dtype, max_model_len=max_model_len)
            self.tokenizer = tokenizer or tok
        self.rc = runner or RunnerConfig()
        self.arena = HostArena.create(slot_tables(self.model), self.rc.max_dims(self.model),
                                      tag="engine")
        self.runner = ModelRunner(self.model, self.rc, self.arena)
        self._counter = 0

    @property
    def runtime(self):
        return self.runner.runtime

    def new_scheduler(self) -> Scheduler:
        c = self.model.config
        return Scheduler(
            BlockManager(self.rc.num_blocks, self.rc.block_size),
            vocab_size=c.vocab_size,
            max_model_len=self.model.max_model_len,
            max_batch=self.rc.max_batch,
            top_k_candidates=self.rc.top_k,
            eos_token_ids=c.eos_token_ids,
            max_prefill_tokens=self.rc.max_prefill_tokens,
            detokenize=self.tokenizer.decode if self.tokenizer else None,
        )

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: give prompts as token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[GenerationOutput]:
        """Generate for every prompt with continuous batching; outputs in prompt order."""
        if not isinstance(params, list):
            params = [copy.deepcopy(params or SamplingParams()) for _ in prompts]
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        sched = self.new_scheduler()
        seqs: list[Sequence] = []
        for prompt, p in zip(prompts, params):
            self._counter += 1
            seqs.append(sched.add(f"req-{self._counter}", self.encode(prompt), p))
        while sched.has_work():
            self.step(sched)
        return [self._output(s) for s in seqs]

    def step(self, sched: Scheduler) -> list:
        batch = sched.schedule()
        if batch is None:
            raise RuntimeError("scheduler has work but could not schedule a launch")
        c = self.model.config
        desc = write_batch(self.arena, batch, sched.steps, self.rc.top_k, c.vocab_size,
                           c.hidden_size)
        self.runner.execute(desc)
        return sched.process(batch, read_result(self.arena, desc))

    def _output(self, s: Sequence) -> GenerationOutput:
        text = s.text
        if self.tokenizer is not None and not s.params.stop:
            text = self.tokenizer.decode(s.output_ids)
        return GenerationOutput(s.seq_id, s.prompt_ids, list(s.output_ids), text,
                                s.finish_reason or "abort", list(s.logprobs), s.num_preemptions)

    def close(self) -> None:
        self.arena.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
