"""Per-request fault isolation: extreme sampling values and a request that fails while
sampling end that request alone; the loop and every other request go on unharmed."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusedserve.coordinator.client import Client, ServerError
from fusedserve.coordinator.engine.block_manager import BlockManager
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.engine.scheduler import Scheduler
from fusedserve.coordinator.engine.step_outputs import StepOutputs
from fusedserve.coordinator.sampling_params import SamplingError, SamplingParams
from tests.engine.test_sampling import draw
from tests.support import queue, read_step, settled, wait_for

RC = dict(max_batch=8, block_size=8, num_blocks=96, sampler_candidates=16)
PROPS = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
any_float = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True) | st.integers(-5, 300)
extreme = st.sampled_from([5e-324, 2.2250738585072014e-308, 1e-300, 1e-7, 1e-5, 1e300, math.inf, -0.0, 100.0])
sampling_fields = st.fixed_dictionaries({
    "temperature": any_float | extreme,
    "top_p": any_float | extreme,
    "top_k": st.integers(0, 2000),
    "seed": st.integers(0, 2**64 - 1),
})


def _params_or_none(fields: dict) -> SamplingParams | None:
    try:
        return SamplingParams(max_tokens=4, **fields)
    except SamplingError:
        return None


@PROPS
@given(sampling_fields, st.sampled_from(["normal", "flat", "spiky", "neg_inf"]), st.integers(0, 50))
def test_sample_is_total_over_the_float_range(fields, shape, step):
    p = _params_or_none(fields)
    t, top_p = float(fields["temperature"]), float(fields["top_p"])
    accepted = math.isfinite(t) and 0 <= t <= 100 and math.isfinite(top_p) and 0 < top_p <= 1 and not (
        0 < abs(t) < 2.2250738585072014e-308 or 0 < abs(top_p) < 2.2250738585072014e-308)
    assert (p is not None) == accepted, fields
    if p is None:
        return
    rng = np.random.default_rng(step)
    values = {"normal": rng.normal(0, 3, 64), "flat": np.zeros(64), "spiky": rng.normal(0, 1e4, 64),
              "neg_inf": np.where(rng.random(64) < 0.9, -np.inf, rng.normal(0, 3, 64))}[shape]
    values[0] = max(values[0], 0.0)  # at least one finite logit, as a model always has
    ids = rng.permutation(1000)[:64]
    token = draw(values.astype(np.float32), ids, p, step)
    assert token in ids.tolist()
    assert np.isfinite(values[ids.tolist().index(token)]), "an impossible (-inf) token was drawn"


def test_a_row_that_fails_while_sampling_fails_alone():
    blocks = BlockManager(num_blocks=16, block_size=4)
    s = Scheduler(blocks, max_model_len=64, max_batch=4)
    ok = queue(s, "ok", [1, 2, 3], SamplingParams(max_tokens=4))
    bad = queue(s, "bad", [4, 5],
                SamplingParams(max_tokens=4, temperature=0.5, top_k=4, seed=1, logprobs=True))
    batch = s.schedule()
    # The launch returned ids but no logprobs for the row that asked for them: it cannot be read.
    events = read_step(s, batch, StepOutputs(step=1, sampled_ids=np.array([7, 9], dtype=np.int32)))
    by_id = {ev.seq.seq_id: ev for ev in events}
    assert by_id["ok"].token == 7 and by_id["ok"].error is None and ok.output_ids == [7]
    assert by_id["bad"].error is not None and by_id["bad"].error.code == "sampling_error"
    assert "request 'bad'" in str(by_id["bad"].error) and bad.finish_reason == "error"
    assert s.running == [ok] and blocks.num_used == 1  # the failed row's blocks are back


def test_offline_engine_isolates_a_failing_request():
    prompts = ["bystander one", "the broken one", "bystander two"]
    good = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLMEngine("default", dtype="float32", **RC) as eng:
        want = eng.generate([prompts[0], prompts[2]], good)
        broken = SamplingParams(max_tokens=12, temperature=0.8, top_k=5, seed=3, ignore_eos=True)
        broken.temperature = "hot"  # a bug past validation: sampling raises for this row
        outs = eng.generate(prompts, [good, broken, good])
        assert eng.core.scheduler.blocks.num_used == 0
    assert outs[1].finish_reason == "error" and "sampling_error" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == [o.token_ids for o in want]


SERVER = dict(**RC, dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def bystander_want():
    with LLMEngine("default", dtype="float32", **RC, max_model_len=256) as eng:
        out = eng.generate(["a bystander stream"], SamplingParams(max_tokens=120, ignore_eos=True))
    return out[0].token_ids


def _bystander(address: str, box: dict) -> threading.Thread:
    def run() -> None:
        with Client(address, timeout_s=300) as c:
            box["frames"] = list(c.stream("a bystander stream", max_tokens=120, ignore_eos=True))
    t = threading.Thread(target=run)
    t.start()
    return t


@PROPS
@given(sampling_fields)
def _fuzz_extremes(address, fields):
    with Client(address, timeout_s=60) as c:
        try:
            out = c.generate("extreme values", max_tokens=3, ignore_eos=True, **fields)
        except ServerError as exc:
            assert exc.code == "bad_param", exc.reply
            assert _params_or_none(fields) is None
            return
    assert _params_or_none(fields) is not None
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 3


def test_extreme_sampling_values_through_a_running_server(server, bystander_want):
    box: dict = {}
    t = _bystander(server.address, box)
    _fuzz_extremes(server.address)
    t.join(timeout=300)
    frames = box["frames"]
    assert [f["token"] for f in frames if f["type"] == "token"] == bystander_want
    assert frames[-1]["type"] == "done" and frames[-1]["token_ids"] == bystander_want
    assert server.alive()
    with Client(server.address) as c:
        stats = settled(c)
    assert stats["faults"]["request_errors"] == 0


def test_a_request_failing_mid_stream_fails_alone(server, bystander_want):
    box: dict = {}
    t = _bystander(server.address, box)
    with Client(server.address, timeout_s=120) as c:
        frames = c.stream("the broken one", request_id="victim", max_tokens=100, temperature=0.8, top_k=5,
                          seed=1, ignore_eos=True)
        assert next(frames)["type"] == "token"
        victim = next(r for r in server.requests if r.client_id == "victim")
        victim.seq.params.temperature = "hot"  # a bug past validation, in this request only
        with pytest.raises(ServerError) as err:
            for _ in frames:
                pass
        assert err.value.code == "sampling_error"
        t.join(timeout=300)
        assert [f["token"] for f in box["frames"] if f["type"] == "token"] == bystander_want
        wait_for(lambda: c.stats()["faults"]["request_errors"] == 1, 10, "the fault to be counted")
        stats = settled(c)
    assert stats["completed"] >= 1 and server.alive()
