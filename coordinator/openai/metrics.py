"""Prometheus metrics of the HTTP gateway, in the text format ``GET /metrics`` serves.

Request-level series (finish reasons, tokens, TTFT, inter-token latency, end-to-end
latency) are observed by the gateway as requests finish; server-level series (queue,
running, KV blocks, host<->device bytes, workers, faults) come from the coordinator's
``stats`` reply, read at each scrape, so they are exact at the time of the scrape.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)
FAULTS = ("reruns", "client_gone", "slow_client", "unauthorized", "request_errors")


class _StatsCollector:
    """Series built from the latest coordinator ``stats`` snapshot."""

    def __init__(self) -> None:
        self.snapshot: dict | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        workers = s["workers"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"fusedserve_{name}", doc, value=value)

        yield gauge("queue_length", "Requests waiting for a worker's batch", s["queue_length"])
        yield gauge("running", "Requests in a worker's running batch", s["running"])
        yield gauge("workers", "Workers up (draining ones included)", len(workers))
        for kind in ("used", "free"):
            yield gauge(f"kv_blocks_{kind}", f"KV cache blocks {kind}, all workers",
                        sum(w[f"kv_blocks_{kind}"] for w in workers))
        for way in ("h2d", "d2h"):
            c = CounterMetricFamily(f"fusedserve_{way}_bytes", f"Bytes copied {way} by the workers' launches",
                                    labels=["worker"])
            for w in workers:
                c.add_metric([w["id"]], w[f"{way}_bytes"])
            yield c
        faults = CounterMetricFamily("fusedserve_faults", "Faults the coordinator handled, by kind",
                                     labels=["kind"])
        for kind in FAULTS:
            faults.add_metric([kind], s["faults"].get(kind, 0))
        faults.add_metric(["worker_failure"], len(s["faults"].get("worker_failures", [])))
        yield faults


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fusedserve_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("fusedserve_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("fusedserve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("fusedserve_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("fusedserve_inter_token_latency_seconds", "Gap between streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("fusedserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        # Requests that reached the generic handler: a 500 from a bug, never from a client's input
        # (every bad input has its own 4xx). The fuzz tests require it to stay 0.
        self.internal_errors = Counter("fusedserve_http_internal_errors", "Requests answered by the "
                                       "gateway's generic 500 handler", registry=r)
        self._stats = _StatsCollector()
        r.register(self._stats)

    def finished(self, done: dict) -> None:
        """Count a request that ended with a ``done`` frame (any finish reason)."""
        self.requests.labels(done.get("finish_reason") or "abort").inc()
        self.prompt_tokens.inc(done["usage"]["prompt_tokens"])
        self.generation_tokens.inc(done["usage"]["completion_tokens"])
        t = done.get("timings") or {}
        if done["usage"]["completion_tokens"] and "ttft_s" in t:
            self.ttft.observe(t["ttft_s"])
        if "total_s" in t:
            self.e2e.observe(t["total_s"])

    def failed(self, reason: str = "error") -> None:
        self.requests.labels(reason).inc()

    def render(self, stats: dict | None) -> bytes:
        self._stats.snapshot = stats
        return generate_latest(self.registry)
