"""Prometheus metrics of the HTTP gateway, in the text format ``GET /metrics`` serves.

vLLM's metric set under the ``fusedserve:`` prefix, each with a ``model_name`` label, so vLLM's
dashboards and alerts work with the prefix changed (``deploy/grafana_dashboard.json`` is one):
request-level series (finish reasons, prompt and generation tokens, TTFT, inter-token and
end-to-end latency) are observed by the gateway as requests finish; server-level series (running
and waiting requests, KV cache usage, prefix-cache queries and hits, preemptions) come from the
coordinator's ``stats`` reply, read at each scrape, so they are exact at the time of the scrape.
fusedserve's own series (workers, KV blocks, host<->device bytes, faults, the gateway's internal
errors) carry the same prefix and label.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from fusedserve.coordinator.engine.token_histogram import ITERATION_TOKEN_BUCKETS

PREFIX = "fusedserve:"
# vLLM's buckets, so its dashboards' quantiles read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


FAULTS = ("reruns", "client_gone", "slow_client", "unauthorized", "request_errors", "queue_timeouts",
          "fenced")


class _StatsCollector:
    """Series built from the latest coordinator ``stats`` snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: dict | None = None

    def collect(self) -> Iterator[Metric]:
        s, model = self.snapshot, [self.model_name]
        if s is None:
            return
        workers = s["workers"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(model, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(model, value)
            return c

        used, free = (sum(w[f"kv_blocks_{k}"] for w in workers) for k in ("used", "free"))
        yield gauge("num_requests_running", "Requests in a worker's running batch", s["running"])
        yield gauge("num_requests_waiting", "Requests waiting for a worker's batch", s["queue_length"])
        usage = used / (used + free) if used + free else 0.0
        yield gauge("kv_cache_usage_perc", "KV cache usage, 1 is full (cached blocks count as free)", usage)
        yield gauge("gpu_cache_usage_perc", "KV cache usage (vLLM's older name)", usage)
        yield gauge("cpu_cache_usage_perc", "Swap space used: 0, preempted requests are recomputed", 0)
        yield gauge("num_requests_swapped", "Swapped requests: 0, preempted ones are recomputed", 0)
        yield _launch_tokens(workers, model)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      sum(w["prefix_cache"]["query_tokens"] for w in workers))
        yield counter("prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache",
                      sum(w["prefix_cache"]["hit_tokens"] for w in workers))
        yield counter("num_preemptions", "Requests preempted to free KV blocks (recomputed later)",
                      sum(w.get("preemptions", 0) for w in workers))
        spec = [w["speculative"] for w in workers if w.get("speculative")]
        yield counter("spec_decode_num_drafts", "Launches in which a request carried proposed tokens",
                      sum(x["drafts"] for x in spec))
        yield counter("spec_decode_num_draft_tokens", "Proposed tokens verified",
                      sum(x["proposed"] for x in spec))
        yield counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                      sum(x["accepted"] for x in spec))
        loras = [w["lora"] for w in workers if w.get("lora")]
        if loras:  # vLLM's: the adapters in use, as labels; the value is when they were read
            labels = ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"]
            doc = "LoRA adapters of running and waiting requests"
            g = GaugeMetricFamily(PREFIX + "lora_requests_info", doc, labels=labels)
            running = ",".join(sorted({n for x in loras for n in x["running"]}))
            waiting = ",".join(sorted({n for x in loras for n in x["waiting"]}))
            g.add_metric([self.model_name, str(loras[0]["max_loras"]), running, waiting], time.time())
            yield g
            yield counter("lora_loads", "LoRA adapters read into a worker's slot",
                          sum(x["loads"] for x in loras))
        yield gauge("workers", "Workers up (draining ones included)", len(workers))
        yield gauge("kv_blocks_used", "KV cache blocks in use, all workers", used)
        yield gauge("kv_blocks_free", "KV cache blocks free (cached ones included), all workers", free)
        for way in ("h2d", "d2h"):
            c = CounterMetricFamily(f"{PREFIX}{way}_bytes", f"Bytes copied {way} by the workers' launches",
                                    labels=["model_name", "worker"])
            for w in workers:
                c.add_metric([self.model_name, w["id"]], w[f"{way}_bytes"])
            yield c
        for name, doc in (("query_tokens", "Prompt tokens looked up in each worker's prefix cache"),
                          ("hit_tokens", "Prompt tokens whose KV came from each worker's prefix cache")):
            c = CounterMetricFamily(f"{PREFIX}worker_prefix_cache_{name}", doc,
                                    labels=["model_name", "worker"])
            for w in workers:
                c.add_metric([self.model_name, w["id"]], w["prefix_cache"][name])
            yield c
        routing = s.get("routing")
        if routing is not None:
            c = CounterMetricFamily(PREFIX + "routing_decisions", "Requests routed to a worker, by reason",
                                    labels=["model_name", "policy", "reason"])
            for reason, n in routing["decisions"].items():
                c.add_metric([self.model_name, routing["policy"], reason], n)
            yield c
        faults = CounterMetricFamily(PREFIX + "faults", "Faults the coordinator handled, by kind",
                                     labels=["model_name", "kind"])
        for kind in FAULTS:
            faults.add_metric([self.model_name, kind], s["faults"].get(kind, 0))
        faults.add_metric([self.model_name, "worker_failure"], len(s["faults"].get("worker_failures", [])))
        yield faults


def _launch_tokens(workers: list[dict], model: list[str]) -> HistogramMetricFamily:
    """Tokens per launch, every worker's counts summed (vLLM's iteration_tokens_total)."""
    h = HistogramMetricFamily(PREFIX + "iteration_tokens_total", "Tokens per launch (engine step)",
                              labels=["model_name"])
    counted = [w["launch_tokens"] for w in workers if "launch_tokens" in w]
    bounds = counted[0]["bounds"] if counted else list(ITERATION_TOKEN_BUCKETS)
    counts = [sum(c["counts"][i] for c in counted) for i in range(len(bounds) + 1)]
    cumulative = list(itertools.accumulate(counts))
    h.add_metric(model, [(str(float(b)), n) for b, n in zip(bounds, cumulative)] + [("+Inf", cumulative[-1])],
                 sum(c["sum"] for c in counted))
    return h


class Metrics:
    def __init__(self, model_name: str = "default", max_model_len: int = 1 << 17) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]
        tokens = buckets_1_2_5(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=r).labels(model_name)

        self.requests = Counter(PREFIX + "request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", label,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", label,
                                         registry=r).labels(model_name)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between streamed tokens",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "A request's decode time over its tokens "
                              "after the first", TOKEN_LATENCY_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds", "The same, vLLM V1's name",
                                      TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token", REQUEST_LATENCY_BUCKETS)
        self.phases = {phase: histogram(f"request_{phase}_time_seconds", doc, REQUEST_LATENCY_BUCKETS)
                       for phase, doc in (("queue", "Arrival to a launch first taking the request"),
                                          ("prefill", "A launch first taking it to its first token"),
                                          ("decode", "First token to last"),
                                          ("inference", "A launch first taking it to its last token"))}
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens per request", tokens)
        self.request_generation = histogram("request_generation_tokens", "Tokens generated per request",
                                            tokens)
        self.max_generation = histogram("request_max_num_generation_tokens", "max_tokens of each finished "
                                        "request", tokens)
        self.params_max_tokens = histogram("request_params_max_tokens", "max_tokens asked per request",
                                           tokens)
        self.params_n = histogram("request_params_n", "Choices (n) asked per request", N_BUCKETS)
        # Requests that reached the generic handler: a 500 from a bug, never from a client's input
        # (every bad input has its own 4xx). The fuzz tests require it to stay 0.
        self.internal_errors = Counter(PREFIX + "http_internal_errors", "Requests answered by the gateway's "
                                       "generic 500 handler", label, registry=r).labels(model_name)
        # Requests refused with a 429 because the server or the client had its most in flight (at once
        # by the gateway, before tokenizing, or by the coordinator's own caps), or that waited past
        # --max-queue-time: what an overload sheds.
        self.shed = Counter(PREFIX + "requests_shed", "Requests refused with 429 under load",
                            ["model_name", "reason"], registry=r)
        self._stats = _StatsCollector(model_name)
        r.register(self._stats)

    def admitted(self, n: int, max_tokens: int) -> None:
        """Count an HTTP request's asks (each of its choices then finishes on its own)."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def finished(self, done: dict, max_tokens: int | None = None) -> None:
        """Count a request that ended with a ``done`` frame (any finish reason)."""
        self.failed(done.get("finish_reason") or "abort")
        prompt, generated = done["usage"]["prompt_tokens"], done["usage"]["completion_tokens"]
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.request_prompt.observe(prompt)
        self.request_generation.observe(generated)
        if max_tokens is not None:
            self.max_generation.observe(max_tokens)
        t = done.get("timings") or {}
        if generated and "ttft_s" in t:
            self.ttft.observe(t["ttft_s"])
        if "total_s" in t:
            self.e2e.observe(t["total_s"])
        for phase, h in self.phases.items():
            if f"{phase}_s" in t:
                h.observe(t[f"{phase}_s"])
        if generated > 1 and "decode_s" in t:
            self.tpot.observe(t["decode_s"] / (generated - 1))
            self.request_tpot.observe(t["decode_s"] / (generated - 1))

    def failed(self, reason: str = "error") -> None:
        self.requests.labels(self.model_name, reason).inc()

    def refused(self, reply: dict) -> None:
        """A request the coordinator refused: under load (its own caps, ``--max-queue-time``) it
        counts as shed, like the gateway's own 429s, which a burst can slip past while tokenizing."""
        self.failed()
        if reply.get("code") in ("server_busy", "too_many_requests"):
            self.shed.labels(self.model_name, reply["code"]).inc()

    def render(self, stats: dict | None) -> bytes:
        self._stats.snapshot = stats
        return generate_latest(self.registry)
