"""The argument contract: only HOST_SHARED outputs come back, and they are counted."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fusedserve.coordinator.engine.batch_io import read_outputs, write_batch
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.forward_batch import ForwardBatch
from fusedserve.shared_memory.slots import Placement, SlotError, step_table
from fusedserve.worker.launch_runtime import LaunchRuntime
from fusedserve.worker.scratch_pool import DeviceScratchPool

K = 16


@pytest.fixture(scope="module")
def engine():
    rc = dict(max_batch=16, num_blocks=128, block_size=8, sampler_candidates=K)
    with LLMEngine("default", **rc) as eng:
        eng.runtime.keep_history = 10_000
        yield eng


def test_ids_come_back_and_logits_stay_on_the_device():
    t = step_table()
    outs = {s.name: s.placement for s in t if s.writes}
    assert outs["sampled_ids"] is Placement.HOST_SHARED
    assert outs["logits"] is Placement.DEVICE_RESIDENT
    assert all(p is Placement.HOST_SHARED for n, p in outs.items() if n != "logits"), \
        "only ids and asked-for logprobs are host-shared outputs"


def test_d2h_bytes_per_step_for_a_mixed_batch_of_16(engine):
    vocab = engine.model.config.vocab_size
    greedy = [SamplingParams(max_tokens=14, ignore_eos=True) for _ in range(6)]
    topk = [SamplingParams(max_tokens=8, temperature=0.8, top_k=8, seed=i, ignore_eos=True)
            for i in range(6)]
    full = [SamplingParams(max_tokens=5, temperature=0.8, top_k=0, seed=i, ignore_eos=True)
            for i in range(4)]
    params = greedy + topk + full
    prompts = [f"request {i} says hello" for i in range(16)]
    engine.runtime.history.clear()
    before = engine.runtime.counters.as_dict()["d2h_bytes"].get("decode", 0)
    outs = engine.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [14] * 6 + [8] * 6 + [5] * 4
    decode = [r for r in engine.runtime.history if r.kind == "decode"]
    assert decode, "no decode launches recorded"
    seen = set()
    for r in decode:
        # Every kind is sampled on the device: ids only, whatever the mix.
        assert r.d2h_bytes == r.dims["B"] * 4
        seen.add(r.dims["B"])
    assert {16, 12, 6} <= seen  # the whole mixed batch, then without its full-vocabulary rows, greedy alone
    # The anchor's old per-step logits copy would have been B x vocab x 4 for every step.
    assert all(r.d2h_bytes < r.dims["B"] * vocab * 4 for r in decode)
    stats = engine.runtime.counters.as_dict()
    assert stats["d2h_bytes"]["decode"] == before + sum(r.d2h_bytes for r in decode)


def test_runtime_outputs_equal_direct_kernel_call(engine):
    sched = engine.core.scheduler
    params = [SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, top_k=5, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=20, logprobs=True, ignore_eos=True)]
    for i, p in enumerate(params):
        engine.add_request(f"prompt number {i}", p, f"s{i}")
    for _ in range(4):  # prefill + a few decode steps
        engine.core.step()
    while engine.core.inflight:
        engine.core.finish(engine.core.executor.wait())
    batch = sched.schedule()
    assert batch.num_decode == batch.batch_size == 3
    c = engine.model.config
    kv_before = engine.runner.kv.data.clone()
    desc, plan = write_batch(engine.arenas[0], batch, sched.steps, 0, K, c.vocab_size)
    engine.runner.execute(desc)
    res = read_outputs(engine.arenas[0], desc, plan)

    kv = copy.copy(engine.runner.kv)
    kv.data = kv_before
    model = engine.model
    ws = model.new_workspace(4, engine.config.cache.block_size)
    logits = torch.empty(3, c.vocab_size)
    qsl = torch.from_numpy(batch.query_start_loc)
    model.forward(ForwardBatch(torch.from_numpy(batch.token_ids), torch.from_numpy(batch.positions),
                               torch.from_numpy(batch.slot_mapping), qsl, torch.from_numpy(batch.seq_lens),
                               torch.from_numpy(batch.block_tables), num_decode=3), kv, ws, logits)
    assert res.sampled_ids[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    assert res.logprob_rows == [2]
    assert res.sampled_logprobs[0] == pytest.approx(float(torch.log_softmax(logits[2].double(), -1).max()))
    assert torch.equal(kv.data, engine.runner.kv.data)


def test_row_without_its_outputs_names_request_and_step():
    from fusedserve.coordinator.engine.step_outputs import MissingRowError, StepOutputs

    res = StepOutputs(step=12, sampled_ids=np.zeros(0, dtype=np.int32))
    with pytest.raises(MissingRowError, match="request 'req-9', step 12"):
        res.token(0, "req-9")
    with pytest.raises(MissingRowError, match="request 'req-9', step 12: row 3 has no logprobs"):
        res.logprobs(3, "req-9", 2)


def test_mismatched_tensors_are_refused_before_any_launch(engine):
    t = step_table()
    with pytest.raises(SlotError, match=r"slot 'token_ids': shape \(3,\) != declared \(4,\)"):
        t["token_ids"].check(torch.zeros(3, dtype=torch.int32), {"T": 4})
    with pytest.raises(SlotError, match="slot 'positions': dtype torch.int64 != declared torch.int32"):
        t["positions"].check(torch.zeros(4, dtype=torch.int64), {"T": 4})
    with pytest.raises(SlotError, match="no slot 'bogus'"):
        t["bogus"]
    runner = engine.runner
    wrong_dtype = runner.pool.full("sampled_ids").to(torch.int64)
    pool = DeviceScratchPool(runner.table, runner.max_dims)
    pool._tensors["sampled_ids"] = wrong_dtype
    with pytest.raises(SlotError, match="slot 'sampled_ids': dtype torch.int64"):
        LaunchRuntime(runner.table, engine.arenas[0], pool)
    called = []
    dims = dict(runner.max_dims, B=runner.cfg.scheduler.max_batch + 1)
    with pytest.raises(SlotError, match="outside the allocated"):
        runner.runtime.launch(dims, lambda v: called.append(1))
    assert called == []


def test_a_launch_reuses_its_copy_plan_and_moves_only_nonempty_slots(engine):
    """Launches of the same dims and bank share one copy plan (the views and checks are built
    once); a new bank or new dims gets its own; empty slots are never copied, and the counted
    bytes are the declared ones."""
    runtime = engine.runner.runtime
    dims = {k: 0 for k in engine.runner.max_dims}
    dims.update(B=2, B1=3, T=2, W=1, V=engine.runner.max_dims["V"], N=2)
    seen = []
    first = runtime.launch(dims, seen.append)
    second = runtime.launch(dict(dims), seen.append)
    assert seen[0] is seen[1] and runtime.plan(dims, 0) is runtime.plan(dict(dims), 0)
    assert runtime.plan(dims, 1) is not runtime.plan(dims, 0)
    assert runtime.plan(dict(dims, W=2), 0).views["block_tables"].shape == (2, 2)
    plan = runtime.plan(dims, 0)
    table = engine.runner.table
    moved = {id(dst) for dst, _ in plan.inputs}
    for slot in table.host_inputs():
        assert (id(plan.views[slot.name]) in moved) == (slot.nbytes(dims) > 0), slot.name
    assert first.h2d_bytes == second.h2d_bytes == sum(s.nbytes(dims) for s in table.host_inputs())
    assert first.d2h_bytes == sum(s.nbytes(dims) for s in table.host_outputs())
