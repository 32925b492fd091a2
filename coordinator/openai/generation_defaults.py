"""The API's sampling defaults from a model's ``generation_config.json`` (``--generation-config``),
as vLLM reads them: a request's own fields override them."""

from __future__ import annotations

import json
from pathlib import Path

from fusedserve.coordinator.sampling_params import GENERATION_CONFIG, SamplingParams, is_kind

# generation_config.json's own name for a field where it differs (as vLLM reads the file).
FILE_NAMES = {"max_tokens": "max_new_tokens"}


def generation_defaults(model_dir: str | Path, setting: str = "auto") -> dict:
    """The sampling defaults of ``--generation-config``: "auto" (the model directory's
    generation_config.json), "none" (or vLLM's "vllm": its own defaults, OpenAI's), or a directory
    holding one. Malformed values are skipped."""
    if setting in ("none", "vllm"):
        return {}
    path = Path(model_dir if setting == "auto" else setting) / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting}: no generation_config.json there")
        return {}
    raw = json.loads(path.read_text())
    out = {}
    for name, spec in SamplingParams.front_end_fields(GENERATION_CONFIG).items():
        value = raw.get(FILE_NAMES.get(name, name))
        if value is not None and is_kind(value, spec.kind):
            out[name] = value
    return out
