"""Grammar compiles off the coordinator's loop: each request's constraint compiles on a thread,
and the loop collects it when it is done or past its deadline.

A compile can take seconds (50,000 choices: about 4 s here) and no stream may pause for it. A
compile still running at ``GrammarLimits.compile_timeout_s`` refuses its request
(``grammar_timeout``); its thread finishes in the background and counts against ``max_pending``,
so a flood of slow grammars is refused (``server_busy``) rather than queued without bound.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from fusedserve.coordinator.errors import RequestError
from fusedserve.coordinator.structured.grammar_compiler import GrammarCompiler
from fusedserve.coordinator.structured.grammar_state import GrammarState
from fusedserve.coordinator.structured.structured_spec import StructuredError, StructuredSpec


@dataclass
class _Job:
    key: str
    future: Future
    deadline: float


class CompileQueue:
    def __init__(self, compiler: GrammarCompiler, threads: int = 2, max_pending: int = 64):
        self.compiler = compiler
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._jobs: list[_Job] = []
        self._running: list[Future] = []  # every compile not done yet, collected or not

    def submit(self, key: str, spec: StructuredSpec) -> None:
        """Start compiling ``spec`` for the request ``key``; RequestError if too many are running."""
        self._running = [f for f in self._running if not f.done()]
        if len(self._running) >= self.max_pending:
            raise RequestError("server_busy", f"{len(self._running)} grammars are compiling; retry later")
        future = self._pool.submit(self.compiler.state, spec)
        self._running.append(future)
        self._jobs.append(_Job(key, future, time.monotonic() + self.compiler.limits.compile_timeout_s))

    def finished(self) -> list[tuple[str, GrammarState | RequestError]]:
        """Jobs that are done (their state, or the error that refuses the request) or out of time."""
        now, out, left = time.monotonic(), [], []
        for job in self._jobs:
            if job.future.done():
                out.append((job.key, _result(job.future)))
            elif now > job.deadline:
                limit = self.compiler.limits.compile_timeout_s
                why = f"the constraint did not compile in {limit:g} s"
                out.append((job.key, RequestError("grammar_timeout", why)))
            else:
                left.append(job)
        self._jobs = left
        return out

    @property
    def pending(self) -> int:
        return len(self._jobs)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _result(future: Future) -> GrammarState | RequestError:
    try:
        return future.result()
    except StructuredError as exc:
        return RequestError("bad_structured_output", str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug in a compile fails its request alone
        return RequestError("internal", f"the constraint could not compile: {type(exc).__name__}: {exc}")
