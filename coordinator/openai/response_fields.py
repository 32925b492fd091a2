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


def token_name(tok: TextTokenizer, token: int, as_ids: bool = False) -> str:
    """A logprob's token: its text, or ``token_id:N`` (vLLM's return_tokens_as_token_ids, for
    tokens that are not whole UTF-8 characters)."""
    return f"token_id:{token}" if as_ids else tok.token_text(token)


def _token_entry(tok: TextTokenizer, token: int, lp: float, as_ids: bool) -> dict:
    return {"token": token_name(tok, token, as_ids), "logprob": lp, "bytes": list(tok.token_bytes(token))}


def chat_logprobs(tok: TextTokenizer, ids: list[int], lps: list[float], tops: list | None,
                  as_ids: bool = False) -> dict:
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        entry = _token_entry(tok, t, lp, as_ids)
        entry["top_logprobs"] = [_token_entry(tok, a, b, as_ids) for a, b in (tops[i] if tops else [])]
        content.append(entry)
    return {"content": content}


def completion_logprobs(tok: TextTokenizer, ids: list[int], lps: list[float], tops: list | None,
                        offset: int = 0, as_ids: bool = False) -> dict:
    tokens = [token_name(tok, t, as_ids) for t in ids]
    offsets, pos = [], offset
    for t in ids:
        offsets.append(pos)
        pos += len(tok.decode([t]))
    top = [{token_name(tok, a, as_ids): b for a, b in step} for step in tops] if tops else [None] * len(ids)
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs(tok: TextTokenizer, done: dict, as_ids: bool = False) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else the token's own and
    the top ones', ``{id: {"logprob", "rank", "decoded_token"}}``; rank is known (1-based) for the
    tokens of the top list, null for a prompt token outside it."""
    ids, lps = done["prompt_token_ids"], done["prompt_logprobs"]
    tops = done.get("prompt_top_logprobs") or [[] for _ in ids]
    out: list[dict | None] = []
    for t, lp, top in zip(ids, lps, tops):
        if lp is None:
            out.append(None)
            continue
        rank = {a: r + 1 for r, (a, _) in enumerate(top)}
        entry = {}
        for token, logprob in [(t, lp), *top]:
            entry.setdefault(str(token), {"logprob": logprob, "rank": rank.get(token),
                                          "decoded_token": token_name(tok, token, as_ids)})
        out.append(entry)
    return out


def echo_logprobs(tok: TextTokenizer, done: dict, output: dict | None, as_ids: bool = False) -> dict:
    """Completions' logprobs with ``echo``: the prompt's tokens first (the first has none), then
    the output's (``output``, from ``completion_logprobs``), offsets counted from the prompt."""
    ids, lps = done["prompt_token_ids"], done["prompt_logprobs"]
    tops = done.get("prompt_top_logprobs") or [[] for _ in ids]
    prompt = {"tokens": [token_name(tok, t, as_ids) for t in ids], "token_logprobs": list(lps),
              "top_logprobs": [None if lp is None else {token_name(tok, a, as_ids): b for a, b in top}
                               for lp, top in zip(lps, tops)], "text_offset": []}
    pos = 0
    for t in ids:
        prompt["text_offset"].append(pos)
        pos += len(tok.decode([t]))
    if output is None:
        return prompt
    return {key: prompt[key] + (output[key] if key != "text_offset" else [o + pos for o in output[key]])
            for key in prompt}
