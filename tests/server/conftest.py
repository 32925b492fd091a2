"""The server room's shared fixture: a module's coordinator with real Ray workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fusedserve.coordinator.server.server import Server
from tests.support import running_server


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, ray_session) -> Iterator[Server]:
    """Started with the module's ``SERVER`` (``ServerConfig`` names); a module that needs more
    around its server defines a ``server`` fixture of its own."""
    with running_server(**request.module.SERVER) as coord:
        yield coord
