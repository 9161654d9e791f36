"""Grammar compiles for an asyncio front end (the server), on a few threads of their own.

xgrammar compiles without the GIL, so the event loop goes on serving /health, streams and other
requests while a large schema compiles (seconds, for an enum of tens of thousands of values).
The number of compiles running or queued is bounded by the caller (``max_pending``), and a wait
may time out; a compile already running cannot be stopped, so it keeps its thread until it ends
and its grammar is cached, for the retry. Requests for a spec (and cache namespace) already
compiling wait for that compile instead of starting another.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass

from pagellm.structured_output.compiler import CacheKey, GrammarCompiler
from pagellm.structured_output.params import StructuredOutputsParams

COMPILE_THREADS = 2  # compiles running at once; the others queue


class CompilePoolFullError(RuntimeError):
    """``max_pending`` compiles are running or queued: a new one is refused."""


@dataclass
class _Job:
    future: concurrent.futures.Future
    done: asyncio.Future  # ``future`` as seen from the loop
    waiters: int = 0


class GrammarCompilePool:
    """Runs ``compiler.compile`` on its own threads; used from one event loop."""

    def __init__(self, compiler: GrammarCompiler, threads: int = COMPILE_THREADS) -> None:
        self.compiler = compiler
        self._executor = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="pagellm-grammar-compile")
        self._jobs: dict[CacheKey, _Job] = {}

    @property
    def num_pending(self) -> int:
        """Compiles running or queued (one whose waiters timed out counts until it ends)."""
        return len(self._jobs)

    async def compile(self, spec: StructuredOutputsParams, namespace: str | None = None,
                      timeout_s: float | None = None, max_pending: int | None = None) -> None:
        """Compile ``spec`` for ``namespace`` (cached there, see GrammarCompiler.compile).
        Raises ValueError for a spec that does not compile, CompilePoolFullError when a new
        compile would make more than ``max_pending`` (joining one is never refused), and
        TimeoutError after ``timeout_s`` (the compile goes on). A cancelled wait drops the
        compile if it has not started and nobody else waits for it."""
        key = self.compiler.cache_key(spec, namespace)
        job = self._jobs.get(key)
        if job is None:
            if max_pending is not None and len(self._jobs) >= max_pending:
                raise CompilePoolFullError(f"{len(self._jobs)} grammar compiles are running or "
                                           "queued")
            future = self._executor.submit(self.compiler.compile, spec, namespace)
            job = self._jobs[key] = _Job(future, asyncio.wrap_future(future))
            job.done.add_done_callback(lambda _: self._finished(key, job))
        job.waiters += 1
        try:
            done, _ = await asyncio.wait([job.done], timeout=timeout_s)
        except asyncio.CancelledError:
            if job.waiters == 1 and job.future.cancel():
                self._finished(key, job)
            raise
        finally:
            job.waiters -= 1
        if not done:
            raise TimeoutError(f"the grammar did not compile within {timeout_s:g} s")
        job.done.result()

    def _finished(self, key: CacheKey, job: _Job) -> None:
        if self._jobs.get(key) is job:
            del self._jobs[key]
        if job.done.done() and not job.done.cancelled():
            job.done.exception()  # retrieved: waiters that timed out leave it unread

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
