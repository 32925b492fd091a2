"""The server's ``stats`` reply: traffic and steps per worker, queues, faults, the process."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

from fusedserve.coordinator.engine.speculative.speculation_policy import Speculation
from fusedserve.coordinator.server.frontend import Frontend
from fusedserve.coordinator.server.request_table import RequestTable
from fusedserve.coordinator.server.router import Router
from fusedserve.coordinator.server.worker_pool import WorkerHandle, WorkerPool


@dataclass
class FaultCounters:
    reruns: int = 0  # requests moved off a lost worker and re-run
    client_gone: int = 0  # requests aborted because their client disconnected
    slow_client: int = 0  # requests aborted because their client stopped reading
    unauthorized: int = 0  # frames refused for a missing or wrong token
    request_errors: int = 0  # requests failed alone by an exception (admission, sampling, replies)
    queue_timeouts: int = 0  # requests refused after waiting past --max-queue-time for a launch


@dataclass
class ServerCounters:
    started_at: float
    completed: int = 0


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def speculative_stats(spec: Speculation | None) -> dict | None:
    """Proposals made and accepted on one worker (None: speculation is off)."""
    if spec is None:
        return None
    st = spec.stats
    return {"method": spec.method, "num_speculative_tokens": spec.k, "max_batch": spec.max_batch,
            "drafts": st.drafts, "proposed": st.proposed, "accepted": st.accepted,
            "acceptance_rate": st.acceptance,
            "mean_accepted_per_draft": st.accepted / st.drafts if st.drafts else 0.0}


def lora_stats(w: WorkerHandle) -> dict | None:
    """The worker's adapter slots: what is resident, what its requests use, reads into slots."""
    slots = w.core.loras
    if slots is None:
        return None

    def names(seqs) -> list[str]:
        return sorted({s.lora.name for s in seqs if s.lora is not None})

    return {"max_loras": slots.max_loras, "resident": [k.rpartition("#")[0] for k in slots.resident],
            "loads": slots.loads, "running": names(w.scheduler.running),
            "waiting": names(w.scheduler.waiting)}


def worker_stats(w: WorkerHandle) -> dict:
    s, b = w.core.stats, w.scheduler.blocks
    hit_rate = b.stats.hit_tokens / b.stats.query_tokens if b.stats.query_tokens else 0.0
    return {
        "id": w.worker_id, "draining": w.draining, "steps": s.steps, "tokens": s.tokens,
        "launch_in_flight": not w.core.idle,
        "waiting": len(w.scheduler.waiting), "running": len(w.scheduler.running),
        "preemptions": w.scheduler.preemptions, "tokens_scheduled": w.scheduler.tokens_scheduled,
        "launch_tokens": w.scheduler.launch_tokens.to_dict(),
        "kv_blocks_used": b.num_used, "kv_blocks_free": b.num_free, "kv_blocks_cached": b.num_cached,
        "prefix_cache": {"enabled": b.enable_prefix_caching, **asdict(b.stats), "hit_rate": hit_rate},
        "h2d_bytes": s.h2d_bytes, "d2h_bytes": s.d2h_bytes,
        "h2d_bytes_per_step": s.h2d_bytes / s.steps if s.steps else 0.0,
        "d2h_bytes_per_step": s.d2h_bytes / s.steps if s.steps else 0.0,
        "last_decode": s.last_decode, "launch_s": s.launch_s, "idle_s": s.idle_s, "wait_s": s.wait_s,
        "async_scheduling": w.core.async_scheduling, "launches_ahead": s.ahead, "fed_rows": s.fed_rows,
        "max_launch_tokens": s.max_launch_tokens,
        "speculative": speculative_stats(w.scheduler.speculation),
        "lora": lora_stats(w),
        "transport": "serial" if w.serial else "shm", "wire_bytes": w.executor.wire_bytes,
        "kernels": w.info.get("kernels", {}),
    }


def server_stats(counters: ServerCounters, faults: FaultCounters, requests: RequestTable, router: Router,
                 pool: WorkerPool, fe: Frontend, grammar_cache: int = 0) -> dict:
    elapsed = max(time.time() - counters.started_at, 1e-9)
    workers = pool.workers
    tokens = pool.retired_tokens + sum(w.core.stats.tokens for w in workers)  # every worker that ever ran
    return {
        "queue_length": router.queue_length,
        "running": sum(len(w.scheduler.running) for w in workers),
        "completed": counters.completed, "tokens": tokens,
        "tokens_per_s": tokens / elapsed, "uptime_s": elapsed,
        "workers": [worker_stats(w) for w in workers], "starting": len(pool.starting),
        "routing": router.policy.snapshot(),
        "coordinator": {"pending": len(requests), "clients": len(requests.identities()),
                        "orphans": len(router.orphans), "owed_frames": fe.owed,
                        "rss_bytes": rss_bytes(), "pid": os.getpid(), "grammar_cache": grammar_cache},
        "faults": {**asdict(faults), "client_disconnects": fe.disconnects,
                   "fenced": pool.retired_fenced + sum(w.executor.fenced for w in workers),
                   "worker_failures": [asdict(f) for f in pool.failures]},
    }
