"""A tiny Qwen3 checkpoint that really thinks and calls tools: fitted in seconds, with
transformers, to a few fixed chats rendered by Qwen3's chat template (``<think>`` blocks,
Hermes ``<tool_call>`` blocks, and a turn with thinking off), so the reasoning and tool-call
parsers are tested on what a model emits, not on strings a test wrote into a mock."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer

from fusedserve.coordinator.model_files.default_model import CHAT_TEMPLATE, resolve_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def _call(city: str) -> str:
    body = json.dumps({"name": "get_weather", "arguments": {"city": city}})
    return f"<tool_call>\n{body}\n</tool_call>"


# (messages, tools, enable_thinking, the assistant's reply as the model is fitted to write it)
CHATS = [
    ([{"role": "user", "content": "What is the weather in Paris?"}], TOOLS, True,
     "<think>\nThe user asks for the weather. I call the tool.\n</think>\n\n" + _call("Paris")),
    ([{"role": "user", "content": "Compare the weather in Oslo and Rome."}], TOOLS, True,
     "<think>\nTwo cities, two calls.\n</think>\n\n" + _call("Oslo") + "\n" + _call("Rome")),
    ([{"role": "user", "content": "Say hello."}], None, True,
     "<think>\nA greeting is asked.\n</think>\n\nHello there, friend!"),
    ([{"role": "user", "content": "Say hello."}], None, False, "Hello there, friend!"),
    ([{"role": "user", "content": "Should I check the weather in Lima?"}], TOOLS, True,
     "<think>\nI could write " + _call("Lima") + " but it is not needed.\n</think>\n\n"
     "No need: just look outside."),
    ([{"role": "user", "content": "Weather in Kyiv, tersely."}], TOOLS, False, _call("Kyiv")),
    ([{"role": "user", "content": "Describe a cat as JSON."}], None, True,
     '<think>\nA cat object.\n</think>\n\n{"name": "Tom", "legs": 4}'),
]


def write_agent_model(out: Path, steps: int = 400) -> Path:
    """Write the fitted checkpoint into ``out`` (a Hugging Face model directory)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fusedserve.coordinator.openai.chat_template import ChatTemplate

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(resolve_model("default") / "tokenizer.json"))
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])  # as Qwen3's are
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None}))
    template = ChatTemplate.from_dir(out)
    im_end = tok.token_to_id("<|im_end|>")
    rows = []
    for messages, tools, thinking, reply in CHATS:
        kwargs = {"tools": tools} if tools else {}
        if not thinking:
            kwargs["enable_thinking"] = False
        prompt = tok.encode(template.render(messages, True, **kwargs), add_special_tokens=False).ids
        answer = tok.encode(reply, add_special_tokens=False).ids + [im_end]
        rows.append((prompt, answer))
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=4160, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True,
                         max_position_embeddings=1024, eos_token_id=im_end, bos_token_id=None,
                         pad_token_id=None)
    model = Qwen3ForCausalLM(config)
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (p, a) in enumerate(rows):
        seq = p + a
        ids[r, : len(seq)] = torch.tensor(seq)
        labels[r, len(p) : len(seq)] = torch.tensor(a)
        mask[r, : len(seq)] = 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:
            break
    model.save_pretrained(out)
    return out
