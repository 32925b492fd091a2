"""The engine room's shared fixtures."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.engine.echo_engine import EchoEngine, new_echo_engine


@pytest.fixture
def echo_engine() -> Iterator[Callable[..., EchoEngine]]:
    """A factory of model-free engines (``tests/engine/echo_engine.py``); their arena banks are
    closed after the test."""
    made: list[EchoEngine] = []

    def make(**settings: object) -> EchoEngine:
        made.append(new_echo_engine(**settings))
        return made[-1]

    yield make
    for engine in made:
        for arena in engine.arenas:
            arena.close()
