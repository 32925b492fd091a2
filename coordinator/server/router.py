"""Which worker runs a request: the one the routing policy picks among the active ones
(``routing_policy.py``: where its prefix is cached, its session's, or the least loaded), or none
yet (an orphan); and how many workers there are (scaling up spawns, scaling down drains).

Requests that already have a history (moved off a draining worker, or re-run after
a worker was lost) go ahead of new ones. Orphans wait while a worker is starting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from fusedserve.coordinator.engine.sequence import Sequence
from fusedserve.coordinator.errors import RequestError
from fusedserve.coordinator.server.request_table import ClientRequest, RequestTable
from fusedserve.coordinator.server.routing_policy import RoutingPolicy
from fusedserve.coordinator.server.worker_pool import WorkerHandle, WorkerPool


class Router:
    def __init__(self, pool: WorkerPool, requests: RequestTable, policy: RoutingPolicy):
        self.pool = pool
        self.requests = requests
        self.policy = policy
        self.orphans: deque[Sequence] = deque()  # requests with no live worker at the moment

    def _choose(self, seq: Sequence) -> WorkerHandle | None:
        active = self.pool.active
        return self.policy.choose(seq, active).worker if active else None

    def admit(self, seq: Sequence) -> WorkerHandle | None:
        """Queue a new request; the worker it went to, or None if it waits as an orphan."""
        w = self._choose(seq)
        if w is None:
            self.orphans.append(seq)
        else:
            w.scheduler.enqueue(seq)
        return w

    def place(self, seqs: list[Sequence]) -> None:
        """Queue requests that already have a history ahead of new ones (by the same rule: a
        moved request goes where its blocks are, if anywhere)."""
        for seq in reversed(seqs):
            w = self._choose(seq)
            if w is None:
                self.orphans.appendleft(seq)
            else:
                w.scheduler.resume(seq)
            req = self.requests.get(seq.seq_id)
            if req is not None:
                req.worker = w

    def drain(self, w: WorkerHandle) -> None:
        """Stop routing to ``w``; its not-yet-started requests move now, running ones finish there."""
        w.draining = True
        if not self.pool.active:
            return
        moved = list(w.scheduler.waiting)
        w.scheduler.waiting.clear()
        self.place(moved)

    def scale(self, n: int, max_workers: int) -> dict:
        """Grow to ``n`` workers (started in the background) or shrink by draining the newest."""
        if not 1 <= n <= max_workers:
            raise RequestError("bad_field", f"workers must be in [1, {max_workers}]")
        active = self.pool.active
        for _ in range(n - len(active) - len(self.pool.starting)):
            self.pool.spawn()
        for w in reversed(active[n:]):
            self.drain(w)
        return {"active": min(n, len(active)), "starting": len(self.pool.starting),
                "draining": sum(w.draining for w in self.pool.workers)}

    def service_orphans(self, fail: Callable[[str, str, str], None]) -> None:
        """Place orphans once a worker is up; ``fail`` them if none is and none is starting."""
        if self.pool.active:
            seqs = list(self.orphans)
            self.orphans.clear()
            self.place(seqs)
        elif not self.pool.starting:
            seqs = list(self.orphans)
            self.orphans.clear()
            for seq in seqs:
                fail(seq.seq_id, "no_workers", "every worker failed and none could be restarted")

    def unschedule(self, req: ClientRequest) -> None:
        """Take a request out of whichever queue holds it, freeing its KV blocks."""
        if req.worker is not None:
            req.worker.scheduler.abort(req.seq.seq_id)
        elif req.seq in self.orphans:
            self.orphans.remove(req.seq)

    @property
    def queue_length(self) -> int:
        return sum(len(w.scheduler.waiting) for w in self.pool.workers) + len(self.orphans)
