"""Multi-LoRA through the offline engine (the same ``EngineCore`` the server runs): a batch mixing
the base model and two peft adapters equals transformers + peft per row; more adapters in use than
slots evict and reload and stay exact; the prefix cache never serves one adapter's blocks to
another; the adapter's bytes are counted as the launch's h2d; and what cannot be served is refused
by name."""

from __future__ import annotations

import pytest
import torch

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.errors import RequestError
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.model_description.lora import LoraAdapter, LoraError
from fusedserve.worker.model.lora_weights import load_lora
from tests.lora_adapters import ADAPTERS, peft_greedy, write_adapter

PROMPTS = [[5, 17, 42, 99, 3, 8], [250, 1, 8, 77, 5], [77] * 7, [9, 8, 7, 6, 5, 4, 3, 2, 1], [31, 41, 59],
           [26, 53, 58, 97, 93, 23, 84]]
NAMES = [None, "a0", "a1", "a0", None, "a1"]
N = 32


@pytest.fixture(scope="module")
def lora_setup(hf_checkpoints, tmp_path_factory):
    base = hf_checkpoints["gqa2_untied"]
    root = tmp_path_factory.mktemp("lora_engine")
    dirs = {f"a{i}": root / f"a{i}" for i in range(len(ADAPTERS))}
    for i, d in enumerate(dirs.values()):
        write_adapter(base, d, i, **ADAPTERS[i])
    want = peft_greedy(base, dirs, PROMPTS, NAMES, N)
    plain = peft_greedy(base, dirs, PROMPTS, [None] * len(PROMPTS), N)
    # Every adapter row's output differs from the base model's: a row run without its adapter fails.
    assert all((w != p) == (name is not None) for w, p, name in zip(want, plain, NAMES))
    return base, dirs, want


def _engine(base, dirs, **kw) -> LLMEngine:
    settings = dict(dtype="float32", max_batch=8, block_size=4, num_blocks=128, sampler_candidates=8,
                    enable_lora=True, max_loras=2, max_lora_rank=16)
    eng = LLMEngine(base, **{**settings, **kw})
    for name, d in dirs.items():
        eng.add_lora(name, d)
    return eng


@pytest.mark.parametrize("path", ["native", "torch"])
def test_a_batch_mixing_base_and_two_adapters_equals_peft_per_row(lora_setup, path):
    """Both ways of applying the adapters: the native CPU kernel (one call per projection for every
    slot) and the torch path over the slots' views (other devices)."""
    base, dirs, want = lora_setup
    with _engine(base, dirs) as eng:
        if path == "native":
            if eng.model.kernels.name != "native":
                pytest.skip("the native CPU kernels are not built here")
            assert eng.model.lora_apply is not None
        else:
            eng.model.lora_apply = None
        eng.runtime.keep_history = 1000
        outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N, ignore_eos=True), lora=NAMES)
        history = list(eng.runtime.history)
    assert [o.token_ids for o in outs] == want
    # Greedy decode launches with adapter rows still hand back only the ids; the per-token slots go in.
    decodes = [r for r in history if r.kind == "decode"]
    assert decodes and all(r.d2h_bytes == r.dims["B"] * 4 for r in decodes)
    assert all(r.dims["LT"] == r.dims["T"] for r in decodes)


def test_an_adapter_read_into_its_slot_counts_as_the_launch_h2d(lora_setup):
    base, dirs, _ = lora_setup
    with _engine(base, {"a0": dirs["a0"]}) as eng:
        eng.runtime.keep_history = 100
        eng.generate(PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True), lora="a0")
        first, second = eng.runtime.history[:2]
        c = eng.model.config
        weights = load_lora(LoraAdapter.from_dir("a0", dirs["a0"], 16), c, torch.float32, torch.device("cpu"))
        slots = eng.runtime.plan(first.dims, 0).h2d_bytes
        assert first.h2d_bytes == slots + weights.nbytes  # the slot's copy, counted
        assert second.h2d_bytes == eng.runtime.plan(second.dims, 0).h2d_bytes  # resident: nothing more


@pytest.mark.parametrize("max_cpu_loras", [1, 2])
def test_more_adapters_than_slots_evict_and_reload_exactly(lora_setup, max_cpu_loras):
    base, dirs, want = lora_setup
    with _engine(base, dirs, max_loras=1, max_cpu_loras=max_cpu_loras) as eng:
        outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N, ignore_eos=True), lora=NAMES)
        loads = eng.core.loras.loads
    assert [o.token_ids for o in outs] == want
    assert loads >= 2  # one slot, two adapters: the second evicted the first


def test_ngram_speculation_with_adapters_equals_it_off(lora_setup):
    base, dirs, want = lora_setup
    with _engine(base, dirs, speculative_method="ngram", num_speculative_tokens=3,
                 speculative_max_batch=8) as eng:
        outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N, ignore_eos=True), lora=NAMES)
        stats = eng.core.scheduler.speculation.stats
    assert [o.token_ids for o in outs] == want
    assert stats.accepted > 0  # proposals verified under each row's adapter


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another(lora_setup):
    base, dirs, _ = lora_setup
    prompt = list(range(3, 20))  # 17 tokens: 4 full blocks of 4 can be reused
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with _engine(base, dirs) as eng:
        stats = eng.core.scheduler.blocks.stats

        def hit(lora):
            before = stats.hit_tokens
            out = eng.generate([prompt], params, lora=lora)[0].token_ids
            return stats.hit_tokens - before, out

        first = hit("a0")
        assert first[0] == 0
        assert hit("a1")[0] == 0  # the same tokens under another adapter: not a hit
        assert hit(None)[0] == 0  # nor for the base model
        again = hit("a0")
        assert again == (16, first[1])  # the adapter's own blocks are, with the same output


def test_what_cannot_be_served_is_refused_by_name(lora_setup, tmp_path):
    base, dirs, _ = lora_setup
    with _engine(base, {"a0": dirs["a0"]}, max_lora_rank=4) as eng:
        with pytest.raises(RequestError) as err:
            eng.generate(PROMPTS[:1], lora="nope")
        assert err.value.code == "model_not_found"
        with pytest.raises(LoraError, match="rank 8; this server allows 4"):
            eng.add_lora("a1", dirs["a1"])
        with pytest.raises(LoraError, match="already loaded"):
            eng.add_lora("a0", dirs["a0"])
    with LLMEngine(base, dtype="float32", num_blocks=16) as eng:
        with pytest.raises(LoraError, match="--enable-lora"):
            eng.add_lora("a0", dirs["a0"])


def test_the_slots_allocated_are_the_bytes_the_kv_budget_leaves_out(lora_setup):
    from fusedserve.kernels.model_description.lora import slot_bytes

    base, dirs, _ = lora_setup
    with _engine(base, dirs, max_loras=3, max_lora_rank=8) as eng:
        assert eng.runner.loras.nbytes == 3 * slot_bytes(eng.model.config, 8, 4)


def test_a_draft_model_ignores_the_adapters_and_the_target_applies_them(lora_setup, tmp_path):
    """The draft (the base's first layer) proposes without adapters; the target verifies each row
    under its own: the output is transformers + peft's, and some proposals were accepted."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    base, dirs, want = lora_setup
    src = load_file(str(base / "model.safetensors"))
    save_file({k: v for k, v in src.items() if not k.startswith("model.layers.") or k.split(".")[2] == "0"},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    config["num_hidden_layers"] = 1
    config.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in base.glob("*.json"):
        if f.name != "config.json":
            shutil.copy(f, tmp_path / f.name)
    with _engine(base, dirs, speculative_method="draft", speculative_model=str(tmp_path),
                 num_speculative_tokens=3, speculative_max_batch=8) as eng:
        outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N, ignore_eos=True), lora=NAMES)
        stats = eng.core.scheduler.speculation.stats
    assert [o.token_ids for o in outs] == want
    assert stats.proposed > 0


def test_the_same_prompt_under_another_adapter_does_not_wait_for_a_sibling(lora_setup):
    """Requests with one prompt share its blocks, the later waiting for the first to compute them;
    under another adapter there is nothing to share: all three start in the first launch."""
    base, dirs, _ = lora_setup
    prompt = list(range(3, 20))
    with _engine(base, dirs) as eng:
        for lora in ("a0", "a1", None):
            eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), lora=lora)
        eng.core.step()
        assert len(eng.core.scheduler.running) == 3
        eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), lora="a0")
        while eng.core.has_work():
            eng.core.step()
