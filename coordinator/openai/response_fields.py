"""The parts of an OpenAI response built from the coordinator's frames: ids, usage, logprobs."""

from __future__ import annotations

import uuid

from fusedserve.coordinator.model_files.tokenizer import TextTokenizer


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(dones: list[dict], n: int = 1, echo_only: bool = False) -> dict:
    """OpenAI's count: each prompt once (choice i is prompt i // n's), every choice's output."""
    prompt = sum(d["usage"]["prompt_tokens"] for d in dones[::n])
    completion = 0 if echo_only else sum(d["usage"]["completion_tokens"] for d in dones)
    cached = sum(d["usage"].get("cached_tokens", 0) for d in dones[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_entry(tok: TextTokenizer, token: int, lp: float) -> dict:
    return {"token": tok.token_text(token), "logprob": lp, "bytes": list(tok.token_bytes(token))}


def chat_logprobs(tok: TextTokenizer, ids: list[int], lps: list[float], tops: list | None) -> dict:
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        entry = _token_entry(tok, t, lp)
        entry["top_logprobs"] = [_token_entry(tok, a, b) for a, b in (tops[i] if tops else [])]
        content.append(entry)
    return {"content": content}


def completion_logprobs(tok: TextTokenizer, ids: list[int], lps: list[float], tops: list | None,
                        offset: int = 0) -> dict:
    tokens = [tok.token_text(t) for t in ids]
    offsets, pos = [], offset
    for t in ids:
        offsets.append(pos)
        pos += len(tok.decode([t]))
    top = [{tok.token_text(a): b for a, b in step} for step in tops] if tops else [None] * len(ids)
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}


def echo_logprobs(tok: TextTokenizer, done: dict, output: dict | None) -> dict:
    """Completions' logprobs with ``echo``: the prompt's tokens first (the first has none), then
    the output's (``output``, from ``completion_logprobs``), offsets counted from the prompt."""
    ids, lps = done["prompt_token_ids"], done["prompt_logprobs"]
    tops = done.get("prompt_top_logprobs") or [[] for _ in ids]
    prompt = {"tokens": [tok.token_text(t) for t in ids], "token_logprobs": list(lps),
              "top_logprobs": [None if lp is None else {tok.token_text(a): b for a, b in top}
                               for lp, top in zip(lps, tops)], "text_offset": []}
    pos = 0
    for t in ids:
        prompt["text_offset"].append(pos)
        pos += len(tok.decode([t]))
    if output is None:
        return prompt
    return {key: prompt[key] + (output[key] if key != "text_offset" else [o + pos for o in output[key]])
            for key in prompt}
