"""The pooling endpoints' handlers: ``/v1/embeddings``, ``/pooling``, ``/score`` and the rerank
routes, over a server running a pooling model (``--runner pooling``).

Each input is one ``generate`` frame to the coordinator (the server forces it to pool: no token is
sampled) and its ``done`` frame carries the pooled row as float32 bytes; the inputs of one request
run concurrently, so they share launches with each other and with every other client's. What a
request asks of the rows (Matryoshka truncation, normalisation, a score) is applied here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import anyio
import numpy as np
from fastapi import FastAPI, Request

from fusedserve.coordinator.client import ServerError
from fusedserve.coordinator.engine import pooling_output
from fusedserve.coordinator.model_files import reranker_prompt
from fusedserve.coordinator.openai import pooling_protocol as pp
from fusedserve.coordinator.openai import response_fields as rf
from fusedserve.coordinator.openai.api_error import ApiError
from fusedserve.coordinator.openai.gateway import Gateway, end_client

# Codes whose cause is the input itself: a 400 here (vLLM's answer to an input over the context).
INPUT_CODES = ("prompt_too_long", "too_many_tokens", "empty_prompt", "token_out_of_range")


def _model(gw: Gateway, body: dict) -> str:
    name = body.get("model")
    if name is not None and name not in gw.model_names:
        raise ApiError(404, f"model {name!r} does not exist; this server has "
                       f"{', '.join(map(repr, gw.model_names))}", param="model", code="model_not_found")
    return gw.model_name


def _encode(gw: Gateway, items: list[pp.Input]) -> list[list[int]]:
    """Token ids of each input (texts through the tokenizer's post-processor: an embedding model's
    appended EOS is what its last-token pooling reads)."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, list):
            out.append(item)
            continue
        if gw.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: give inputs as token ids", code="no_tokenizer")
        if len(item) > gw.max_prompt_chars:
            raise ApiError(400, f"input {i} has {len(item)} characters; the limit is {gw.max_prompt_chars}",
                           param="input", code="prompt_too_long")
        out.append(gw.tokenizer.encode(item, special=True))
    return out


async def pool(gw: Gateway, request: Request, prompts: list[list[int]]) -> tuple[list[np.ndarray], int]:
    """Each prompt's pooled row, and the prompt tokens they took. The first error fails the request
    (the others still finish: they are short, and each frees its blocks as it ends)."""
    client = end_client(request)
    rids = [gw.client.new_id() for _ in prompts]
    tasks = [gw.client.generate(ids, request_id=rid, max_tokens=1, client=client)
             for ids, rid in zip(prompts, rids)]
    dones = await asyncio.gather(*tasks, return_exceptions=True)
    for i, done in enumerate(dones):
        if isinstance(done, ServerError):
            err = ApiError.from_reply(done.reply)
            if err.code in INPUT_CODES:
                err = ApiError(400, f"input {i}: {err}", param="input", code=err.code)
            raise err
        if isinstance(done, BaseException):
            raise done
    rows = [np.frombuffer(done["pooled"], dtype="<f4") for done in dones]
    for done in dones:
        gw.metrics.finished(done)
    return rows, sum(done["usage"]["prompt_tokens"] for done in dones)


async def _scores(gw: Gateway, request: Request, req: pp.ScoreRequest) -> tuple[list[float], int]:
    """Each pair's relevance: a scoring model's own (Qwen3-Reranker's prompt), or, on an embedding
    model, the cosine of the two embeddings (as vLLM scores with one)."""
    task = gw.config.pooling_task
    if task is None:
        gw.need_task("score", "scoring")
    if task == "score":
        if gw.tokenizer is None:
            raise ApiError(400, "scoring text pairs needs the model's tokenizer", code="no_tokenizer")

        def prompts() -> list[list[int]]:
            return [reranker_prompt.pair_ids(gw.tokenizer, q, d, req.instruction)
                    for q, d in zip(req.firsts, req.seconds)]

        rows, tokens = await pool(gw, request, await anyio.to_thread.run_sync(prompts))
        return [pooling_output.score(r) for r in rows], tokens
    unique = list(dict.fromkeys([*req.firsts, *req.seconds]))
    ids = await anyio.to_thread.run_sync(_encode, gw, unique)
    rows, tokens = await pool(gw, request, ids)
    vec = {t: pooling_output.embedding(r) for t, r in zip(unique, rows)}
    return [float(np.dot(vec[q], vec[d])) for q, d in zip(req.firsts, req.seconds)], tokens


def add_pooling_routes(app: FastAPI, gw: Gateway, read_body: Callable[[Request], Awaitable[dict]]) -> None:
    async def embedded(request: Request, endpoint: str) -> tuple[str, pp.EmbeddingRequest, list[np.ndarray],
                                                                 int]:
        gw.check_auth(request)
        body = await read_body(request)
        gw.need_task("embed", endpoint)
        gw.shed(request)
        model = _model(gw, body)
        req = pp.embedding_request(body, gw.config.pooled_width)
        ids = await anyio.to_thread.run_sync(_encode, gw, req.inputs)
        rows, tokens = await pool(gw, request, ids)
        vectors = [pooling_output.embedding(r, req.dimensions, req.normalize) for r in rows]
        return model, req, vectors, tokens

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        """OpenAI's: ``input``, ``dimensions``, ``encoding_format`` (float, base64)."""
        model, req, vectors, tokens = await embedded(request, "/v1/embeddings")
        data = [{"object": "embedding", "index": i, "embedding": pp.encode_vector(v, req.base64)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/pooling")
    async def pooling(request: Request) -> dict:
        """vLLM's: each input's pooled output (an embedding model's embedding)."""
        model, req, vectors, tokens = await embedded(request, "/pooling")
        data = [{"index": i, "object": "pooling", "data": pp.encode_vector(v, req.base64)}
                for i, v in enumerate(vectors)]
        return {"id": rf.new_id("pool"), "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: Request) -> dict:
        """vLLM's: ``text_1`` against each of ``text_2`` (or pairwise)."""
        gw.check_auth(request)
        body = await read_body(request)
        model = _model(gw, body)
        req = pp.score_request(body)
        scores, tokens = await _scores(gw, request, req)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return {"id": rf.new_id("score"), "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: Request) -> dict:
        """Jina's and Cohere's (as vLLM serves them): ``query``, ``documents``, ``top_n``."""
        gw.check_auth(request)
        body = await read_body(request)
        model = _model(gw, body)
        req = pp.rerank_request(body)
        scores, tokens = await _scores(gw, request, req)
        return {"id": rf.new_id("rerank"), "model": model, "usage": {"total_tokens": tokens},
                "results": pp.rerank_results(req, scores)}
