"""Whether a model generates or pools, and what a pooled row is: resolved once from the flags and
the checkpoint, before anything is sized (the pooled width sizes the arena's ``pooled`` slot).

Embedding checkpoints (Qwen3-Embedding: a sentence-transformers save with ``modules.json``, or a
bare ``Qwen3Model``) pool by default; so do sequence-classification checkpoints and causal LMs whose
name says reranker (Qwen3-Reranker), which score. A causal-LM reranker scores as its model card
does: P(yes) over the yes/no pair at the last position, i.e. sigmoid(logit(yes) - logit(no)); the
worker hands back that difference, the head vLLM builds for it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.shared_memory.engine_config import EngineConfig

log = logging.getLogger(__name__)
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "config_sentence_transformers.json")


def _raw_config(model_dir: Path) -> dict:
    """A directory's config.json as a dict ({} where it has none)."""
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def classifier_labels(raw: dict) -> int:
    """A sequence-classification config's labels (transformers: ``id2label``'s size, else 2)."""
    labels = raw.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    n = raw.get("num_labels", 2)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 2


def _check_pooling_mode(path: Path) -> None:
    """A sentence-transformers Pooling module must pool the last token, as Qwen3-Embedding does
    (the only pooling the worker runs); another mode is refused by name, never served wrongly."""
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        return
    for module in modules if isinstance(modules, list) else []:
        if not isinstance(module, dict) or not str(module.get("type", "")).endswith("models.Pooling"):
            continue
        conf = _raw_config(path / str(module.get("path", "")))
        modes = [k.removeprefix("pooling_mode_") for k, v in conf.items()
                 if k.startswith("pooling_mode_") and v]
        if modes and modes != ["lasttoken"]:
            raise ValueError(f"{path}: its sentence-transformers Pooling module pools by {', '.join(modes)}; "
                             "only last-token pooling (Qwen3-Embedding's) is served")


def resolve_pooling(cfg: EngineConfig, model_dir: str, model: Qwen3Config) -> EngineConfig:
    """``cfg`` with ``runner`` and ``pooling_task`` concrete, and the pooled width and score tokens
    set; ValueError for a combination no launch could serve."""
    m, path = cfg.model, Path(model_dir)
    raw = _raw_config(path)
    archs = [a for a in raw.get("architectures") or [] if isinstance(a, str)]
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    embedding = any((path / f).is_file() for f in SENTENCE_TRANSFORMERS_FILES) or archs == ["Qwen3Model"]
    reranker = "reranker" in path.name.lower() or "reranker" in m.model.lower()
    runner, task = m.runner, {"classify": "score"}.get(m.pooling_task, m.pooling_task)
    if runner == "auto":
        runner = "pooling" if classifier or embedding or reranker or task != "auto" else "generate"
    if runner == "generate":
        if classifier:
            raise ValueError(f"{model_dir} is a sequence-classification checkpoint ({archs[0]}): it has no "
                             "lm_head to generate with; serve it with --runner pooling")
        return cfg.replace(runner="generate", pooled_width=0, score_tokens=())
    if cfg.speculating:  # nothing is sampled, so nothing is proposed
        log.info("a pooling model: speculative decoding (%s) is off", cfg.speculative.speculative_method)
        cfg = cfg.replace(speculative_method="off", speculative_model=None)
    if task == "auto":
        task = "score" if classifier or reranker else "embed"
    if task == "embed":
        _check_pooling_mode(path)
        return cfg.replace(runner="pooling", pooling_task="embed", pooled_width=model.hidden_size,
                           score_tokens=())
    if classifier:
        return cfg.replace(runner="pooling", pooling_task="score", pooled_width=classifier_labels(raw),
                           score_tokens=())
    tok = TextTokenizer.from_dir(path)
    ids = None if tok is None else (tok.token_id("no"), tok.token_id("yes"))
    if ids is None or None in ids:
        raise ValueError(f"--pooling-task score on the causal LM {model_dir} scores with its 'no' and 'yes' "
                         "tokens (Qwen3-Reranker's card), and its tokenizer has no such tokens")
    return cfg.replace(runner="pooling", pooling_task="score", pooled_width=1, score_tokens=ids)
