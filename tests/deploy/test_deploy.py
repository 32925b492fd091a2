"""Deployment: scaling workers at run time, and ``ray job submit`` against a real head."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.server.ray_cluster import free_ports, stop_head
from fusedserve.shared_memory.arena import list_segments
from tests.support import running_server, wait_for

ROOT = Path(__file__).resolve().parents[2]
RC = dict(max_batch=8, block_size=8, num_blocks=200, sampler_candidates=16)  # no preemption here
PROMPTS = [f"stream {i}: once upon a time" for i in range(20)]


def _params(n: int, max_tokens: int, sampled: dict) -> list[dict]:
    """Greedy and seeded-sampled requests, alternating."""
    return [{"max_tokens": max_tokens, "ignore_eos": True} if i % 2 else
            {"max_tokens": max_tokens, "seed": i, "ignore_eos": True, **sampled} for i in range(n)]


def _offline(params: list[dict]) -> list[list[int]]:
    """Each request's tokens from the offline engine, alone."""
    with LLMEngine("default", dtype="float32", **RC) as eng:
        return [eng.generate([p], SamplingParams(**kw))[0].token_ids for p, kw in zip(PROMPTS, params)]


def _server(workers: int):
    return running_server(workers=workers, **RC, dtype="float32")


def _streams(address: str, params: list[dict], results: dict[int, list[int]], progressed: threading.Semaphore,
             after: int) -> list[threading.Thread]:
    """One streaming client a request (``PROMPTS[i]`` with ``params[i]``), started; each releases
    ``progressed`` once it has ``after`` tokens and adds its tokens to ``results[i]`` at the end
    (twice if it finished twice)."""
    def one(i: int) -> None:
        with Client(address, timeout_s=600) as c:
            got = []
            for f in c.stream(PROMPTS[i], **params[i]):
                if f["type"] == "token":
                    got.append(f["token"])
                    if len(got) == after:
                        progressed.release()
                else:
                    assert f["token_ids"] == got
            results.setdefault(i, []).extend(got)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(params))]
    for t in threads:
        t.start()
    return threads


def test_scale_1_to_2_to_1_while_20_requests_stream(ray_session):
    params = _params(20, 40, {"temperature": 0.8, "top_k": 8})
    want = _offline(params)
    with _server(workers=1) as coord:
        results: dict[int, list[int]] = {}
        first_tokens = threading.Semaphore(0)
        threads = _streams(coord.address, params, results, first_tokens, after=1)
        first_tokens.acquire(timeout=120)
        with Client(coord.address) as c:
            assert c.scale(2)["starting"] == 1
            wait_for(lambda: len([w for w in c.stats()["workers"] if not w["draining"]]) == 2, 120,
                     "2 workers", every_s=0.1)
            reply = c.scale(1)
            assert reply["draining"] == 1
            wait_for(lambda: len(c.stats()["workers"]) == 1, 120, "the drained worker to stop", every_s=0.1)
        for t in threads:
            t.join(timeout=300)
        assert sorted(results) == list(range(20)), "every request finished"
        assert [results[i] for i in range(20)] == want
        with Client(coord.address) as c:
            stats = c.stats()
        assert stats["running"] == 0 and all(w["kv_blocks_used"] == 0 for w in stats["workers"])


def test_draining_a_worker_that_holds_running_requests_drops_none(ray_session):
    """Scale 2 -> 1 while both workers decode: the drained worker finishes what runs there, its
    queue moves, every stream ends exactly once with the offline engine's tokens."""
    n = 12
    params = _params(n, 300, {"temperature": 0.8, "top_p": 0.9})
    want = _offline(params)
    with _server(workers=2) as coord:
        results: dict[int, list[int]] = {}
        started = threading.Semaphore(0)
        threads = _streams(coord.address, params, results, started, after=2)
        for _ in range(n):
            assert started.acquire(timeout=120), "every stream is decoding before the drain"
        with Client(coord.address) as c:
            newest = c.stats()["workers"][-1]
            assert newest["running"] > 0, "the worker to drain holds running requests"
            assert c.scale(1)["draining"] == 1
            drained = next(w for w in c.stats()["workers"] if w["id"] == newest["id"])
            assert drained["draining"] and drained["running"] > 0, "running requests finish where they run"
            wait_for(lambda: len(c.stats()["workers"]) == 1, 300, "the drained worker to stop", every_s=0.1)
        for t in threads:
            t.join(timeout=600)
        assert sorted(results) == list(range(n)), "every request finished, exactly once"
        assert [results[i] for i in range(n)] == want
        with Client(coord.address) as c:
            stats = c.stats()
        assert stats["completed"] == n and stats["faults"]["reruns"] == 0
        assert stats["running"] == 0 and all(w["kv_blocks_used"] == 0 for w in stats["workers"])


@pytest.mark.skipif(shutil.which("ray", path=str(Path(sys.executable).parent)) is None,
                    reason="the ray CLI is not installed beside this python")
def test_ray_job_submit_serves_stops_clean_restarts_and_fails_visibly(tmp_path):
    bindir = Path(sys.executable).parent
    # A SIGTERM grace far beyond what a stop takes on any machine (about 0.5 s measured here, with
    # `exec`): a force-kill then means the job ignored SIGTERM, not that this machine was slow.
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0", FUSEDSERVE_CACHE=os.environ["FUSEDSERVE_CACHE"],
               RAY_JOB_STOP_WAIT_TIME_S="60")
    env.pop("RAY_ADDRESS", None)
    gcs, dash, port, *agents = free_ports(9)
    ray_bin = str(bindir / "ray")
    before = set(list_segments())
    # Every port explicit: the session's in-process cluster already holds the default agent ports.
    names = ("dashboard-agent-listen", "dashboard-agent-grpc", "metrics-export", "runtime-env-agent",
             "node-manager", "object-manager")
    agent = [f"--{name}-port={p}" for name, p in zip(names, agents)]
    temp_dir = tempfile.mkdtemp(prefix="rayhead", dir="/tmp")  # short: Ray puts sockets in it
    subprocess.run([ray_bin, "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}",
                    "--dashboard-host=127.0.0.1", "--num-cpus=3", "--disable-usage-stats",
                    f"--temp-dir={temp_dir}", *agent],
                   env=env, check=True, capture_output=True, timeout=120)
    address = f"http://127.0.0.1:{dash}"
    try:
        submit = [ray_bin, "job", "submit", "--address", address, "--working-dir", str(ROOT), "--no-wait",
                  "--", "exec", "python", "-m", "fusedserve.deploy.serve", "--model", "default",
                  "--workers", "auto",
                  "--device", "cpu", "--zmq-port", str(port), "--no-http", "--max-batch", "4",
                  "--num-blocks", "64", "--dtype", "float32"]
        for _ in range(20):  # the head's job agent comes up a few seconds after `ray start`
            out = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=180)
            if out.returncode == 0 or "No available agent" not in out.stderr:
                break
            time.sleep(2)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        words = out.stdout.split()
        job_id = next(w.strip("'\"") for w in words if w.strip("'\"").startswith("raysubmit_"))
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=5) as c:
            def up() -> bool:
                try:
                    return c.health()["ok"]
                except TimeoutError:
                    return False
            wait_for(up, 150, "the job's server", every_s=0.1)
            got = c.generate("The capital of France is", max_tokens=12, ignore_eos=True)
        with LLMEngine("default", dtype="float32", **dict(max_batch=4, num_blocks=64)) as eng:
            want = eng.generate(["The capital of France is"], SamplingParams(max_tokens=12, ignore_eos=True))
        assert got["token_ids"] == want[0].token_ids
        subprocess.run([ray_bin, "job", "stop", "--address", address, job_id], env=env, check=True,
                       capture_output=True, timeout=120)
        probe = ("from ray.util.state import list_actors; import json; "
                 "print(json.dumps([a.class_name for a in "
                 f"list_actors(address={address!r}, filters=[('state', '=', 'ALIVE')])]))")

        seen: dict = {}

        def clean() -> bool:
            alive = json.loads(subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                                              text=True, timeout=60).stdout.strip().splitlines()[-1])
            seen.update(alive=alive, new_segments=sorted(set(list_segments()) - before))
            return "WorkerActor" not in alive and set(list_segments()) <= before
        log = Path(temp_dir, "session_latest", "logs", "jobs", f"supervisor-{job_id}.log")
        try:
            wait_for(clean, 60, "no worker actor and no new segment after job stop", every_s=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen {seen}; supervisor: {log.read_text()[-2000:]}") from None
        # The job exits within the supervisor's SIGTERM grace: never force-killed with SIGKILL.
        wait_for(lambda: "terminated gracefully" in log.read_text(errors="replace")
                 or "force-killed" in log.read_text(errors="replace"), 30, "the job's stop to be logged")
        assert "force-killed" not in log.read_text(errors="replace")
        # Restarted on the same ports, it serves again; its coordinator killed, the job fails visibly
        # and nothing of it stays.
        out = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        job_id = next(w.strip("'\"") for w in out.stdout.split() if w.strip("'\"").startswith("raysubmit_"))
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=5) as c:
            wait_for(up, 150, "the restarted job's server on the same port", every_s=0.1)
            assert c.generate("The capital of France is", max_tokens=12, ignore_eos=True)["token_ids"] \
                == want[0].token_ids
            os.kill(c.stats()["coordinator"]["pid"], signal.SIGKILL)

        def status() -> str:
            res = subprocess.run([ray_bin, "job", "status", "--address", address, job_id], env=env,
                                 capture_output=True, text=True, timeout=60)
            return res.stdout + res.stderr

        last: list[str] = [""]

        def failed() -> bool:
            last[0] = status()
            return f"Job '{job_id}' failed" in last[0]  # `ray job status` of a FAILED job

        try:
            wait_for(failed, 60, "the job to fail visibly after its coordinator was killed")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; ray job status: {last[0][-1500:]}") from None
        wait_for(clean, 60, "nothing of the job left after its coordinator was killed", every_s=0.2)
    finally:
        stop_head(temp_dir, grace_s=10)  # not `ray stop`: that would also end this session's own cluster
