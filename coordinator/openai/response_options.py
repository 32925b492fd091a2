"""What a request asks of its response besides the text: streaming and usage, vLLM's prompt
logprobs and token naming."""

from __future__ import annotations

from fusedserve.coordinator.openai.api_error import ApiError
from fusedserve.coordinator.openai.request_fields import get as _get
from fusedserve.shared_memory.slots import MAX_TOP_LOGPROBS


def stream_options(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict, {})
    return stream, bool(stream and _get(opts, "include_usage", bool, False))


def vllm_extras(body: dict, params: dict, stream: bool, usage: bool) -> dict:
    """vLLM's extra response options: ``prompt_logprobs``, ``return_tokens_as_token_ids`` and
    ``stream_options.continuous_usage_stats`` (with include_usage, as vLLM reads it)."""
    k = _get(body, "prompt_logprobs", int)
    if k is not None:
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}] (-1, the whole "
                           "vocabulary, is not kept)", param="prompt_logprobs", code="bad_field")
        if stream:
            raise ApiError(400, "prompt_logprobs are not available when stream is enabled (as in vLLM)",
                           param="prompt_logprobs", code="bad_field")
        params["prompt_logprobs"] = max(k, params.get("prompt_logprobs") or 0)
    opts = _get(body, "stream_options", dict, {})
    return {"prompt_logprobs": k, "token_ids_as_tokens": _get(body, "return_tokens_as_token_ids", bool),
            "continuous_usage": usage and _get(opts, "continuous_usage_stats", bool, False)}
