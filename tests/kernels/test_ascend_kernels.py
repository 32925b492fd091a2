"""torch_npu's fused ops in the kernel roles (``kernels/ascend/``): importable and never chosen
without an NPU; on an Ascend machine, the engine's greedy tokens equal the ATen path's."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from fusedserve.kernels import ascend
from fusedserve.kernels.backend_table import select_kernels
from fusedserve.kernels.model_description.config import Qwen3Config

SMALL = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def test_the_modules_import_without_torch_npu_and_are_not_chosen_elsewhere(monkeypatch):
    for name in ("fusedserve.kernels.ascend.layer_ops", "fusedserve.kernels.ascend.attention"):
        importlib.import_module(name)  # torch_npu is imported only when an op object is built
    monkeypatch.setenv("FUSEDSERVE_ASCEND_FUSED", "1")
    k = select_kernels(SMALL, torch.float32, torch.device("cpu"))
    assert k.name == "native" and k.capturable  # the CPU's backend, flag or not
    if importlib.util.find_spec("torch_npu") is None:
        assert not ascend.available()


@pytest.mark.gpu
@pytest.mark.skipif(not ascend.available(), reason="needs torch_npu and an Ascend NPU")
def test_the_fused_ops_run_the_engine_as_aten_does(monkeypatch):  # pragma: no cover - Ascend machines
    from fusedserve.coordinator.engine.llm_engine import LLMEngine, load_model
    from fusedserve.coordinator.sampling_params import SamplingParams

    prompts = ["The history of", "Python is a", "Once upon a time there"]
    runner = dict(max_batch=4, block_size=16, num_blocks=64, sampler_candidates=16, graphs="off")
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FUSEDSERVE_ASCEND_FUSED", flag)
        model, tok = load_model("default", "bfloat16", "npu", 128)
        assert (model.kernels.name == "ascend") == (flag == "1")
        with LLMEngine(model, **runner, tokenizer=tok) as eng:
            got = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        outs[flag] = [o.token_ids for o in got]
    assert outs["1"] == outs["0"]
