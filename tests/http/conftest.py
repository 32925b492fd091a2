"""The http room's shared fixture: a module's coordinator with its OpenAI gateway and a client."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from fusedserve.coordinator.openai.gateway import Gateway
from fusedserve.coordinator.openai.http_server import HttpServer
from fusedserve.coordinator.server.server import Server
from tests.support import running_server, serving_http


@dataclass
class Served:
    coord: Server
    http: HttpServer
    client: httpx.Client  # on the gateway's URL

    @property
    def url(self) -> str:
        return self.http.url

    @property
    def gw(self) -> Gateway:
        return self.http.gw


@pytest.fixture(scope="module")
def http(request: pytest.FixtureRequest, ray_session) -> Iterator[Served]:
    """Started with the module's ``SERVER`` (``ServerConfig`` names) and ``GATEWAY``
    (``GatewayConfig`` names, optional)."""
    gateway = getattr(request.module, "GATEWAY", {})
    with running_server(**request.module.SERVER) as coord, serving_http(coord, **gateway) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        yield Served(coord, server, client)
