"""Every request in flight: who asked, under which id, where it runs, and its timings."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fusedserve.coordinator.engine.sequence import Sequence

if TYPE_CHECKING:
    from fusedserve.coordinator.server.worker_pool import WorkerHandle


@dataclass
class ClientRequest:
    identity: bytes  # the client's ROUTER identity
    client_id: Any  # the id the client chose
    stream: bool
    seq: Sequence
    worker: WorkerHandle | None  # None: waiting for a worker to come up (or for its grammar)
    t_arrival: float
    t_first: float | None = None
    # Who the limits count it for: the connection, and the end client a gateway names on it.
    end_client: str | None = None

    @property
    def limit_key(self) -> tuple[bytes, str | None]:
        return self.identity, self.end_client


class RequestTable:
    """Requests by sequence id and by (connection, client id), with a count per end client: a
    connection, or one end client of a gateway's connection (``ClientRequest.limit_key``)."""

    def __init__(self) -> None:
        self._by_seq: dict[str, ClientRequest] = {}
        self._by_client: dict[tuple[bytes, Any], str] = {}
        self._per_client: Counter[tuple[bytes, str | None]] = Counter()

    def add(self, req: ClientRequest) -> None:
        self._by_seq[req.seq.seq_id] = req
        self._by_client[(req.identity, req.client_id)] = req.seq.seq_id
        self._per_client[req.limit_key] += 1

    def get(self, seq_id: str) -> ClientRequest | None:
        return self._by_seq.get(seq_id)

    def find(self, identity: bytes, client_id: Any) -> ClientRequest | None:
        seq_id = self._by_client.get((identity, client_id))
        return None if seq_id is None else self._by_seq[seq_id]

    def pop(self, seq_id: str) -> ClientRequest | None:
        req = self._by_seq.pop(seq_id, None)
        if req is not None:
            self._by_client.pop((req.identity, req.client_id), None)
            self._per_client[req.limit_key] -= 1
            if self._per_client[req.limit_key] <= 0:
                del self._per_client[req.limit_key]
        return req

    def queued_since(self, cutoff: float) -> list[ClientRequest]:
        """Requests that arrived before ``cutoff`` (perf_counter) and no launch has taken yet. The
        table holds them in arrival order, so the walk stops at the first younger one."""
        old = []
        for req in self._by_seq.values():
            if req.t_arrival >= cutoff:
                break
            if req.seq.t_scheduled is None:
                old.append(req)
        return old

    def of_client(self, identity: bytes) -> list[ClientRequest]:
        return [r for r in self._by_seq.values() if r.identity == identity]

    def in_flight(self, identity: bytes, end_client: str | None = None) -> int:
        return self._per_client[identity, end_client]

    def identities(self) -> set[bytes]:
        """The connections with requests in flight."""
        return {identity for identity, _ in self._per_client}

    def __len__(self) -> int:
        return len(self._by_seq)

    def __iter__(self) -> Iterator[ClientRequest]:
        return iter(list(self._by_seq.values()))
