"""LoRA adapters written by ``peft`` on a random-weight Qwen3: what is read of them, what is refused
with its reason, and their updates in the model's fused layout (q/k/v as one projection, gate/up
as one) against peft's own merge (``merge_and_unload``), per row of a batch mixing the base model
and two adapters, whole and split over a tensor-parallel pair."""

from __future__ import annotations

import pytest
import torch

from fusedserve.kernels.lora import add_lora, lora_groups
from fusedserve.kernels.model_description.config import ConfigError, Qwen3Config
from fusedserve.kernels.model_description.lora import LoraAdapter, LoraError
from fusedserve.worker.model.lora_weights import FUSED, ROW_PARALLEL, load_lora
from fusedserve.worker.model.tensor_parallel import TensorParallel
from tests.lora_adapters import ADAPTERS, ALL, write_adapter


@pytest.fixture(scope="module")
def adapters(hf_checkpoints, tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    base_dir = hf_checkpoints["gqa2_untied"]
    root = tmp_path_factory.mktemp("lora")
    merged = [write_adapter(base_dir, root / f"a{i}", i, **kw) for i, kw in enumerate(ADAPTERS)]
    base = Qwen3ForCausalLM.from_pretrained(base_dir, dtype=torch.float32).state_dict()
    return base_dir, [root / f"a{i}" for i in range(len(ADAPTERS))], base, merged


def _fused(state: dict[str, torch.Tensor], i: int, fused: str) -> torch.Tensor:
    """Layer ``i``'s fused projection as the model holds it: its parts' weights stacked by rows."""
    parts = [f"model.layers.{i}.{'self_attn' if m in ALL[:4] else 'mlp'}.{m}.weight" for m in FUSED[fused]]
    return torch.cat([state[p] for p in parts])


def test_what_an_adapter_changes_is_read_from_its_tensors(adapters):
    _, dirs, _, _ = adapters
    a0 = LoraAdapter.from_dir("a0", dirs[0], max_rank=16, num_layers=2)
    assert (a0.rank, a0.scaling, a0.targets) == (4, 2.0, tuple(ALL))
    assert a0.modules == {(i, m) for i in range(2) for m in ALL}
    a1 = LoraAdapter.from_dir("a1", dirs[1], max_rank=16)
    assert a1.rslora and a1.scaling == pytest.approx(16 / 8 ** 0.5)
    assert a1.modules == {(1, "q_proj"), (1, "v_proj"), (1, "down_proj")}  # layers_to_transform


def test_what_cannot_be_served_is_refused_with_its_reason(adapters, tmp_path):
    base_dir, dirs, _, _ = adapters
    with pytest.raises(LoraError, match="rank 8; this server allows 4 .--max-lora-rank"):
        LoraAdapter.from_dir("a1", dirs[1], max_rank=4)
    write_adapter(base_dir, tmp_path / "head", 5, r=4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoraError, match="lm_head"):
        LoraAdapter.from_dir("head", tmp_path / "head", max_rank=16)
    write_adapter(base_dir, tmp_path / "dora", 6, r=4, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(LoraError, match="DoRA"):
        LoraAdapter.from_dir("dora", tmp_path / "dora", max_rank=16)
    with pytest.raises(LoraError, match="no readable adapter_config.json"):
        LoraAdapter.from_dir("none", tmp_path, max_rank=16)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_mixed_rows_equal_peft_merged_weights_per_row(adapters, tp_size):
    base_dir, dirs, base, merged = adapters
    c = Qwen3Config.from_dir(base_dir)
    slots = torch.tensor([0, -1, 1, 0, 1, -1, 1])  # base, adapter 0 and adapter 1 rows mixed
    torch.manual_seed(0)
    for i in range(c.num_hidden_layers):
        for fused in FUSED:
            w = _fused(base, i, fused)
            want_w = [_fused(m, i, fused) for m in merged]
            x = torch.randn(len(slots), w.shape[1])
            want = torch.stack([x[t] @ (w if s < 0 else want_w[s]).T for t, s in enumerate(slots.tolist())])
            ranks = [TensorParallel(r, tp_size) for r in range(tp_size)]
            got = torch.zeros_like(want)
            for tp in ranks:
                found = [LoraAdapter.from_dir(f"a{k}", d, 16) for k, d in enumerate(dirs)]
                weights = [load_lora(a, c, torch.float32, torch.device("cpu"), tp).layers[i].get(fused)
                           for a in found]
                if fused in ROW_PARALLEL:  # this rank's inputs; the ranks' partial sums add up
                    cols = _share(c, tp, fused)
                    y = x[:, cols] @ w[:, cols].T
                    add_lora(x[:, cols].contiguous(), y, lora_groups(slots, 2), weights)
                    got += y
                else:  # this rank's rows of each part, in the order the model stacks them
                    rows = _share(c, tp, fused)
                    y = x @ w[rows].T
                    add_lora(x, y, lora_groups(slots, 2), weights)
                    got[:, rows] = y
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"layer {i} {fused} tp {tp_size}")


def _share(c: Qwen3Config, tp: TensorParallel, fused: str) -> list[int]:
    """This rank's rows (column-parallel) or columns (row-parallel) of the whole fused weight."""
    hd = c.head_dim
    if fused in ("qkv", "o_proj"):
        heads, kv = tp.heads(c), tp.kv_heads(c)
        q = list(range(heads.start * hd, heads.stop * hd))
        if fused == "o_proj":
            return q
        k = [c.q_size + j for j in range(kv.start * hd, kv.stop * hd)]
        return q + k + [j + c.kv_size for j in k]
    inter = list(tp.split(c.intermediate_size))
    return inter + [c.intermediate_size + j for j in inter] if fused == "gate_up" else inter


def test_a_batch_mixing_base_and_two_adapters_equals_peft_per_row(adapters):
    """Three prompts in one launch, one on the base model and one under each adapter, then decode
    steps: each row's logits equal transformers + peft with that row's adapter (or none)."""
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM

    from fusedserve.worker.model.qwen3 import Qwen3Model
    from tests.model_batches import decode_batch, prompt_batch

    base_dir, dirs, _, _ = adapters
    hf = Qwen3ForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(hf, dirs[0], adapter_name="a0").eval()
    peft_model.load_adapter(dirs[1], adapter_name="a1")
    model = Qwen3Model.from_pretrained(base_dir, dtype="float32")
    for slot, d in enumerate(dirs):
        model.set_lora(slot, load_lora(LoraAdapter.from_dir(f"a{slot}", d, 16), model.config, torch.float32,
                                       torch.device("cpu")))
    prompts = [[5, 17, 42, 99, 3, 8], [250, 1, 8, 77, 5], [77] * 7]
    row_slots = [-1, 0, 1]
    with torch.no_grad():
        want = []
        for p, s in zip(prompts, row_slots):
            ids = torch.tensor([p + [11, 12]])  # the prompt, then two decode steps
            if s < 0:
                with peft_model.disable_adapter():
                    want.append(peft_model(ids).logits[0])
            else:
                peft_model.set_adapter(f"a{s}")
                want.append(peft_model(ids).logits[0])
    kv = model.new_kv_cache(num_blocks=16, block_size=4)
    ws = model.new_workspace(max_rows=3, block_size=4)
    logits = torch.empty(3, model.config.vocab_size)
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    batch = prompt_batch(prompts, tables, 4)
    batch.lora_slots = torch.tensor([s for p, s in zip(prompts, row_slots) for _ in p])
    model.forward(batch, kv, ws, logits)
    for r, p in enumerate(prompts):
        torch.testing.assert_close(logits[r], want[r][len(p) - 1], atol=2e-4, rtol=1e-4,
                                   msg=f"prompt row {r}")
    for step, token in enumerate((11, 12)):
        batch = decode_batch([(token, len(p) + step, t) for p, t in zip(prompts, tables)], 4)
        batch.lora_slots = torch.tensor(row_slots)
        model.forward(batch, kv, ws, logits)
        for r, p in enumerate(prompts):
            torch.testing.assert_close(logits[r], want[r][len(p) + step], atol=2e-4, rtol=1e-4,
                                       msg=f"decode step {step} row {r}")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_adapters_over_quantized_base_weights_add_their_full_update(adapters, quantization):
    """int8 / int4 base weights with 16-bit adapters: the logits' error against transformers + peft
    is the quantization's own (as large as the base model's without an adapter), not the adapter's
    update, which is many times larger: the adapter is applied in full over the quantized layers."""
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM

    from fusedserve.shared_memory.engine_config import LoraConfig
    from fusedserve.worker.lora_pool import LoraPool
    from fusedserve.worker.model.qwen3 import Qwen3Model
    from tests.model_batches import prompt_batch

    base_dir, dirs, _, _ = adapters
    prompt = [5, 17, 42, 99, 3, 8, 250, 1]
    hf = Qwen3ForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want_base = hf(torch.tensor([prompt])).logits[0, -1]
        want = PeftModel.from_pretrained(hf, dirs[0]).eval()(torch.tensor([prompt])).logits[0, -1]
    try:
        model = Qwen3Model.from_pretrained(base_dir, dtype="bfloat16", quantization=quantization)
    except ConfigError as exc:  # int4 needs the native CPU kernels
        pytest.skip(str(exc))
    pool = LoraPool(model, LoraConfig(enable_lora=True, max_loras=2))
    pool.load([[1, "a0#1", str(dirs[0])]])
    got = {}
    for slot in (-1, 1):
        kv, ws = model.new_kv_cache(num_blocks=8, block_size=4), model.new_workspace(max_rows=1, block_size=4)
        logits = torch.empty(1, model.config.vocab_size)
        batch = prompt_batch([prompt], [[0, 1]], 4)
        batch.lora_slots = torch.full((len(prompt),), slot, dtype=torch.int32)
        model.forward(batch, kv, ws, logits)
        got[slot] = logits[0]
    base_err = (got[-1] - want_base).abs().max().item()
    lora_err = (got[1] - want).abs().max().item()
    effect = want - want_base  # the adapter's change of the logits, and as the quantized model makes it
    made = got[1] - got[-1]
    cos = torch.nn.functional.cosine_similarity(made, effect, dim=0).item()
    print(f"{quantization}: base error {base_err:.3f}, with adapter {lora_err:.3f}; the adapter's change "
          f"made with cosine {cos:.3f}, norm {made.norm() / effect.norm():.3f} of its own")
    assert lora_err <= 2 * base_err + 0.02, (lora_err, base_err)
    assert cos > 0.9 and 0.8 < made.norm() / effect.norm() < 1.2
