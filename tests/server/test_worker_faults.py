"""A worker killed in the middle of decode: noticed, replaced, nothing lost (the time to notice is
printed, not asserted: it is a figure of the machine, not of correctness). And the other side of
the step socket: a coordinator frozen past the heartbeat bound loses its workers (they retire
themselves), and once it runs again it replaces them and finishes every request exactly."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.shared_memory.arena import list_segments, pid_alive
from tests.serve_proc import ServeProcess
from tests.support import assert_streams_exact, exits_within, running_server, stream_requests, wait_for

RC = dict(max_batch=16, block_size=8, num_blocks=200, sampler_candidates=16)
N = 10
PROMPTS = [f"fault {i}: the capital of France is" for i in range(N)]
PARAMS = [{"max_tokens": 64, "ignore_eos": True} if i % 2 else
          {"max_tokens": 64, "temperature": 0.8, "top_k": 8, "seed": 7 + i, "ignore_eos": True}
          for i in range(N)]


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    with LLMEngine("default", dtype="float32", **RC) as eng:
        return [eng.generate([p], SamplingParams(**kw))[0].token_ids for p, kw in zip(PROMPTS, PARAMS)]


# SIGSTOP: a frozen process keeps its TCP connection open; only the heartbeats find it.
FAULTS = [(2, "ray.kill"), (2, "SIGKILL"), (1, "SIGKILL"), (2, "SIGSTOP")]


@pytest.mark.parametrize("workers,how", FAULTS, ids=[f"{w}workers-{h}" for w, h in FAULTS])
def test_worker_killed_mid_decode(ray_session, want, workers, how):
    with running_server(workers=workers, **RC, dtype="float32") as coord:
        streams = stream_requests(coord.address, PROMPTS, PARAMS)
        for _ in range(N):
            assert streams.progressed.acquire(timeout=120), "every stream has 4 tokens before the fault"
        victim = coord.workers[0]
        assert victim.scheduler.running, "the victim is decoding when it is killed"
        pid, segments = victim.info["pid"], {a.name for a in victim.arenas}
        t_kill = time.time()
        if how == "ray.kill":
            ray.kill(victim.actor)
        else:
            os.kill(pid, getattr(signal, how))
        wait_for(lambda: coord.pool.failures, 60, "the coordinator to notice")
        failure = coord.pool.failures[0]
        print(f"{how}: lost worker noticed after {failure.at - t_kill:.3f} s "
              f"({failure.requests} requests re-run): {failure.reason}")
        assert failure.worker_id == victim.worker_id and failure.requests > 0
        assert_streams_exact(streams, want)
        wait_for(lambda: len(coord.pool.active) == workers, 120, "the replacement worker")
        stats = Client(coord.address).stats()
        assert stats["faults"]["reruns"] == failure.requests
        assert stats["completed"] == N and stats["running"] == 0 and stats["queue_length"] == 0
        assert all(w["kv_blocks_used"] == 0 for w in stats["workers"])
        assert not segments & set(list_segments()), "the lost worker's arena banks are unlinked"
        wait_for(lambda: not pid_alive(pid), 30, "the killed process to be gone")


# The negative control: with a heartbeat bound longer than the freeze, the worker never notices.
FROZEN = [("0.6", True), ("30", False)]


@pytest.mark.parametrize("heartbeat_s,retires", FROZEN, ids=["heartbeat-0.6s", "negative-control-30s"])
def test_a_frozen_coordinator_retires_its_worker_then_recovers_exactly(ray_session, want, tmp_path,
                                                                      heartbeat_s, retires):
    args = ("--workers", "1", "--dtype", "float32", "--max-batch", "16", "--block-size", "8",
            "--num-blocks", "200", "--sampler-candidates", "16", "--worker-heartbeat-timeout", heartbeat_s)
    srv = ServeProcess.start(tmp_path / "serve.log", *args)
    try:
        with Client(srv.address) as c:
            pid = c.workers()[0]["pid"]
        streams = stream_requests(srv.address, PROMPTS, PARAMS)
        for _ in range(N):
            assert streams.progressed.acquire(timeout=120), "every stream has 4 tokens before the freeze"
        srv.signal(signal.SIGSTOP)  # a GC pause, a swap storm, or the worker's link: nothing answers
        t0 = time.time()
        try:
            retired = exits_within(pid, 5.0)
            print(f"heartbeat bound {heartbeat_s} s: worker retired={retired} "
                  f"after {time.time() - t0:.2f} s of a frozen coordinator")
        finally:
            srv.signal(signal.SIGCONT)
        assert retired == retires
        assert_streams_exact(streams, want)
        with Client(srv.address) as c:
            stats = c.stats()
        assert (stats["faults"]["reruns"] > 0) == retires, stats["faults"]
        assert stats["faults"]["fenced"] == 0  # a retired worker sent nothing after its last reply
    finally:
        srv.stop()
