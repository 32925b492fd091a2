"""PEFT LoRA adapters written by ``peft`` itself on a test checkpoint, and transformers + peft's
greedy output under each: the reference every LoRA test compares with."""

from __future__ import annotations

from pathlib import Path

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Adapter 0: rank 4 on every projection. Adapter 1: rank-stabilised rank 8 on three, layer 1 only.
ADAPTERS = [dict(r=4, lora_alpha=8, target_modules=ALL),
            dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                 layers_to_transform=[1])]


def write_adapter(base: Path, out: Path, seed: int, **lora: object) -> dict[str, torch.Tensor]:
    """Save a peft adapter with random A and B; return peft's merged weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(Qwen3ForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(out)
    return {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}


def peft_greedy(base: Path, adapters: dict[str, Path], prompts: list[list[int]], names: list[str | None],
                n: int) -> list[list[int]]:
    """Each prompt's ``n`` greedy tokens from transformers + peft under its adapter (None: none)."""
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    first, *rest = adapters.items()
    model = PeftModel.from_pretrained(hf, first[1], adapter_name=first[0]).eval()
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    out = []
    with torch.no_grad():
        for p, name in zip(prompts, names):
            kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            if name is None:
                with model.disable_adapter():
                    gen = model.generate(input_ids=torch.tensor([p]), **kw)
            else:
                model.set_adapter(name)
                gen = model.generate(input_ids=torch.tensor([p]), **kw)
            out.append(gen[0, len(p):].tolist())
    return out
