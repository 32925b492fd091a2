"""`fusedserve serve` as a child process, joined to the test session's Ray cluster."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import ray

SERVING = re.compile(r"serving on (tcp://\S+)")
HTTP = re.compile(r"OpenAI API on (https?://[^/\s]+)")


@dataclass
class ServeProcess:
    """A running coordinator process; ``address`` is where it listens."""

    proc: subprocess.Popen
    address: str
    log_path: Path
    lines: list[str]
    http: str | None = None  # the OpenAI API's base URL, when started with --port

    @classmethod
    def start(cls, log_path: Path, *args: str, timeout_s: float = 120.0,
              join_session: bool = True, env: dict[str, str] | None = None,
              new_session: bool = False) -> ServeProcess:
        """Start ``fusedserve serve ARGS`` and wait for its "serving on" line; it joins the
        test session's Ray cluster unless ``join_session`` is False (its own embedded head).
        ``new_session``: the process leads a session of its own (its processes can be counted)."""
        cmd = [sys.executable, "-m", "fusedserve.coordinator.cli", "serve", "--zmq-port", "0", *args]
        want_http = "--port" in args or "--http-port" in args
        if not want_http:  # ZeroMQ alone: never the default HTTP port 8000
            cmd.append("--no-http")
        if join_session:
            cmd += ["--ray-address", ray.get_runtime_context().gcs_address]
        err = open(log_path, "w")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env=None if env is None else {**os.environ, **env},
                                start_new_session=new_session)
        err.close()
        lines: list[str] = []
        found: list[str] = []
        http: list[str] = []
        done = threading.Event()

        def read() -> None:  # keeps draining stdout so the child never blocks on it
            for line in proc.stdout:
                lines.append(line)
                if not found and (m := SERVING.search(line)):
                    found.append(m.group(1))
                if not http and (m := HTTP.search(line)):
                    http.append(m.group(1))
                if found and (http or not want_http):
                    done.set()
            done.set()

        threading.Thread(target=read, daemon=True).start()
        if not done.wait(timeout_s) or not found:
            proc.kill()
            raise AssertionError(f"serve did not start: {lines} {log_path.read_text()[-3000:]}")
        if want_http and not http:
            proc.kill()
            raise AssertionError(f"no HTTP server: {lines} {log_path.read_text()[-3000:]}")
        return cls(proc, found[0], log_path, lines, http[0] if http else None)

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"serve did not exit: {self.log_path.read_text()[-3000:]}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
