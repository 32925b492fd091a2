"""The one error a request can end in: a protocol code, a message, and the client's id."""

from __future__ import annotations

from typing import Any


class RequestError(ValueError):
    """A request cannot be served as given; ``code`` is the protocol error code and
    ``request_id`` the client's id where the frame could be read that far."""

    def __init__(self, code: str, message: str, request_id: Any = None):
        super().__init__(message)
        self.code = code
        self.request_id = request_id
