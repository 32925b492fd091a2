"""A Qwen3.5-shaped hybrid checkpoint served by ``fusedserve serve MODEL --port``, through the
openai client: the startup line states the recurrent states, a chat completes, a forced tool call
comes back parsed, and an image part gets a 400 naming the limitation."""

from __future__ import annotations

import json
import shutil
import socket

import openai
import pytest
import torch

from fusedserve.coordinator.model_files.default_model import default_model_dir
from tests.serve_proc import ServeProcess

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    """Random Qwen3.5 weights (3 Gated DeltaNet layers, 1 gated attention layer) over the embedded
    model's tokenizer and chat template (its 4096-token vocabulary)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            max_position_embeddings=1024, eos_token_id=0, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("qwen35")
    Qwen3_5ForCausalLM(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, path / name)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hybrid_checkpoint_serves_chat_and_tool_calls(ray_session, qwen35_dir, tmp_path):
    proc = ServeProcess.start(tmp_path / "serve.log", str(qwen35_dir), "--port", str(_free_port()),
                              "--dtype", "float32", "--max-num-seqs", "4", "--kv-cache-memory", "64MiB",
                              "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                              "--reasoning-parser", "qwen3")
    try:
        log = "\n".join(proc.lines) + (tmp_path / "serve.log").read_text()
        assert "recurrent states" in log and "x 9 slots" in log, "4 running, a spare, 4 snapshots"
        client = openai.OpenAI(base_url=f"{proc.http}/v1", api_key="none")
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=12)
        assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 12
        forced = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=256,
            temperature=0)
        call = forced.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        with pytest.raises(openai.BadRequestError, match="text model"):
            client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
        again = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=12, temperature=0)
        assert again.choices[0].message.content is not None or again.choices[0].message.reasoning_content
    finally:
        proc.stop()
