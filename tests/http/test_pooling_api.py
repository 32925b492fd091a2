"""The pooling endpoints served: ``/v1/embeddings`` through the official ``openai`` client,
``/pooling``, ``/score`` and ``/rerank`` on a reranker, each equal to transformers' own computation
of the model card's formula, and the bad inputs each a coded 400 that loses nothing."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch

from fusedserve.coordinator.client import Client, ServerError
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.server.server import Server
from tests.pooling_models import reference_scores, write_embedding_model, write_reranker_model
from tests.support import running_server, serving_http

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 6, "a",
         "tea or coffee in the morning"]
QUERY = "what is a fox"
DOCS = ["a fox is an animal of the forest", "paris is a city", "foxes eat mice", "the sea is blue"]


@pytest.fixture(scope="module")
def embed_path(tmp_path_factory) -> str:
    return str(write_embedding_model(tmp_path_factory.mktemp("pool") / "Qwen3-Embedding-test"))


@pytest.fixture(scope="module")
def rerank_path(tmp_path_factory) -> str:
    return str(write_reranker_model(tmp_path_factory.mktemp("pool") / "Qwen3-Reranker-test"))


@pytest.fixture(scope="module")
def embed_served(embed_path, ray_session) -> Iterator[tuple[Server, str]]:
    """Auto-detected as an embedding model (its modules.json)."""
    with running_server(model=embed_path, dtype="float32", max_batch=8, max_model_len=1024) as coord, \
            serving_http(coord) as http:
        yield coord, http.url


@pytest.fixture(scope="module")
def embed_server(embed_served) -> str:
    return embed_served[1]


@pytest.fixture(scope="module")
def rerank_server(rerank_path, ray_session) -> Iterator[str]:
    """Auto-detected as a reranker (its name), scoring with its yes/no tokens."""
    with running_server(model=rerank_path, dtype="float32", max_batch=8) as coord, \
            serving_http(coord) as http:
        yield http.url


def _reference_embeddings(path: str, texts: list[str]) -> np.ndarray:
    """transformers' last-token pooling, normalised (sentence-transformers' Qwen3-Embedding pipeline)."""
    from transformers import Qwen3Model

    tok = TextTokenizer.from_dir(path)
    model = Qwen3Model.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            h = model(torch.tensor([tok.encode(t, special=True)])).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(h, dim=0).numpy())
    return np.stack(out)


def test_openai_client_embeddings_equal_transformers_last_token_pooling(embed_server, embed_path):
    client = openai.OpenAI(base_url=f"{embed_server}/v1", api_key="none", max_retries=0)
    got = client.embeddings.create(model="default", input=TEXTS)  # the client asks base64 and decodes
    vectors = np.array([d.embedding for d in sorted(got.data, key=lambda d: d.index)], dtype=np.float32)
    ref = _reference_embeddings(embed_path, TEXTS)
    cos = (vectors * ref).sum(1)
    assert cos.min() >= 0.9999, cos
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert got.usage.prompt_tokens == got.usage.total_tokens > len(TEXTS)
    short = client.embeddings.create(model="default", input=TEXTS, dimensions=16)
    for d in short.data:  # Matryoshka: the first 16 values, renormalised
        v = np.array(d.embedding)
        assert v.shape == (16,) and abs(np.linalg.norm(v) - 1) < 1e-5
        want = ref[d.index][:16] / np.linalg.norm(ref[d.index][:16])
        assert np.dot(v, want) >= 0.9999
    floats = client.embeddings.create(model="default", input=TEXTS[0], encoding_format="float")
    assert np.dot(np.array(floats.data[0].embedding), ref[0]) >= 0.9999


def test_token_id_inputs_and_pooling_endpoint(embed_server):
    with httpx.Client(base_url=embed_server, timeout=60) as c:
        ids = c.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
        a = c.post("/v1/embeddings", json={"input": [ids + [0]], "encoding_format": "base64"}).json()
        b = c.post("/v1/embeddings", json={"input": "hello world"}).json()
        va = np.frombuffer(base64.b64decode(a["data"][0]["embedding"]), dtype="<f4")
        assert np.allclose(va, b["data"][0]["embedding"], atol=1e-6)  # text = its ids + the appended EOS
        p = c.post("/pooling", json={"input": ["hello world"]}).json()
        assert p["object"] == "list"
        assert np.allclose(p["data"][0]["data"], b["data"][0]["embedding"], atol=1e-6)
        s = c.post("/score", json={"text_1": "hello world", "text_2": ["hello world", "the sea"]}).json()
        assert abs(s["data"][0]["score"] - 1.0) < 1e-5 and s["data"][1]["score"] < 1.0  # cosine


@pytest.mark.parametrize("body, code", [
    ({"input": []}, "bad_field"),
    ({"input": "hi", "dimensions": 65}, "bad_field"),
    ({"input": "word " * 1100}, "prompt_too_long"),
    ({"input": [[1, 2], "x", 3]}, "bad_field"),
    ({"input": "hi", "encoding_format": "int8"}, "bad_field"),
])
def test_bad_embedding_inputs_are_coded_400s_and_lose_nothing(embed_server, body, code):
    with httpx.Client(base_url=embed_server, timeout=60) as c:
        r = c.post("/v1/embeddings", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == code
        assert c.post("/v1/embeddings", json={"input": "still served"}).status_code == 200
        wrong = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "wrong_task"


def test_rerank_and_score_equal_the_yes_no_formula(rerank_server, rerank_path):
    ref = reference_scores(rerank_path, QUERY, DOCS)
    with httpx.Client(base_url=rerank_server, timeout=60) as c:
        s = c.post("/score", json={"text_1": QUERY, "text_2": DOCS}).json()
        assert np.allclose([d["score"] for d in s["data"]], ref, atol=1e-5)
        for path in ("/rerank", "/v1/rerank"):
            r = c.post(path, json={"query": QUERY, "documents": DOCS, "top_n": 3}).json()
            got = [x["index"] for x in r["results"]]
            assert got == sorted(range(len(DOCS)), key=lambda i: -ref[i])[:3]
            assert np.allclose([x["relevance_score"] for x in r["results"]], sorted(ref, reverse=True)[:3],
                               atol=1e-5)
            assert r["results"][0]["document"]["text"] == DOCS[got[0]]
        bad = c.post("/rerank", json={"query": QUERY, "documents": []})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_field"
        emb = c.post("/v1/embeddings", json={"input": "hi"})
        assert emb.status_code == 400 and emb.json()["error"]["code"] == "wrong_task"
        assert c.post("/rerank", json={"query": QUERY, "documents": DOCS[:1]}).status_code == 200


def test_zmq_done_frame_carries_the_pooled_row_and_streams_are_refused(embed_served, embed_path):
    coord, url = embed_served
    ref = _reference_embeddings(embed_path, TEXTS[:1])[0]
    with Client(coord.address, timeout_s=60) as c:
        done = c.generate(TEXTS[0])
        row = np.frombuffer(done["pooled"], dtype="<f4")
        assert row.shape == (64,) and done["token_ids"] == [] and done["usage"]["completion_tokens"] == 0
        assert np.dot(row / np.linalg.norm(row), ref) >= 0.9999
        with pytest.raises(ServerError) as err:
            list(c.stream(TEXTS[0]))
        assert err.value.reply["code"] == "bad_param" and "stream false" in err.value.reply["message"]
        assert "pooled" in c.generate(TEXTS[1])
