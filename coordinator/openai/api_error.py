"""Errors in OpenAI's shape, with the HTTP status each coordinator code maps to."""

from __future__ import annotations

# Coordinator error codes that are not a 400 (a bad request).
STATUS = {"unauthorized": 401, "model_not_found": 404, "prompt_too_long": 413, "too_many_requests": 429,
          "server_busy": 429,
          "no_workers": 503, "shutdown": 503, "internal": 500, "sampling_error": 500, "worker_error": 500,
          "slow_client": 500}
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
         503: "service_unavailable"}


RETRY_AFTER_S = 1  # a 429's Retry-After: requests in flight here finish in about that time


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @property
    def headers(self) -> dict[str, str]:
        """A 429 says when to come back (RFC 9110 Retry-After, in seconds)."""
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    @classmethod
    def from_reply(cls, reply: dict) -> ApiError:
        code = reply.get("code") or "internal"
        return cls(STATUS.get(code, 400), reply.get("message") or code, code=code)
