"""The pooling endpoints' requests and responses: OpenAI's ``/v1/embeddings``, vLLM's ``/pooling``
and ``/score``, and the rerank shape vLLM, Jina and Cohere share (``/rerank``, ``/v1/rerank``).

Parsing is pure (no tokenizer, no coordinator): each body becomes the texts or token ids to pool
and what the response needs, or an ``ApiError`` naming the field. Inputs are OpenAI's: a string, a
list of strings, a list of token ids, or a list of such lists.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from fusedserve.coordinator.openai.api_error import ApiError
from fusedserve.coordinator.sampling_params import is_kind

MAX_INPUTS = 2048  # inputs of one request (OpenAI's embeddings limit)

Input = str | list[int]


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="bad_field")


def inputs(value: object, param: str = "input") -> list[Input]:
    """OpenAI's ``input``: one text, texts, one token-id list, or token-id lists; never empty."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise _bad(f"'{param}' must be a string or a non-empty list (of strings or token ids)", param)
    if len(value) > MAX_INPUTS:
        raise _bad(f"'{param}' has {len(value)} items; at most {MAX_INPUTS}", param)
    if all(is_kind(t, int) for t in value):
        return [list(value)]
    out: list[Input] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list) and item and all(is_kind(t, int) for t in item):
            out.append(list(item))
        else:
            raise _bad(f"'{param}[{i}]' must be a string or a non-empty list of token ids", param)
    return out


def texts(value: object, param: str) -> list[str]:
    """A text or a non-empty list of texts (a rerank's documents may also be ``{"text": ...}``)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise _bad(f"'{param}' must be a string or a non-empty list of strings", param)
    if len(value) > MAX_INPUTS:
        raise _bad(f"'{param}' has {len(value)} items; at most {MAX_INPUTS}", param)
    out = []
    for i, item in enumerate(value):
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            item = item["text"]
        if not isinstance(item, str):
            raise _bad(f"'{param}[{i}]' must be a string (or an object with a 'text' string)", param)
        out.append(item)
    return out


def optional_int(body: dict, key: str, lo: int = 1) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not is_kind(value, int) or value < lo:
        raise _bad(f"'{key}' must be an integer >= {lo}", key)
    return value


def optional_str(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(f"'{key}' must be a string", key)
    return value


@dataclass
class EmbeddingRequest:
    inputs: list[Input]
    dimensions: int | None
    base64: bool
    normalize: bool


def embedding_request(body: dict, width: int) -> EmbeddingRequest:
    """``/v1/embeddings`` (and ``/pooling``): ``width`` is the model's embedding size."""
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise _bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dims = optional_int(body, "dimensions")
    if dims is not None and dims > width:
        raise _bad(f"'dimensions' is {dims}; this model's embeddings have {width}", "dimensions")
    normalize = body.get("normalize", True)
    if not isinstance(normalize, bool):
        raise _bad("'normalize' must be a boolean", "normalize")
    return EmbeddingRequest(inputs(body.get("input")), dims, fmt == "base64", normalize)


def encode_vector(v: np.ndarray, as_base64: bool) -> list[float] | str:
    """OpenAI's float list, or base64 of the little-endian float32 bytes (what its client decodes)."""
    if as_base64:
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
    return [float(x) for x in v]


@dataclass
class ScoreRequest:
    """Pairs to score: ``firsts[i]`` against ``seconds[i]`` (one query repeated for a rerank)."""

    firsts: list[str]
    seconds: list[str]
    instruction: str | None
    top_n: int | None = None
    return_documents: bool = True


def score_request(body: dict) -> ScoreRequest:
    """vLLM's ``/score``: ``text_1`` against each ``text_2`` (1 to N), or equal lists pairwise
    (``queries`` / ``documents`` are taken as the same)."""
    first = body.get("text_1", body.get("queries"))
    second = body.get("text_2", body.get("documents"))
    firsts = texts(first, "text_1")
    seconds = texts(second, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise _bad(f"'text_1' has {len(firsts)} texts and 'text_2' {len(seconds)}: give one text_1, or lists "
                   "of equal length", "text_2")
    return ScoreRequest(firsts, seconds, optional_str(body, "instruction"))


def rerank_request(body: dict) -> ScoreRequest:
    """The rerank shape: one ``query``, its ``documents``, ``top_n``, ``return_documents``."""
    query = body.get("query")
    if not isinstance(query, str):
        raise _bad("'query' must be a string", "query")
    docs = body.get("documents")
    if not isinstance(docs, list) or not docs:
        raise _bad("'documents' must be a non-empty list of strings", "documents")
    seconds = texts(docs, "documents")
    ret = body.get("return_documents", True)
    if not isinstance(ret, bool):
        raise _bad("'return_documents' must be a boolean", "return_documents")
    return ScoreRequest([query] * len(seconds), seconds, optional_str(body, "instruction"),
                        optional_int(body, "top_n"), ret)


def rerank_results(req: ScoreRequest, scores: list[float]) -> list[dict]:
    """Documents by relevance, highest first, the best ``top_n``."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or len(scores)]
    results = []
    for i in order:
        r: dict = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            r["document"] = {"text": req.seconds[i]}
        results.append(r)
    return results
