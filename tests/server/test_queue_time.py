"""``--max-queue-time``: a request no launch has taken within the bound is refused (``server_busy``,
429 over HTTP) rather than left to wait without end; what started finishes exactly. Its negative
control: without the bound, the same burst's last requests wait far past it."""

from __future__ import annotations

import threading
import time

import pytest

from fusedserve.coordinator.client import Client, ServerError
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.server.config import Limits
from tests.support import running_server

RC = dict(max_batch=2, num_blocks=128, dtype="float32")
BOUND_S = 1.0
N = 16
PROMPTS = [f"Queue {i}: once upon a time" for i in range(N)]


def _burst(address: str) -> tuple[dict[int, dict], dict[int, tuple[dict, float]]]:
    """Every prompt at once, one connection each: done replies, and (error, seconds to it)."""
    done: dict[int, dict] = {}
    refused: dict[int, tuple[dict, float]] = {}

    def one(i: int) -> None:
        with Client(address, timeout_s=300) as c:
            t0 = time.perf_counter()
            try:
                done[i] = c.generate(PROMPTS[i], max_tokens=256, ignore_eos=True)
            except ServerError as exc:
                refused[i] = (exc.reply, time.perf_counter() - t0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return done, refused


@pytest.mark.parametrize("bound", [BOUND_S, 0.0], ids=["bound-1s", "negative-control-no-bound"])
def test_what_waits_past_the_queue_bound_is_refused_and_the_rest_is_exact(ray_session, bound):
    with LLMEngine("default", **RC) as eng:
        want = [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=256, ignore_eos=True))]
    with running_server(**RC, limits=Limits(max_queue_time_s=bound)) as coord:
        done, refused = _burst(coord.address)
        stats = Client(coord.address).stats()
    assert len(done) + len(refused) == N
    for i, reply in done.items():
        assert reply["token_ids"] == want[i], i
    waited = max(r["timings"]["queue_s"] for r in done.values())
    if bound:
        assert refused and done, (len(done), len(refused))  # two rows a launch: not all start in time
        assert all(err["code"] == "server_busy" and "--max-queue-time" in err["message"]
                   for err, _ in refused.values())
        after = sorted(s for _, s in refused.values())
        assert bound <= after[0] and after[-1] < bound + 1.0, after
        assert waited < bound + 0.5, waited  # what was admitted started within the bound
        assert stats["faults"]["queue_timeouts"] == len(refused)
    else:
        assert not refused and waited > 2 * BOUND_S, waited  # the check above would fire
    assert stats["running"] == 0 and stats["coordinator"]["pending"] == 0
