"""The CI-length soak (``benchmarks/soak.py``): 3 minutes of the mixed load, after a minute of it as
warm-up, against a two-worker ``fusedserve serve`` of its own, sampled every 5 s. It passes when no
resource series grows past its bound after warm-up, the server drains to nothing, and every
response is as expected; and the growth check fires on a series that does grow (its negative
control)."""

from __future__ import annotations

import copy

from fusedserve.benchmarks import soak


def test_three_minutes_of_mixed_load_leave_nothing_growing_or_held():
    res = soak.run(minutes=3, workers=2, clients=6, interval=5.0, warmup=60.0)
    assert res["failures"] == [], res["failures"]
    judged = [s for s in res["samples"] if not s["warmup"]]
    assert len(judged) >= 30 and len(res["samples"]) - len(judged) >= 10 and res["requests"] > 100
    assert res["by_kind"].get("bad", 0) > 0 and res["by_kind"].get("drop_stream", 0) > 0
    assert all(s["shm_segments"] > 0 for s in res["samples"])  # the series see the server's own
    # Negative control: the same run with the serve process's memory growing 1% a sample fails.
    leaky = copy.deepcopy(res)
    for i, s in enumerate(leaky["samples"]):
        s["serve_rss"] = int(s["serve_rss"] * 1.01 ** i)
    leaky["growth"] = soak.growth(leaky["samples"])
    assert any(f.startswith("serve_rss grew") for f in soak.check(leaky))
    # Growth during the warm-up alone is not judged: the same run with its warm-up samples 20% lower.
    warming = copy.deepcopy(res)
    for s in warming["samples"]:
        s["serve_rss"] = int(s["serve_rss"] * (0.8 if s["warmup"] else 1))
    warming["growth"] = soak.growth(warming["samples"])
    assert not any(f.startswith("serve_rss grew") for f in soak.check(warming))
