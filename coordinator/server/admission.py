"""The server's own caps on a parsed ``generate`` (per client, in all, characters, max_tokens),
before the ``InputProcessor`` turns it into a ``Sequence``.

Everything here runs before a request enters any queue, so a refusal costs the
server nothing and names the limit that was hit.
"""

from __future__ import annotations

import random

from fusedserve.coordinator.engine.input_processor import InputProcessor
from fusedserve.coordinator.engine.lora_registry import LoraRegistry, parse_module
from fusedserve.coordinator.engine.request_limits import RequestLimits
from fusedserve.coordinator.engine.sequence import Sequence
from fusedserve.coordinator.errors import RequestError
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.server.config import Limits
from fusedserve.coordinator.server.protocol import GenerateRequest
from fusedserve.coordinator.server.request_table import RequestTable
from fusedserve.coordinator.structured.grammar_compiler import GrammarLimits
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.shared_memory.engine_config import EngineConfig


class Admission:
    def __init__(self, limits: Limits, engine: EngineConfig, config: Qwen3Config,
                 tokenizer: TextTokenizer | None, grammar_limits: GrammarLimits | None = None,
                 seed: int | None = None):
        """``seed``: the server's base seed, which unseeded requests draw theirs from (in arrival
        order, on the loop thread: the same requests in the same order repeat per run)."""
        self.limits = limits
        self.seeds = random.Random(seed) if seed is not None else None
        max_model_len = engine.max_model_len
        self.max_tokens = min(limits.max_tokens or max_model_len, max_model_len)
        # Every worker has the same shape: one check answers "can this be served?".
        self.input = InputProcessor.for_model(config, tokenizer, RequestLimits.for_worker(
            engine, config.vocab_size, limits.max_prompt_tokens), grammar_limits, pooling=engine.pooling)
        # The LoRA adapters requests may name: --lora-modules now, load_lora frames later.
        self.loras = LoraRegistry(config, engine.lora, (engine.model.model,))
        for spec in engine.lora.lora_modules:
            self.loras.add(*parse_module(spec))

    def check_limits(self, identity: bytes, req: GenerateRequest, requests: RequestTable) -> None:
        lim = self.limits
        if requests.find(identity, req.id) is not None:
            raise RequestError("duplicate_id", f"request id {req.id!r} is already in flight", req.id)
        if requests.in_flight(identity, req.client) >= lim.max_requests_per_client:
            who = "this connection" if req.client is None else "this client"
            raise RequestError("too_many_requests",
                               f"{who} has {lim.max_requests_per_client} requests in flight "
                               "(max_requests_per_client); wait for one to finish")
        if len(requests) >= lim.max_queued_requests:
            raise RequestError("server_busy", f"{len(requests)} requests in flight; retry later")
        if req.prompt is not None and len(req.prompt) > lim.max_prompt_chars:
            raise RequestError("prompt_too_long", f"prompt has {len(req.prompt)} characters; "
                               f"the limit is {lim.max_prompt_chars}")
        asked = max(req.params.top_logprobs, req.params.prompt_logprobs or 0)
        if asked > lim.max_logprobs:
            raise RequestError("bad_param", f"{asked} logprobs asked; this server allows {lim.max_logprobs} "
                               "(--max-logprobs)")
        if self.input.pooling and req.stream:
            raise RequestError("bad_param", "this server runs a pooling model: its result comes whole in the "
                               "done frame (send stream false)")
        if req.params.max_tokens > self.max_tokens:
            raise RequestError("max_tokens_too_large",
                               f"max_tokens is {req.params.max_tokens}; this server allows {self.max_tokens}")

    def sequence(self, seq_id: str, arrival: int, req: GenerateRequest) -> Sequence:
        """The request as a sequence, or RequestError (with the client's id) naming what it exceeds.
        Its constraint, if any, is not compiled here: the server's ``CompileQueue`` does that."""
        if self.seeds is not None and not req.seeded:
            req.params.seed = self.seeds.getrandbits(63)
        try:
            lora = None if req.lora is None else self.loras.get(req.lora)
            prompt = req.prompt if req.prompt is not None else req.prompt_ids
            seq = self.input.process(seq_id, arrival, prompt, req.params, compile_grammar=False)
            seq.lora = lora
        except RequestError as exc:
            exc.request_id = req.id
            raise
        seq.session = req.session
        return seq
