"""Bad inputs fail early with errors that name the problem."""

from __future__ import annotations

import json
import shutil

import pytest

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.errors import RequestError
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.model_description.config import ConfigError, Qwen3Config
from fusedserve.worker.model.loader import WeightError
from fusedserve.worker.model.qwen3 import Qwen3Model


@pytest.fixture(scope="module")
def engine(hf_checkpoints):
    rc = dict(max_batch=2, block_size=4, num_blocks=32, sampler_candidates=8)
    with LLMEngine(hf_checkpoints["gqa2_untied"], dtype="float32", max_model_len=40, **rc) as eng:
        yield eng


def test_token_id_out_of_range(engine):
    with pytest.raises(RequestError, match=r"token 1 is 384.*\[0, 384\)") as exc:
        engine.generate([[1, 384, 2]])
    assert exc.value.code == "token_out_of_range"
    with pytest.raises(RequestError, match="token 0 is -1"):
        engine.generate([[-1]])


def test_prompt_longer_than_max_model_len(engine):
    with pytest.raises(RequestError, match="prompt has 40 tokens; max_model_len is 40") as exc:
        engine.generate([[1] * 40])
    assert exc.value.code == "prompt_too_long"
    # The engine still serves a valid request afterwards.
    assert len(engine.generate([[1] * 39], SamplingParams(max_tokens=5))[0].token_ids) == 1


def test_text_prompt_without_tokenizer(engine):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        engine.generate(["hello"])


def test_malformed_config_json(tmp_path, hf_checkpoints):
    bad = tmp_path / "bad"
    shutil.copytree(hf_checkpoints["gqa2_untied"], bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="malformed config.json"):
        Qwen3Model.from_pretrained(bad)
    raw = json.loads((hf_checkpoints["gqa2_untied"] / "config.json").read_text())
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="missing required field 'hidden_size'"):
        Qwen3Config.from_dict(raw)
    raw = json.loads((hf_checkpoints["gqa2_untied"] / "config.json").read_text())
    raw["num_key_value_heads"] = 3
    with pytest.raises(ConfigError, match="not a multiple of num_key_value_heads"):
        Qwen3Config.from_dict(raw)
    raw["num_key_value_heads"], raw["model_type"] = 2, "llama"
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        Qwen3Config.from_dict(raw)
    with pytest.raises(ConfigError, match="no config.json"):
        Qwen3Config.from_dir(tmp_path)


def test_missing_weight_tensor(tmp_path, hf_checkpoints):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "missing"
    shutil.copytree(hf_checkpoints["gqa2_untied"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(WeightError, match="missing weight tensor 'model.layers.1.mlp.up_proj.weight'"):
        Qwen3Model.from_pretrained(bad)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.gate_proj.weight"][:3].clone()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(WeightError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \(3, 64\)"):
        Qwen3Model.from_pretrained(bad)


def test_default_model_is_deterministic(tmp_path):
    from fusedserve.coordinator.model_files.default_model import write_checkpoint

    write_checkpoint(tmp_path / "a")
    write_checkpoint(tmp_path / "b")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
