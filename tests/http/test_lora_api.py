"""LoRA adapters served: named by ``model`` through the official ``openai`` client and by ``lora``
over ZeroMQ, listed by ``/v1/models`` with their parent, loaded and unloaded while the server runs,
each output equal to the offline engine's under the same adapter (itself equal to transformers +
peft: tests/engine/test_lora_engine.py), with one slot for three adapters so that the served path
evicts and reloads; what cannot be served is refused with the reason, and nothing is lost."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from fusedserve.coordinator.client import Client, ServerError
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import TRAINED_DIR
from fusedserve.coordinator.sampling_params import SamplingParams
from tests.lora_adapters import ADAPTERS, write_adapter
from tests.support import running_server, serving_http

PROMPTS = ["the cat sat on the", "once upon a time there was", "the weather today is", "in the morning we"]
MODELS = ["default", "a0", "a1", "a0", "default", "a1", "a1", "a0"]
N = 16


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    base, root = TRAINED_DIR, tmp_path_factory.mktemp("lora_http")
    dirs = {"a0": root / "a0", "a1": root / "a1", "big": root / "big", "head": root / "head"}
    write_adapter(base, dirs["a0"], 0, **ADAPTERS[0])
    write_adapter(base, dirs["a1"], 1, **ADAPTERS[1])
    write_adapter(base, dirs["big"], 2, r=32, target_modules=["q_proj"])
    write_adapter(base, dirs["head"], 3, r=4, target_modules=["q_proj", "lm_head"])
    return dirs


@pytest.fixture(scope="module")
def expected(adapters) -> dict[tuple[str, str], str]:
    """The offline engine's greedy text of every (prompt, model)."""
    with LLMEngine("default", dtype="float32", enable_lora=True, max_loras=2) as eng:
        for name in ("a0", "a1"):
            eng.add_lora(name, adapters[name])
        out = {}
        for name in ("default", "a0", "a1"):
            got = eng.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0),
                               lora=None if name == "default" else name)
            out.update({(p, name): g.text for p, g in zip(PROMPTS, got)})
    assert all(out[p, "a0"] != out[p, "default"] for p in PROMPTS)  # the adapter changes the text
    return out


@pytest.fixture(scope="module")
def served(adapters, ray_session) -> Iterator[tuple[object, str]]:
    with running_server(dtype="float32", max_batch=8, enable_lora=True, max_loras=1, max_cpu_loras=1,
                        lora_modules=(f"a0={adapters['a0']}",)) as coord, serving_http(coord) as http:
        yield coord, http.url


def _complete(client: openai.OpenAI, model: str, prompt: str) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0).choices[0].text


def test_models_lists_adapters_with_their_parent_and_they_load_and_unload(served, adapters, expected):
    coord, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"default", "a0"}
    assert models["a0"].parent == "default" and models["a0"].root == str(adapters["a0"])
    assert _complete(client, "a0", PROMPTS[0]) == expected[PROMPTS[0], "a0"]
    with pytest.raises(openai.NotFoundError) as err:
        _complete(client, "a1", PROMPTS[0])
    assert err.value.body["code"] == "model_not_found"

    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(adapters["a1"])})
    assert r.status_code == 200, r.text
    assert {m.id for m in client.models.list().data} == {"default", "a0", "a1"}
    # A batch mixing the base model and both adapters, one slot for them: evictions, reloads, exact.
    jobs = [(m, PROMPTS[i % len(PROMPTS)]) for i, m in enumerate(MODELS)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _complete(client, *job), jobs))
    assert got == [expected[p, m] for m, p in jobs]
    assert _complete(client, "a0", PROMPTS[3]) == expected[PROMPTS[3], "a0"]
    assert coord.pool.workers[0].core.loras.loads >= 3  # a0, a1 over it, a0 back over a1
    lora = httpx.get(f"{url}/metrics").text
    assert 'fusedserve:lora_requests_info{max_lora="1",model_name="default"' in lora
    loads = float(re.search(r'^fusedserve:lora_loads_total\{[^}]*\} (\S+)$', lora, re.M).group(1))
    assert loads >= 3
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "a1" and chat.choices[0].message.content is not None

    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a1"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a1", PROMPTS[0])
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a1"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


REFUSALS = [("big", "rank 32; this server allows 16 (--max-lora-rank)"), ("head", "lm_head"),
            ("missing", "no readable adapter_config.json"), ("a0", "already loaded")]


@pytest.mark.parametrize(("name", "why"), REFUSALS)
def test_an_adapter_that_cannot_be_served_is_refused_with_its_reason(served, adapters, name, why):
    _, url = served
    path = str(adapters.get(name, Path("/nonexistent")))
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert "big" not in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}


def test_zeromq_requests_name_the_adapter_in_lora(served, expected):
    coord, _ = served
    with Client(coord.address) as client:
        done = client.generate(PROMPTS[1], lora="a0", max_tokens=N, temperature=0.0)
        assert done["text"] == expected[PROMPTS[1], "a0"]
        assert [a["id"] for a in client.loras()] == ["a0"]
        with pytest.raises(ServerError) as err:
            client.generate(PROMPTS[1], lora="nope", max_tokens=2)
        assert err.value.code == "model_not_found"
        with pytest.raises(ServerError) as err:
            client.generate(PROMPTS[1], lora=7, max_tokens=2)
        assert err.value.code == "bad_field"
        # The loop lost nothing: the next request is served.
        done = client.generate(PROMPTS[2], max_tokens=N, temperature=0.0)
        assert done["text"] == expected[PROMPTS[2], "default"]


def test_loading_needs_the_admin_token_where_the_server_has_one(adapters, ray_session):
    admin = "admin-token-" + "x" * 20
    with running_server(dtype="float32", enable_lora=True, admin_token=admin) as coord, \
            serving_http(coord) as http:
        body = {"lora_name": "a0", "lora_path": str(adapters["a0"])}
        r = httpx.post(f"{http.url}/v1/load_lora_adapter", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        url = f"{http.url}/v1/load_lora_adapter"
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert [m["id"] for m in httpx.get(f"{http.url}/v1/models").json()["data"]] == ["default"]
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 200, r.text
        with Client(coord.address) as client:  # over ZeroMQ too: an admin frame without the token
            with pytest.raises(ServerError) as err:
                client.unload_lora("a0")
            assert err.value.code == "unauthorized"
        with Client(coord.address, admin_token=admin) as client:
            assert client.unload_lora("a0") == []
