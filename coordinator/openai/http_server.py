"""uvicorn serving the gateway's app on a thread of the serve process."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from fusedserve.coordinator.client import AsyncClient
from fusedserve.coordinator.openai.api import build_app
from fusedserve.coordinator.openai.gateway import Gateway


class HttpServer:
    """uvicorn on a thread of its own, where the gateway's ``HttpConfig`` says; ``start`` returns
    once it accepts connections. With ``ssl_certfile`` and ``ssl_keyfile`` (PEM) it serves HTTPS
    only."""

    def __init__(self, gw: Gateway):
        http = gw.config.http
        http.check()
        self.gw = gw
        self.app = build_app(gw)
        self.tls = http.ssl_certfile is not None
        host, port = http.host, http.port
        access = http.uvicorn_log_level in ("info", "debug", "trace")
        config = uvicorn.Config(self.app, host=host, port=port, log_level=http.uvicorn_log_level,
                                access_log=access, lifespan="off", timeout_graceful_shutdown=2,
                                ssl_keyfile=http.ssl_keyfile, ssl_certfile=http.ssl_certfile)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True, name="http")
        self.host, self.port = host, port

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self.gw.client = AsyncClient(self.gw.coordinator, token=self.gw.token,
                                     curve_server_key=self.gw.curve_server_key,
                                     admin_token=self.gw.config.admin_token)
        health = asyncio.get_running_loop().create_task(self.gw.watch_health())
        try:
            await self.server.serve()
        finally:
            health.cancel()
            self.gw.client.close()

    def start(self, timeout_s: float = 30.0) -> None:
        self.thread.start()
        deadline = time.time() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the HTTP API could not listen on {self.host}:{self.port} (in use? "
                                   "choose another --port, or --no-http)")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
