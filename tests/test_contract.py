"""The argument contract: only HOST_SHARED outputs come back, and they are counted."""

from __future__ import annotations

import copy

import pytest
import torch

from coordinator.engine.batch_io import read_result, write_batch
from coordinator.engine.llm_engine import LLMEngine
from coordinator.sampling_params import SamplingParams
from shared_memory.contract import RunnerConfig
from shared_memory.runtime import DeviceScratchPool, LaunchRuntime
from shared_memory.slots import Placement, SlotError, decode_table

K = 16


@pytest.fixture(scope="module")
def engine():
    # The host-sampling fallback: its candidates and logits rows are what this file counts.
    rc = RunnerConfig(max_batch=16, num_blocks=128, block_size=8, top_k=K, device_sampling=False)
    with LLMEngine("default", runner=rc) as eng:
        eng.runtime.keep_history = 10_000
        yield eng


def test_greedy_logits_and_hidden_are_device_resident():
    t = decode_table()
    outs = {s.name: s.placement for s in t if s.writes}
    assert outs["sampled_ids"] is Placement.HOST_SHARED
    assert outs["logits"] is Placement.DEVICE_RESIDENT
    assert outs["next_hidden"] is Placement.DEVICE_RESIDENT
    assert outs["all_topk_values"] is Placement.DEVICE_RESIDENT


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
    outs = engine.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [14] * 6 + [8] * 6 + [5] * 4
    decode = [r for r in engine.runtime.history if r.table == "decode"]
    assert decode, "no decode launches recorded"
    seen = set()
    for r in decode:
        b, nt, nf = r.dims["B"], r.dims["NT"], r.dims["NF"]
        # Rows active at this step: greedy rows while < 14 tokens, top-K while < 8, full while < 5.
        assert r.d2h_bytes == b * 4 + nt * K * (4 + 4) + nf * vocab * 4
        seen.add((b, nt, nf))
    assert (16, 6, 4) in seen  # the whole mixed batch decoding together
    assert (12, 6, 0) in seen  # full-logits rows done: their bytes stop with them
    assert (6, 0, 0) in seen  # greedy alone: ids only
    greedy_only = [r for r in decode if r.dims["NT"] == 0 and r.dims["NF"] == 0]
    assert greedy_only and all(r.d2h_bytes == r.dims["B"] * 4 for r in greedy_only)
    # The anchor's old per-step logits copy would have been B x vocab x 4 for every step.
    assert all(r.d2h_bytes < r.dims["B"] * vocab * 4 for r in greedy_only)
    stats = engine.runtime.counters.as_dict()
    assert stats["d2h_bytes"]["decode"] >= sum(r.d2h_bytes for r in decode)


def test_runtime_outputs_equal_direct_kernel_call(engine):
    sched = engine.core.scheduler
    params = [SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, top_k=5, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=20, logprobs=True, ignore_eos=True)]
    for i, p in enumerate(params):
        sched.add(f"s{i}", engine.encode(f"prompt number {i}"), p)
    for _ in range(4):  # prefill + a few decode steps
        engine.core.step()
    batch = sched.schedule()
    assert batch.kind == "decode"
    c = engine.model.config
    kv_before = engine.runner.kv.data.clone()
    desc = write_batch(engine.arena, batch, sched.steps, K, c.vocab_size, c.hidden_size)
    engine.runner.execute(desc)
    res = read_result(engine.arena, desc)

    kv = copy.copy(engine.runner.kv)
    kv.data = kv_before
    model = engine.model
    ws = model.new_workspace(4, engine.rc.block_size, K)
    out = model.new_outputs(4, K)
    model.decode_step(torch.from_numpy(batch.token_ids), torch.from_numpy(batch.positions),
                      torch.from_numpy(batch.block_tables), torch.from_numpy(batch.seq_lens),
                      torch.from_numpy(batch.slot_mapping), kv, ws, out, ctx_len=batch.ctx_len)
    b = batch.batch_size
    assert res.sampled_ids.tolist() == out.greedy_ids[:b].tolist()
    assert res.topk_rows == [1] and res.full_rows == [2]
    assert torch.equal(torch.from_numpy(res.topk_values[0]), out.topk_values[1])
    assert torch.equal(torch.from_numpy(res.topk_ids[0]), out.topk_ids[1])
    assert torch.equal(torch.from_numpy(res.logits[0]), out.logits[2])
    assert torch.equal(kv.data, engine.runner.kv.data)


def test_row_without_ids_or_logits_names_request_and_step():
    from coordinator.engine.step_outputs import DecodeResult, MissingRowError

    res = DecodeResult(step=12, sampled_ids=None)
    with pytest.raises(MissingRowError, match="request 'req-9', step 12"):
        res.greedy_id(0, "req-9")
    with pytest.raises(MissingRowError, match="request 'req-9', step 12: row 3 has no candidates"):
        res.candidates(3, "req-9")


def test_mismatched_tensors_are_refused_before_any_launch(engine):
    t = decode_table()
    with pytest.raises(SlotError, match=r"slot 'token_ids': shape \(3,\) != declared \(4,\)"):
        t.check_all({"token_ids": torch.zeros(3, dtype=torch.int32)}, {"B": 4})
    with pytest.raises(SlotError, match="slot 'positions': dtype torch.int64 != declared torch.int32"):
        t.check_all({"positions": torch.zeros(4, dtype=torch.int64)}, {"B": 4})
    with pytest.raises(SlotError, match="no slot 'bogus'"):
        t.check_all({"bogus": torch.zeros(1)}, {"B": 1})
    runner = engine.runner
    bad_hidden = torch.zeros(runner.rc.max_batch, 3, dtype=engine.model.dtype)
    with pytest.raises(SlotError, match="slot 'next_hidden'"):
        DeviceScratchPool(runner.tables, runner.max_dims, adopt={"next_hidden": bad_hidden})
    wrong_dtype = runner.pool.full("sampled_ids").to(torch.int64)
    pool = DeviceScratchPool(runner.tables, runner.max_dims)
    pool._tensors["sampled_ids"] = wrong_dtype
    with pytest.raises(SlotError, match="slot 'sampled_ids': dtype torch.int64"):
        LaunchRuntime(runner.tables, engine.arena, pool)
    called = []
    dims = dict(runner.max_dims, B=runner.rc.max_batch + 1, NT=0, NF=0)
    with pytest.raises(SlotError, match="outside the allocated"):
        runner.runtime.launch("decode", dims, lambda v, d: called.append(1))
    assert called == []
