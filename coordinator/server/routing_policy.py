"""Which active worker a request goes to: where its prefix is cached, or its session last ran.

The coordinator holds every worker's block manager, so the scoring is exact, not a guess from
what was sent: the request's full blocks are hashed once (the hashes the block managers name
their blocks by) and each worker answers how many leading ones it holds, cached or in use.

The rule (``cache-aware``, the default): among the workers whose load (waiting + running
sequences) is within ``balance_abs`` sequences, or ``balance_rel`` of the least load, of the least
loaded, the one holding the most leading blocks; ties and no hit at all go to the least loaded.
Equal loads are told apart by the tokens each worker has been given so far (``tokens_scheduled``):
the first of equals would otherwise take every tie, and one-off prompts, heavier than a cached
follow-up, would pile onto it.
A worker past that bound is not chosen for its cache: a hot prefix cannot pile every request on
one worker. A request under a LoRA adapter with no cached prefix goes, within the same bound, to
the least loaded worker with that adapter in a slot (loading it elsewhere would evict another
adapter and cost a copy). ``session`` first prefers the worker that served the request's session last, while
it is active (not draining, not lost), then the same rule. ``least-loaded`` ignores both.

The choice costs O(blocks x workers) dictionary lookups, each worker's walk stopping at its
first miss, and no device work; ``benchmarks/multiturn.py`` measures it at 64 workers.
Tensor-parallel groups are one worker here; the rule reads only coordinator state, so it is
the same whatever transport a worker uses.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusedserve.coordinator.engine.sequence import Sequence
from fusedserve.shared_memory.setting import setting

if TYPE_CHECKING:
    from fusedserve.coordinator.server.worker_pool import WorkerHandle

POLICIES = ("cache-aware", "session", "least-loaded")
REASONS = ("session", "prefix_hit", "lora_resident", "least_loaded", "load_bound")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = setting(
        "cache-aware",
        "which worker a request goes to: cache-aware (the one holding most of its prefix among those near "
        "the least load), session (its session's last worker first: X-Session-Id or user over HTTP, "
        "session_id on ZeroMQ), least-loaded",
        flag="--routing", choices=POLICIES)
    # 8 kept every follow-up turn on its worker in benchmarks/multiturn.py where 4 lost 1-2 of 32
    # with other traffic, at the same load spread.
    balance_abs: int = setting(
        8, "sequences above the least-loaded worker's load a prefix hit may still go to")
    balance_rel: float = setting(0.25, "... or this share of the least load, whichever is more")
    max_sessions: int = setting(1 << 16, "sessions remembered (least recently routed forgotten first)")

    def check(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.balance_abs < 0 or self.balance_rel < 0 or self.max_sessions < 1:
            raise ValueError("routing balance bounds must be >= 0 and max_sessions >= 1")


@dataclass(frozen=True)
class Choice:
    worker: WorkerHandle
    reason: str  # one of REASONS
    hit_blocks: int  # leading blocks of the prompt the chosen worker holds


def _busy(w: WorkerHandle) -> tuple[int, int]:
    """How loaded a worker is: its sequences, then the tokens it has been given (ties)."""
    return w.scheduler.load, w.scheduler.tokens_scheduled


class RoutingPolicy:
    def __init__(self, cfg: RoutingConfig):
        cfg.check()
        self.cfg = cfg
        self.decisions: Counter[str] = Counter({r: 0 for r in REASONS})
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session -> worker id, LRU first

    def choose(self, seq: Sequence, active: list[WorkerHandle]) -> Choice:
        """The worker for ``seq`` among ``active`` (not empty), counted by reason, and the
        session remembered on it."""
        choice = self._choose(seq, active)
        self.decisions[choice.reason] += 1
        if seq.session is not None:
            self._sessions[seq.session] = choice.worker.worker_id
            self._sessions.move_to_end(seq.session)
            while len(self._sessions) > self.cfg.max_sessions:
                self._sessions.popitem(last=False)
        return choice

    def _choose(self, seq: Sequence, active: list[WorkerHandle]) -> Choice:
        least = min(active, key=_busy)
        if self.cfg.policy == "least-loaded":
            return Choice(least, "least_loaded", 0)
        if self.cfg.policy == "session" and seq.session is not None:
            wid = self._sessions.get(seq.session)  # a worker gone or draining is not in ``active``
            for w in active:
                if w.worker_id == wid:
                    return Choice(w, "session", self._hits(w, seq))
        if seq.params.full_prefill:  # computes its whole prompt wherever it runs
            return Choice(least, "least_loaded", 0)
        floor = least.scheduler.load
        bound = floor + max(self.cfg.balance_abs, self.cfg.balance_rel * floor)
        best, best_hits, over = least, 0, 0
        for w in active:
            hits = self._hits(w, seq)
            if w.scheduler.load > bound:
                over = max(over, hits)
            elif hits > best_hits or (hits == best_hits and hits and _busy(w) < _busy(best)):
                best, best_hits = w, hits
        if best_hits:
            return Choice(best, "prefix_hit", best_hits)
        if seq.lora is not None:  # no cached prefix: a worker that has its adapter in a slot
            held = [w for w in active if w.scheduler.load <= bound and w.core.loras is not None
                    and w.core.loras.holds(seq.lora.key)]
            if held:
                return Choice(min(held, key=_busy), "lora_resident", 0)
        return Choice(least, "load_bound" if over else "least_loaded", 0)

    @staticmethod
    def _hits(w: WorkerHandle, seq: Sequence) -> int:
        blocks = w.scheduler.blocks
        return blocks.cached_run(seq.prefix_hashes(blocks.block_size))

    def snapshot(self) -> dict:
        return {"policy": self.cfg.policy, "decisions": dict(self.decisions), "sessions": len(self._sessions)}
