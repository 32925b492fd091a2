"""Tensor-parallel workers served through Ray: two actors with gloo behind one step socket.

Served greedy output equals one device's and transformers'; other requests ride along; only rank 0
copies ids back; a rank killed mid-stream gets its group replaced with every stream exact; a MoE
model is served with its experts placed whole across the group."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.server.server import Server
from fusedserve.shared_memory.arena import pid_alive
from tests.support import running_server, wait_for

RC = dict(max_batch=8, block_size=4, num_blocks=160, sampler_candidates=8)
PROMPTS = [[5, 17, 42, 99, 3], [250, 1, 8], [77] * 11, list(range(30, 60)), [9, 9, 1], [100, 200, 300]]
TOKENS = 64  # streams long enough to be running when a rank is killed
PARAMS = [{"max_tokens": TOKENS, "ignore_eos": True} if i % 2 == 0 else
          {"max_tokens": TOKENS, "temperature": 0.9, "top_k": 6, "seed": 11 + i, "ignore_eos": True}
          for i in range(len(PROMPTS))]


def _offline(path, loras: list[str | None] | None = None, **kw) -> list[list[int]]:
    """Each prompt's output from one device (``loras``: each request's adapter, registered by ``kw``)."""
    loras = loras or [None] * len(PROMPTS)
    with LLMEngine(path, dtype="float32", **RC, **kw) as eng:
        return [eng.generate([p], SamplingParams(**params), lora=lo)[0].token_ids
                for p, params, lo in zip(PROMPTS, PARAMS, loras)]


def _serve(path, **kw):
    return running_server(model=str(path), **RC, dtype="float32", max_model_len=256, tensor_parallel_size=2,
                          **kw)


def _streams(coord: Server, progressed: threading.Semaphore | None = None,
             loras: list[str | None] | None = None):
    """Every prompt streamed at once (``loras``: each one's adapter); returns (frames per request,
    errors)."""
    frames: dict[int, list[dict]] = {i: [] for i in range(len(PROMPTS))}
    errors: dict[int, BaseException] = {}

    def one(i: int) -> None:
        try:
            with Client(coord.address, timeout_s=300) as c:
                extra = {} if loras is None or loras[i] is None else {"lora": loras[i]}
                for f in c.stream(PROMPTS[i], **PARAMS[i], **extra):
                    frames[i].append(f)
                    if progressed is not None and f.get("index") == 3:
                        progressed.release()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions
            errors[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    return frames, errors, threads


def _check_exact(frames, errors, want) -> None:
    assert not errors, errors
    for i, w in enumerate(want):
        tokens = [f for f in frames[i] if f["type"] == "token"]
        dones = [f for f in frames[i] if f["type"] == "done"]
        assert len(dones) == 1 and frames[i][-1] is dones[0], f"request {i} finished exactly once"
        assert [f["index"] for f in tokens] == list(range(len(tokens))), f"request {i}: no repeats"
        assert [f["token"] for f in tokens] == dones[0]["token_ids"] == w, f"request {i}"


def test_tp2_serves_what_one_device_and_transformers_generate(ray_session, hf_checkpoints):
    path = hf_checkpoints["gqa2_untied"]
    want = _offline(path)
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for i in range(0, len(PROMPTS), 2):  # the greedy ones
            ref = hf.generate(torch.tensor([PROMPTS[i]]), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                              do_sample=False, pad_token_id=0)[0, len(PROMPTS[i]):].tolist()
            assert ref == want[i]
    with _serve(path) as coord:
        (w,) = coord.workers
        assert len(w.info["ranks"]) == 2 and len({r["pid"] for r in w.info["ranks"]}) == 2
        frames, errors, threads = _streams(coord)
        for t in threads:
            t.join(timeout=300)
        _check_exact(frames, errors, want)
        stats = Client(coord.address).stats()
        last = stats["workers"][0]["last_decode"]
        assert last["d2h"] == 4 * last["batch"], "ids only: rank 0's, B x 4 bytes"


@pytest.mark.parametrize("rank", [1, 0], ids=["peer-killed", "leader-killed"])
def test_a_rank_killed_mid_stream_replaces_its_group(ray_session, hf_checkpoints, rank):
    path = hf_checkpoints["gqa2_untied"]
    want = _offline(path)
    with _serve(path, step_timeout_s=60) as coord:
        progressed = threading.Semaphore(0)
        frames, errors, threads = _streams(coord, progressed)
        for _ in PROMPTS:
            assert progressed.acquire(timeout=120), "every stream has 4 tokens before the fault"
        victim = coord.workers[0]
        pids = [r["pid"] for r in victim.info["ranks"]]
        t_kill = time.time()
        os.kill(pids[rank], signal.SIGKILL)
        wait_for(lambda: coord.pool.failures, 60, "the coordinator to notice")
        failure = coord.pool.failures[0]
        print(f"rank {rank} killed: group loss noticed after {failure.at - t_kill:.3f} s: {failure.reason}")
        assert failure.worker_id == victim.worker_id and failure.requests > 0, failure
        for t in threads:
            t.join(timeout=300)
        _check_exact(frames, errors, want)
        wait_for(lambda: len(coord.pool.active) == 1, 120, "the replacement group")
        assert coord.workers[0].worker_id != victim.worker_id
        wait_for(lambda: not any(pid_alive(p) for p in pids), 30, "every rank of the lost group to be gone")


def test_adapters_served_by_a_group_survive_a_rank_killed_mid_stream(ray_session, hf_checkpoints, tmp_path):
    """Each rank holds its share of every adapter (A whole and B's rows for q/k/v and gate/up, A's
    columns for o and down, summed by the layer's all-reduce): TP=2 equals one device, and after a
    rank is killed the replacement group reads the adapters again and every stream ends exactly."""
    from tests.lora_adapters import ADAPTERS, write_adapter

    path = hf_checkpoints["gqa2_untied"]
    for i in range(2):
        write_adapter(path, tmp_path / f"a{i}", i, **ADAPTERS[i])
    modules = tuple(f"a{i}={tmp_path / f'a{i}'}" for i in range(2))
    loras = [None, "a0", "a1", "a0", "a1", None]
    lora = dict(enable_lora=True, max_loras=2, lora_modules=modules)
    want = _offline(path, loras, **lora)
    assert want != _offline(path)
    with _serve(path, step_timeout_s=60, **lora) as coord:
        progressed = threading.Semaphore(0)
        frames, errors, threads = _streams(coord, progressed, loras)
        for _ in PROMPTS:
            assert progressed.acquire(timeout=120), "every stream has 4 tokens before the fault"
        victim = coord.workers[0]
        os.kill(victim.info["ranks"][1]["pid"], signal.SIGKILL)
        wait_for(lambda: coord.pool.failures, 60, "the coordinator to notice")
        for t in threads:
            t.join(timeout=300)
        _check_exact(frames, errors, want)
        assert coord.workers[0].worker_id != victim.worker_id and coord.workers[0].core.loras.loads >= 1


def _break_first_layer(actor) -> None:
    """Run inside a rank: its next launch raises (as a failure of that device alone would)."""
    actor.runner.model.w.layers[0].qkv = None


def test_a_launch_failing_on_one_rank_replaces_the_group(ray_session, hf_checkpoints):
    """A rank whose launch raises is out of step with the others' collectives: it leaves, the
    group is replaced, and every stream still ends exactly."""
    import ray

    path = hf_checkpoints["gqa2_untied"]
    want = _offline(path)
    with _serve(path) as coord:
        victim = coord.workers[0]
        ray.get(victim.group.actors[1].__ray_call__.remote(_break_first_layer))
        frames, errors, threads = _streams(coord)
        wait_for(lambda: coord.pool.failures, 60, "the coordinator to notice")
        for t in threads:
            t.join(timeout=300)
        _check_exact(frames, errors, want)
        assert coord.pool.failures[0].worker_id == victim.worker_id


@pytest.mark.parametrize("ep", [False, True], ids=["experts-split", "expert-parallel"])
def test_a_moe_model_is_served_by_a_group(ray_session, moe_dir, ep):
    want = _offline(moe_dir)
    with _serve(moe_dir, enable_expert_parallel=ep) as coord:
        frames, errors, threads = _streams(coord)
        for t in threads:
            t.join(timeout=300)
        _check_exact(frames, errors, want)
