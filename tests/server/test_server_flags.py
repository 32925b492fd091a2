"""Server-wide settings a vLLM user sets. ``--seed``: the server's base seed. A request that
names no seed draws its seed from it in arrival order, so the same requests sent in the same order
sample the same tokens in another run of the server; a request's own seed wins.
``--max-logprobs``: the most top logprobs a request may ask for, of its output or its prompt."""

from __future__ import annotations

import pytest

from fusedserve.coordinator.client import Client, ServerError
from fusedserve.coordinator.server.config import Limits
from tests.support import running_server

RC = dict(dtype="float32", max_batch=4, block_size=16, num_blocks=64)
PROMPTS = ["The with statement", "A list comprehension is", "def hello(name):"]


def _run(server_seed: int | None, **extra: object) -> list[list[int]]:
    with running_server(seed=server_seed, **RC) as coord, Client(coord.address) as c:
        return [c.generate(p, max_tokens=8, temperature=1.0, ignore_eos=True, **extra)["token_ids"]
                for p in PROMPTS for _ in range(2)]


def test_unseeded_requests_repeat_per_server_run_with_its_seed(ray_session):
    first, again = _run(7), _run(7)
    assert first == again
    assert first[0] != first[1]  # the same prompt twice draws two seeds, not one
    assert _run(8) != first
    assert _run(7, seed=11) == _run(8, seed=11)  # a request's own seed wins over the server's


def test_max_logprobs_bounds_what_a_request_may_ask(ray_session):
    with running_server(limits=Limits(max_logprobs=3), **RC) as coord, Client(coord.address) as c:
        assert len(c.generate("x", max_tokens=2, top_logprobs=3)["top_logprobs"][0]) == 3
        for ask in ({"top_logprobs": 4}, {"prompt_logprobs": 5}):
            with pytest.raises(ServerError, match="max-logprobs") as err:
                c.generate("x", max_tokens=2, **ask)
            assert err.value.reply["code"] == "bad_param"
        assert c.generate("x", max_tokens=2)["finish_reason"]  # the server goes on
