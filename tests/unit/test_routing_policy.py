"""The routing policy (coordinator/server/routing_policy.py), model-free: a request goes to the
worker holding its prefix (exact, from the block managers), or its session's last worker, within a
load bound. The served half is tests/server/test_routing.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from fusedserve.coordinator.engine.block_manager import BlockManager, prefix_hashes
from fusedserve.coordinator.engine.lora_registry import ServedAdapter
from fusedserve.coordinator.engine.lora_slots import LoraSlots
from fusedserve.coordinator.engine.sequence import Sequence
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.server.routing_policy import RoutingConfig, RoutingPolicy

BS = 4


@dataclass
class _Scheduler:  # what the policy reads of a worker's scheduler: its load and its block manager
    blocks: BlockManager
    load: int = 0
    tokens_scheduled: int = 0


@dataclass
class _Core:  # what the policy reads of a worker's engine core: its LoRA slots
    loras: LoraSlots | None = None


@dataclass
class _Worker:
    worker_id: str
    scheduler: _Scheduler
    core: _Core = field(default_factory=_Core)


def _workers(n: int, num_blocks: int = 64) -> list[_Worker]:
    return [_Worker(f"w{i}", _Scheduler(BlockManager(num_blocks, BS))) for i in range(n)]


def _cache(w: _Worker, tokens: list[int], seq_id: str = "s") -> None:
    """Compute ``tokens`` on ``w`` (allocate and commit every full block), then free them: cached."""
    b = w.scheduler.blocks
    b.allocate(seq_id, tokens)
    b.commit(seq_id, tokens, len(tokens))
    b.free(seq_id)


def _seq(tokens: list[int], session: str | None = None, **params: object) -> Sequence:
    return Sequence("q", list(tokens), SamplingParams(**params), session=session)


PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks a hit may cover


def test_cached_run_counts_leading_blocks_in_use_or_cached_and_stops_at_a_miss():
    b = BlockManager(32, BS)
    hashes = prefix_hashes(PROMPT, BS)
    assert len(hashes) == 4 and b.cached_run(hashes) == 0
    b.allocate("a", PROMPT[:12])
    b.commit("a", PROMPT[:12], 12)  # in use: 3 blocks named
    assert b.cached_run(hashes) == 3
    b.free("a")  # unreferenced, still cached
    assert b.cached_run(hashes) == 3
    assert b.cached_run(prefix_hashes([7] + PROMPT[1:], BS)) == 0, "a different first block: no run"
    assert BlockManager(32, BS, enable_prefix_caching=False).cached_run(hashes) == 0


def test_a_sequences_hashes_are_the_ones_its_blocks_are_committed_under():
    b = BlockManager(32, BS)
    _ = b.allocate("a", PROMPT), b.commit("a", PROMPT, len(PROMPT))
    seq = _seq(PROMPT + [5, 6, 7, 8])
    assert b.cached_run(seq.prefix_hashes(BS)) == 4
    seq.output_ids += [9] * 8  # longer: hashed again, the first blocks unchanged
    assert seq.prefix_hashes(BS)[:4] == prefix_hashes(PROMPT, BS) and len(seq.prefix_hashes(BS)) == 7


def test_the_worker_holding_the_prefix_wins_within_the_load_bound():
    ws = _workers(3)
    _cache(ws[1], PROMPT[:8])  # 2 blocks
    _cache(ws[2], PROMPT)  # 4 blocks
    ws[2].scheduler.load = 4  # least is 0: the bound is 0 + max(4, 0) = 4
    policy = RoutingPolicy(RoutingConfig(balance_abs=4))
    c = policy.choose(_seq(PROMPT), ws)
    assert (c.worker.worker_id, c.reason, c.hit_blocks) == ("w2", "prefix_hit", 4)
    ws[2].scheduler.load = 5  # past the bound: the next best hit within it
    c = policy.choose(_seq(PROMPT), ws)
    assert (c.worker.worker_id, c.reason, c.hit_blocks) == ("w1", "prefix_hit", 2)
    ws[1].scheduler.load = 5
    c = policy.choose(_seq(PROMPT), ws)
    assert (c.worker.worker_id, c.reason) == ("w0", "load_bound")
    assert policy.snapshot()["decisions"] == {"session": 0, "prefix_hit": 2, "lora_resident": 0,
                                              "least_loaded": 0, "load_bound": 1}


def test_an_adapters_request_goes_where_the_adapter_is_resident_within_the_bound():
    ws = _workers(3)
    adapter = ServedAdapter(None, "a0#1", None)
    for w in ws:
        w.core.loras = LoraSlots(2)
    ws[2].core.loras.resident["a0#1"] = 0
    seq = _seq(PROMPT)
    seq.lora = adapter
    policy = RoutingPolicy(RoutingConfig(balance_abs=4))
    ws[2].scheduler.load = 4
    c = policy.choose(seq, ws)
    assert (c.worker.worker_id, c.reason) == ("w2", "lora_resident")
    ws[2].scheduler.load = 5  # past the bound: the least loaded loads it
    assert (policy.choose(seq, ws).worker.worker_id, policy.choose(seq, ws).reason) == ("w0", "least_loaded")
    _cache(ws[1], PROMPT)  # the base model's blocks are no hit for the adapter's request
    assert policy.choose(seq, ws).worker.worker_id == "w0"


def test_the_bound_grows_with_load():
    ws = _workers(2)
    _cache(ws[1], PROMPT)
    ws[0].scheduler.load, ws[1].scheduler.load = 40, 50  # 40 + max(8, 0.25 * 40) = 50
    assert RoutingPolicy(RoutingConfig()).choose(_seq(PROMPT), ws).worker.worker_id == "w1"
    ws[1].scheduler.load = 51
    assert RoutingPolicy(RoutingConfig()).choose(_seq(PROMPT), ws).worker.worker_id == "w0"
    ws[0].scheduler.load, ws[1].scheduler.load = 0, 8  # at low load the absolute bound: 0 + 8
    assert RoutingPolicy(RoutingConfig()).choose(_seq(PROMPT), ws).worker.worker_id == "w1"


def test_equal_hits_go_to_the_less_loaded_and_no_hit_to_the_least_loaded():
    ws = _workers(3)
    for w in ws[1:]:
        _cache(w, PROMPT)
    ws[0].scheduler.load, ws[1].scheduler.load, ws[2].scheduler.load = 0, 3, 2
    policy = RoutingPolicy(RoutingConfig())
    assert policy.choose(_seq(PROMPT), ws).worker.worker_id == "w2"
    c = policy.choose(_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]), ws)
    assert (c.worker.worker_id, c.reason) == ("w0", "least_loaded")


def test_equal_loads_go_to_the_worker_given_the_least_work_so_far():
    ws = _workers(3)
    for w, work in zip(ws, (900, 300, 600)):
        w.scheduler.tokens_scheduled = work
    for policy in ("cache-aware", "least-loaded"):
        assert RoutingPolicy(RoutingConfig(policy)).choose(_seq([1, 2, 3]), ws).worker.worker_id == "w1"
    ws[1].scheduler.load = 1  # fewer sequences first, whatever the work
    assert RoutingPolicy(RoutingConfig()).choose(_seq([1, 2, 3]), ws).worker.worker_id == "w2"
    for w in ws[1:]:
        _cache(w, PROMPT)
    ws[1].scheduler.load = 0  # equal hits and loads: the one given less work
    assert RoutingPolicy(RoutingConfig()).choose(_seq(PROMPT), ws).worker.worker_id == "w1"


def test_least_loaded_ignores_the_cache_and_a_full_prefill_request_goes_least_loaded():
    ws = _workers(2)
    _cache(ws[1], PROMPT)
    ws[1].scheduler.load = 1
    assert RoutingPolicy(RoutingConfig("least-loaded")).choose(_seq(PROMPT), ws).worker.worker_id == "w0"
    penalised = _seq(PROMPT, repetition_penalty=1.2)  # computes its whole prompt: no hit to use
    assert RoutingPolicy(RoutingConfig()).choose(penalised, ws).worker.worker_id == "w0"


def test_a_session_returns_to_its_worker_until_that_worker_leaves():
    ws = _workers(3)
    policy = RoutingPolicy(RoutingConfig("session"))
    first = policy.choose(_seq([1, 2, 3], session="chat-1"), ws)
    assert (first.worker.worker_id, first.reason) == ("w0", "least_loaded")
    ws[0].scheduler.load = 30  # far past any bound: the session still prefers it
    again = policy.choose(_seq([9, 9, 9], session="chat-1"), ws)
    assert (again.worker.worker_id, again.reason) == ("w0", "session")
    _cache(ws[2], PROMPT)
    moved = policy.choose(_seq(PROMPT, session="chat-1"), ws[1:])  # w0 drained or lost: not active
    assert (moved.worker.worker_id, moved.reason) == ("w2", "prefix_hit")  # its blocks, where they are
    back = policy.choose(_seq([5], session="chat-1"), ws)
    assert (back.worker.worker_id, back.reason) == ("w2", "session")  # remembered anew
    assert policy.snapshot()["sessions"] == 1


def test_sessions_are_forgotten_least_recently_routed_first():
    ws = _workers(2)
    policy = RoutingPolicy(RoutingConfig("session", max_sessions=2))
    for s in ("a", "b", "c"):
        policy.choose(_seq([1, 2], session=s), ws)
    assert policy.snapshot()["sessions"] == 2 and "a" not in policy._sessions


def test_a_bad_routing_config_is_refused():
    for cfg in (RoutingConfig("random"), RoutingConfig(balance_abs=-1), RoutingConfig(max_sessions=0)):
        with pytest.raises(ValueError):
            RoutingPolicy(cfg)
