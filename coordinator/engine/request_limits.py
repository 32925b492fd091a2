"""What a worker's engine can serve, checked once, before a request enters any queue: the
same check for the server's admission and the offline engine, so a refusal costs nothing
and names the bound that was hit."""

from __future__ import annotations

from fusedserve.coordinator.errors import RequestError
from fusedserve.coordinator.sampling_params import SamplingParams, is_kind
from fusedserve.shared_memory.engine_config import EngineConfig


class RequestLimits:
    def __init__(self, vocab_size: int, max_model_len: int, num_blocks: int, block_size: int,
                 max_prompt_tokens: int | None = None):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_blocks, self.block_size = num_blocks, block_size
        # Prompt plus at least one generated token; a server may allow less.
        self.max_prompt_tokens = min(max_prompt_tokens or max_model_len - 1, max_model_len - 1)

    @classmethod
    def for_worker(cls, cfg: EngineConfig, vocab_size: int,
                   max_prompt_tokens: int | None = None) -> RequestLimits:
        """What one worker of the resolved ``cfg`` can serve."""
        c = cfg.cache
        return cls(vocab_size, cfg.max_model_len, cfg.num_blocks, c.block_size, max_prompt_tokens)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a prompt this engine cannot serve."""
        if not prompt_ids:
            raise RequestError("empty_prompt", "prompt has no tokens")
        for i, t in enumerate(prompt_ids):
            if not is_kind(t, int) or not 0 <= t < self.vocab_size:
                raise RequestError("token_out_of_range", f"prompt token {i} is {t!r}; token ids must be "
                                   f"integers in [0, {self.vocab_size})")
        for t in params.token_ids():  # stop ids, logit_bias keys, allowed_token_ids
            if not 0 <= t < self.vocab_size:
                raise RequestError("token_out_of_range", f"token id {t} named by the request's settings is "
                                   f"outside [0, {self.vocab_size})")
        n = len(prompt_ids)
        if n > self.max_prompt_tokens:
            if self.max_prompt_tokens < self.max_model_len - 1:
                why = f"this server allows {self.max_prompt_tokens} (--max-prompt-tokens)"
            else:
                why = f"max_model_len is {self.max_model_len} (prompt plus at least one generated token)"
            raise RequestError("prompt_too_long", f"prompt has {n} tokens; {why}")
        need = -(-min(n + params.max_tokens, self.max_model_len) // self.block_size)
        if need > self.num_blocks:
            raise RequestError("too_many_tokens", f"prompt ({n}) + max_tokens ({params.max_tokens}) needs "
                               f"more KV blocks than the worker has ({self.num_blocks})")
