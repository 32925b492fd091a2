"""The offline pooling runner: ``LLMEngine.embed()`` equals transformers' last-token pooling (fp32
within 1e-4 cosine, bf16 no worse than transformers' own bf16 error), through prompt chunks over
several launches and the prefix cache; ``score()`` equals a classification head's and a causal-LM
reranker's card formula; only the pooled rows cross back (PL x H x 4 bytes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files import reranker_prompt
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from tests.pooling_models import (
    reference_scores,
    write_classifier_model,
    write_embedding_model,
    write_reranker_model,
)

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 8, "a", "tea or coffee",
         "one two three four five six seven eight nine ten " * 3, "zebra", "rain in spain falls mainly",
         "x y z"]
QUERY = "what is a fox"
DOCS = ["a fox is an animal of the forest", "paris is a city", "foxes eat mice"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling")
    return {"embed": write_embedding_model(root / "embedding"),
            "rerank": write_reranker_model(root / "qwen3-reranker"),
            "classify": write_classifier_model(root / "classifier")}


def _reference(path: Path, texts: list[str], dtype: torch.dtype) -> np.ndarray:
    from transformers import Qwen3Model

    tok = TextTokenizer.from_dir(path)
    model = Qwen3Model.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        rows = [model(torch.tensor([tok.encode(t, special=True)])).last_hidden_state[0, -1].float()
                for t in texts]
    return torch.nn.functional.normalize(torch.stack(rows), dim=1).numpy()


def test_embeddings_equal_transformers_through_chunks_and_the_prefix_cache(models):
    ref = _reference(models["embed"], TEXTS, torch.float32)
    # 4-token blocks and a 48-token launch budget: the long prompts run over several launches.
    with LLMEngine(models["embed"], dtype="float32", max_batch=8, block_size=4,
                   max_num_batched_tokens=48) as eng:
        assert (eng.config.model.runner, eng.config.model.pooling_task) == ("pooling", "embed")
        eng.runtime.keep_history = 64
        out = eng.embed(TEXTS)
        got = np.stack([o.value for o in out])
        assert ((got * ref).sum(1) >= 0.9999).all(), (got * ref).sum(1)
        for rec in eng.runtime.history:  # only the pooled rows come back, as float32
            assert rec.d2h_bytes == rec.dims["PL"] * 64 * 4
        assert sum(rec.dims["PL"] for rec in eng.runtime.history) == len(TEXTS)
        again = eng.embed(TEXTS[1:2])  # its full blocks are cached: only the rest runs
        assert eng.runtime.history[-1].dims["T"] < len(out[1].prompt_ids)
        assert np.allclose(again[0].value, got[1], atol=1e-6)
        short = eng.embed(TEXTS[:2], dimensions=8)
        for o, full in zip(short, ref):
            assert o.value.shape == (8,) and abs(np.linalg.norm(o.value) - 1) < 1e-5
            assert np.dot(o.value, full[:8] / np.linalg.norm(full[:8])) >= 0.9999
        with pytest.raises(ValueError, match="embed\\(\\) or score\\(\\)"):
            eng.generate(["hello"])
        with pytest.raises(ValueError, match="pooling_task score"):
            eng.score(QUERY, DOCS)


def test_bf16_embeddings_are_no_worse_than_transformers_bf16(models):
    ref = _reference(models["embed"], TEXTS, torch.float32)
    theirs = 1 - (_reference(models["embed"], TEXTS, torch.bfloat16) * ref).sum(1)
    with LLMEngine(models["embed"], dtype="bfloat16", max_batch=8) as eng:
        ours = 1 - (np.stack([o.value for o in eng.embed(TEXTS)]) * ref).sum(1)
    assert ours.mean() <= 1.25 * theirs.mean(), (ours.mean(), theirs.mean())


def test_reranker_scores_equal_the_cards_yes_no_formula(models):
    path = models["rerank"]
    tok = TextTokenizer.from_dir(path)
    no, yes = tok.token_id("no"), tok.token_id("yes")
    ref = reference_scores(path, QUERY, DOCS, "Find animals")
    with LLMEngine(path, dtype="float32", max_batch=4) as eng:
        assert eng.config.model.score_tokens == (no, yes)
        got = [o.value for o in eng.score(QUERY, DOCS, instruction="Find animals")]
        pairwise = [o.value for o in eng.score([QUERY] * 3, DOCS, instruction="Find animals")]
        with pytest.raises(ValueError, match="equal lists"):
            eng.score([QUERY, QUERY], DOCS)
    assert np.allclose(got, ref, atol=1e-5) and np.allclose(pairwise, ref, atol=1e-5)


def test_a_classification_head_scores_as_transformers(models):
    from transformers import Qwen3ForSequenceClassification

    path = models["classify"]
    tok = TextTokenizer.from_dir(path)
    head = Qwen3ForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        prompts = [torch.tensor([reranker_prompt.pair_ids(tok, QUERY, d)]) for d in DOCS]
        ref = [float(torch.sigmoid(head(ids).logits[0, 0])) for ids in prompts]
    with LLMEngine(path, dtype="float32", max_batch=4) as eng:
        assert (eng.config.model.runner, eng.config.model.pooled_width) == ("pooling", 1)
        got = [o.value for o in eng.score(QUERY, DOCS)]
    assert np.allclose(got, ref, atol=1e-5)


def test_a_generating_engine_refuses_embed_and_a_classifier_refuses_to_generate(models, hf_checkpoints):
    with LLMEngine(hf_checkpoints["gqa2_untied"], dtype="float32", max_batch=2) as eng:
        with pytest.raises(ValueError, match="generating model"):
            eng.embed(["hi"])
    with pytest.raises(ValueError, match="--runner pooling"):
        LLMEngine(models["classify"], dtype="float32", runner="generate")
    with pytest.raises(ValueError, match="only last-token pooling"):
        (models["embed"] / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
        try:
            LLMEngine(models["embed"], dtype="float32")
        finally:
            (models["embed"] / "1_Pooling" / "config.json").write_text('{"pooling_mode_lasttoken": true}')
