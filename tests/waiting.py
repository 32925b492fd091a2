"""Polling helper shared by the tests that wait on other processes."""

from __future__ import annotations

import time
from collections.abc import Callable

from shared_memory.arena import pid_alive


def wait_for(pred: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.005) -> None:
    """Poll ``pred`` until it is truthy; fail naming ``what`` after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pred():
            return
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


__all__ = ["pid_alive", "wait_for"]
