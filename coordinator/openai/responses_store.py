"""The Responses API's store: responses kept by id, in memory, bounded by count and by bytes.

A kept response holds what a later request continues with ``previous_response_id``: the
conversation up to and including its own output, as chat messages, and its input items for
``/v1/responses/{id}/input_items``. The oldest is dropped first when either bound is passed, so
a client flooding it costs memory up to the bounds and no more.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as returned
    conversation: list[dict]  # chat messages: history, this request's input, its output
    input_items: list[dict]  # this request's input as Responses items
    nbytes: int


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # handlers run on the gateway's loop, its threads read too

    def put(self, response: dict, conversation: list[dict], input_items: list[dict]) -> bool:
        """Keep it (False where it alone exceeds the byte bound or the store keeps none)."""
        size = len(json.dumps([response, conversation, input_items]))
        if self.max_count < 1 or size > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(response["id"], None)
            if old is not None:
                self._bytes -= old.nbytes
            self._items[response["id"]] = StoredResponse(response, conversation, input_items, size)
            self._bytes += size
            while len(self._items) > self.max_count or self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.nbytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            old = self._items.pop(response_id, None)
            if old is not None:
                self._bytes -= old.nbytes
            return old is not None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes
