"""Tensor parallelism: one worker process per rank, driven from the engine process.

Every rank, rank 0 included, is a worker process (see docs/parallelism.md for why): the engine
process never enters a collective, so it can always notice a dead worker and stop the others.
Each call is pickled once into a shared-memory ring that all ranks read (shm_broadcast.py); for
``execute_model`` rank 0 alone answers, with the sampled tokens, through its pipe. A watchdog
thread waits on the workers' process sentinels: a death is logged at once and the other ranks
are stopped (they would hang in their next collective); the engine's next call raises
WorkerFailedError naming the rank.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

from pagellm.config import EngineConfig
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.errors import WorkerFailedError

logger = logging.getLogger("pagellm")

WORKER_STARTUP_TIMEOUT_S = 900.0  # loading a large checkpoint from a slow disk
_SHUTDOWN_GRACE_S = 5.0


def cpu_threads_per_rank(tp_size: int) -> int:
    """On CPU the ranks split this process's cores (they would fight over them otherwise)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // tp_size)


class MultiprocExecutor:
    """``tensor_parallel_size`` worker processes, one per rank (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, config: EngineConfig, eos_token_id: int | None,
                 startup_timeout_s: float = WORKER_STARTUP_TIMEOUT_S) -> None:
        from pagellm.distributed.shm_broadcast import ShmBroadcastWriter
        from pagellm.worker.worker_proc import WorkerArgs, run_worker

        self.tp_size = tp = config.parallel.tensor_parallel_size
        device = config.device.device
        self._closed = False
        self._failure: str | None = None
        self._lock = threading.Lock()  # guards _closed / _failure
        self._proc_lock = threading.Lock()  # one thread at a time reaps the workers
        self._call_id = 0  # replies carry it: one left over from an interrupted call is dropped
        self._broadcast = ShmBroadcastWriter(num_readers=tp)
        ctx = multiprocessing.get_context("spawn")  # fork after torch/threads is unsafe
        # The ranks meet through a file in a private directory: a TCP port picked here could be
        # taken by another process before rank 0 listens on it (EADDRINUSE on a busy host).
        self._rendezvous_dir = tempfile.mkdtemp(prefix="pagellm-tp-")  # created 0700
        init_method = f"file://{os.path.join(self._rendezvous_dir, 'rendezvous')}"
        threads = cpu_threads_per_rank(tp) if device.type == "cpu" else None
        self.procs: list[Any] = []
        self._conns: list[Connection] = []
        config = _share_cpu_kv_default(config)
        for rank in range(tp):
            recv_end, send_end = ctx.Pipe(duplex=False)
            args = WorkerArgs(
                rank=rank, tp_size=tp, config=_rank_config(config, rank),
                eos_token_id=eos_token_id, backend="nccl" if device.type == "cuda" else "gloo",
                init_method=init_method, broadcast=self._broadcast.handle, conn=send_end,
                parent_pid=os.getpid(), num_threads=threads,
                log_level=logging.getLogger("pagellm").getEffectiveLevel())
            self.procs.append(ctx.Process(target=run_worker, args=(args,), daemon=True,
                                          name=f"pagellm-tp-rank{rank}"))
            self._conns.append(recv_end)
        _register_cleanup(self)
        try:
            for proc in self.procs:
                proc.start()
            logger.info("Started %d tensor-parallel workers (pids %s; %s on %s%s)", tp,
                        [p.pid for p in self.procs], "NCCL" if device.type == "cuda" else "gloo",
                        init_method, f"; {threads} CPU threads each" if threads else "")
            ready = self._wait_replies(range(tp), startup_timeout_s, kind="ready")
        except WorkerFailedError as e:
            if "died unexpectedly" not in str(e):
                raise
            raise WorkerFailedError(
                f"{e} Its own error is in the log above. Workers are spawned, so they import "
                "the main script again: a script that builds an engine with tensor_parallel_size "
                "> 1 needs an `if __name__ == \"__main__\":` guard.") from None
        except BaseException:
            self.shutdown()
            raise
        self.rank_info: list[dict[str, Any]] = [ready[r] for r in range(tp)]
        self._watchdog_stop_r, self._watchdog_stop_w = ctx.Pipe(duplex=False)
        threading.Thread(target=_watchdog, name="pagellm-tp-watchdog", daemon=True,
                         args=(weakref.ref(self), [p.sentinel for p in self.procs],
                               self._watchdog_stop_r)).start()

    # ---- the Executor interface ------------------------------------------------------------
    def initialize_kv_cache(self) -> int:
        blocks = self._call_all("initialize_kv_cache")
        assert len(set(blocks)) == 1, f"ranks disagree on the number of KV blocks: {blocks}"
        self.rank_info = self._call_all("rank_info")  # now with the KV cache's memory
        for info in self.rank_info:
            logger.info("tp rank %d (pid %d): %.1f MiB of parameters (read %.1f MiB of "
                        "checkpoint), %d KV blocks; resident %.1f MiB, peak %.1f MiB",
                        info["rank"], info["pid"], info["weight_bytes"] / 2**20,
                        info["checkpoint_bytes_read"] / 2**20, info["num_blocks"],
                        info.get("rss_bytes", 0) / 2**20, info.get("max_rss_bytes", 0) / 2**20)
        return blocks[0]

    def execute_model(self, sched_output: SchedulerOutput) -> ModelRunnerOutput:
        self._send("execute_model", (sched_output,), (0,))
        return self._wait_replies((0,), None)[0]

    def execute_model_async(self, sched_output: SchedulerOutput) -> _StepReply:
        """Broadcast the step and return; rank 0's reply is read by ``result()``. The ranks run
        the calls in order, so the engine collects them in order too, and makes no other call
        while one is outstanding (EngineCore drains it first)."""
        self._send("execute_model", (sched_output,), (0,))
        return _StepReply(self, self._call_id)

    def _call_all(self, method: str, args: tuple = (), timeout_s: float | None = None
                  ) -> list[Any]:
        """Run ``Worker.<method>(*args)`` on every rank; the results in rank order."""
        self._send(method, args, tuple(range(self.tp_size)))
        replies = self._wait_replies(range(self.tp_size), timeout_s)
        return [replies[r] for r in range(self.tp_size)]

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``method`` (a Worker or ModelRunner method's name, or a picklable callable taking
        the ModelRunner first) on every rank; the results in rank order. An exception on a
        rank is raised here (the first rank's) and the workers go on."""
        results = self._call_all("rpc", (method, args, kwargs))
        for ok, value in results:
            if not ok:
                raise value
        return [value for _, value in results]

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and free the ring; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        stop_w = getattr(self, "_watchdog_stop_w", None)
        if stop_w is not None:
            stop_w.send(None)
        started = [p for p in self.procs if p.pid is not None]
        if self._failure is None and started and all(p.is_alive() for p in started):
            try:
                self._broadcast.enqueue((0, "shutdown", (), ()))
                deadline = time.monotonic() + _SHUTDOWN_GRACE_S
                for proc in started:
                    proc.join(max(0.0, deadline - time.monotonic()))
            except Exception:  # the ring cannot take it: the workers are terminated below
                pass
        self._terminate_workers()
        for conn in self._conns:
            conn.close()
        self._broadcast.close()
        if getattr(self, "_rendezvous_dir", None):
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.shutdown()

    # ---- internals ------------------------------------------------------------------------
    def _send(self, method: str, args: tuple, reply_ranks: tuple[int, ...]) -> None:
        self._check_healthy()
        self._call_id += 1
        self._broadcast.enqueue((self._call_id, method, args, reply_ranks),
                                check_alive=self._check_healthy)

    def _check_healthy(self) -> None:
        if self._failure is not None:
            raise WorkerFailedError(self._failure)
        if self._closed:
            raise WorkerFailedError("the tensor-parallel workers have been shut down")
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._fail(self._death_message(rank))

    def _wait_replies(self, ranks: Iterable[int], timeout_s: float | None, kind: str = "ok",
                      call_id: int | None = None) -> dict[int, Any]:
        """Wait for ``kind`` replies from ``ranks`` to call ``call_id`` (default: the last
        sent). An error or death of any rank (not only of those) raises WorkerFailedError
        naming it."""
        awaited = self._call_id if call_id is None else call_id
        pending = set(ranks)
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rank_of = {id(c): r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*self._conns, *sentinels], remaining)
            if not ready:
                self._fail(f"tensor-parallel ranks {sorted(pending)} did not answer within "
                           f"{timeout_s:.0f} s")
            # Messages first: a rank that failed says why before its sentinel fires.
            for obj in sorted(ready, key=lambda o: not isinstance(o, Connection)):
                if not isinstance(obj, Connection):
                    self._fail(self._death_message(sentinels[obj]))
                rank = rank_of[id(obj)]
                try:
                    status, reply_id, payload = obj.recv()
                except (EOFError, OSError):
                    self._fail(self._death_message(rank))
                if status == "error":
                    text, exc = payload
                    if isinstance(exc, ValueError):  # a user error (say, KV does not fit)
                        self._record_failure(f"tensor-parallel rank {rank}: {exc}")
                        self.shutdown()
                        raise ValueError(f"{exc} (tensor-parallel rank {rank})") from None
                    self._fail(f"tensor-parallel worker rank {rank} failed:\n{text}")
                if reply_id != awaited:
                    continue  # the answer to a call interrupted in this process (Ctrl-C)
                assert status == kind and rank in pending, (status, rank, kind)
                results[rank] = payload
                pending.discard(rank)
        return results

    def _death_message(self, rank: int) -> str:
        proc = self.procs[rank]
        with self._proc_lock:
            proc.join(0.5)  # let the exit code land
        return (f"tensor-parallel worker rank {rank} (pid {proc.pid}) died unexpectedly "
                f"(exit code {proc.exitcode}); the engine is shutting down.")

    def _terminate_workers(self) -> None:
        with self._proc_lock:
            for proc in self.procs:
                _stop_process(proc)

    def _fail(self, message: str) -> NoReturn:
        """Record the first failure, stop every worker at once (a surviving rank may be blocked
        in a collective with the dead one) and raise."""
        self._record_failure(message)
        self.shutdown()
        raise WorkerFailedError(self._failure)

    def _record_failure(self, message: str) -> None:
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = message
        if first:
            logger.error("%s", message)
        self._terminate_workers()


@dataclasses.dataclass
class _StepReply:
    """An ``execute_model_async`` call: its reply, read on demand."""

    executor: MultiprocExecutor
    call_id: int

    def result(self) -> ModelRunnerOutput:
        return self.executor._wait_replies((0,), None, call_id=self.call_id)[0]


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank r runs on cuda:(first + r), first being the config's GPU index (0, or a
    data-parallel rank's first GPU); on CPU all ranks share the one config."""
    if config.device.device.type != "cuda":
        return config
    import torch

    first = config.device.device.index or 0
    device = dataclasses.replace(config.device, device=torch.device("cuda", first + rank))
    return dataclasses.replace(config, device=device)


def _share_cpu_kv_default(config: EngineConfig) -> EngineConfig:
    """On CPU the ranks share the host's RAM: --kv-cache-memory is per rank, and its default (a
    share of the free RAM) is divided among the ranks, not taken by each."""
    if config.device.device.type != "cpu" or config.cache.kv_cache_memory is not None:
        return config
    from pagellm.memory_plan import default_cpu_kv_budget

    share = default_cpu_kv_budget() // config.parallel.tensor_parallel_size
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                 kv_cache_memory=share))


def _stop_process(proc: Any) -> None:
    if proc.pid is None:
        return
    if proc.is_alive():
        proc.terminate()
        proc.join(2.0)
    if proc.is_alive():
        proc.kill()
    proc.join(2.0)


def _watchdog(ref: weakref.ref, sentinels: list[int], stop: Connection) -> None:
    """Notice a worker's death even while the engine is idle: log it and stop the other ranks
    (the owner's next call raises, and its shutdown() frees the rest)."""
    ready = wait([*sentinels, stop])
    executor = ref()
    if executor is None or stop in ready or executor._closed:
        return
    rank = sentinels.index(next(s for s in ready if s is not stop))
    executor._record_failure(executor._death_message(rank))


def _register_cleanup(executor: MultiprocExecutor) -> None:
    ref = weakref.ref(executor)

    def cleanup() -> None:
        ex = ref()
        if ex is not None:
            ex.shutdown()

    atexit.register(cleanup)
