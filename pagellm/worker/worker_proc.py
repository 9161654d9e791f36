"""One tensor-parallel rank in its own process: join the group, build the model runner, then run
what the engine broadcasts until it says stop or is gone.

Protocol. Engine -> workers, through the shared-memory broadcast: ``(call_id, method, args,
reply_ranks)`` with ``method`` one of Worker's RPC methods, or ``"shutdown"``. Worker -> engine,
through its own pipe: ``("ready", 0, rank_info)`` once, then ``("ok", call_id, result)`` for each
call whose ``reply_ranks`` names this rank (``execute_model``: rank 0 only), or ``("error",
call_id, (traceback, exception or None))`` once before exiting with status 1.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pagellm.config import EngineConfig
from pagellm.distributed.shm_broadcast import (
    BroadcastHandle,
    BrokenBroadcastError,
    ShmBroadcastReader,
)

logger = logging.getLogger("pagellm")

RPC_METHODS = ("initialize_kv_cache", "execute_model", "rank_info", "rpc")


@dataclass
class WorkerArgs:
    """Everything a rank needs, passed (pickled) at spawn."""

    rank: int
    tp_size: int
    config: EngineConfig  # with this rank's device (cuda:rank on CUDA)
    eos_token_id: int | None
    backend: str  # "gloo" or "nccl"
    init_method: str  # file://<private dir>/rendezvous (torch.distributed's file store)
    broadcast: BroadcastHandle
    conn: Connection  # worker -> engine
    parent_pid: int
    num_threads: int | None  # CPU: torch threads of this rank (the cores are split)
    log_level: int = logging.INFO


class Worker:
    """The RPC surface of one rank: its ModelRunner plus what the engine may ask about it."""

    def __init__(self, args: WorkerArgs) -> None:
        from pagellm.engine.fault_injection import FaultInjector
        from pagellm.worker.model_runner import ModelRunner

        self.rank = args.rank
        self.runner = ModelRunner(args.config, args.eos_token_id)
        # A test hook; None unless asked for.
        self.fault_injector = FaultInjector.from_env(args.config.env)
        if self.fault_injector is not None:
            self.fault_injector.install(self.runner.model)

    def initialize_kv_cache(self) -> int:
        return self.runner.initialize_kv_cache()

    def execute_model(self, sched_output: Any) -> Any:
        # NOTE: a rank that raises exits (see _loop): its peers may be inside a collective, so
        # the executor cannot go on, and the engine shuts down (WorkerFailedError).
        if self.fault_injector is not None:
            self.fault_injector.check_step(sched_output)
        return self.runner.execute_model(sched_output)

    def rpc(self, method: Any, args: tuple, kwargs: dict[str, Any] | None
            ) -> tuple[bool, Any]:
        """``collective_rpc``: (True, result), or (False, the exception): a failed call (a bad
        weight name) fails on every rank alike, outside any collective, so the rank goes on."""
        from pagellm.worker.rpc import run_method

        try:
            return True, run_method((self, self.runner), method, args, kwargs)
        except Exception as e:
            try:
                pickle.dumps(e)
            except Exception:
                e = RuntimeError(f"{type(e).__name__}: {e}")
            return False, e

    def rank_info(self) -> dict[str, Any]:
        """Who this rank is and what it holds (weights, checkpoint bytes read, memory)."""
        import torch

        r = self.runner
        info: dict[str, Any] = {
            "rank": self.rank, "pid": os.getpid(), "device": str(r.device),
            "weight_bytes": r.weight_bytes, "checkpoint_bytes_read": r.checkpoint_bytes_read,
            "num_blocks": r.num_blocks, "num_threads": torch.get_num_threads(),
            "load_seconds": r.load_seconds,
        }
        info.update(_proc_memory())
        if r.device.type == "cuda":
            info["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(r.device)
        return info


def _proc_memory() -> dict[str, int]:
    """Resident (VmRSS) and peak resident (VmHWM) bytes of this process, from /proc."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = {"VmRSS:": "rss_bytes", "VmHWM:": "max_rss_bytes"}.get(line.split(":")[0]
                                                                             + ":")
                if key:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _die_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux), even while it blocks in a collective."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the broadcast's parent check still ends the loop


def run_worker(args: WorkerArgs) -> None:
    """Entry point of a rank's process."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the engine decides when we stop
    logging.basicConfig(level=args.log_level,
                        format=f"%(levelname)s %(asctime)s [tp rank {args.rank}] %(message)s")
    logging.getLogger("pagellm").setLevel(args.log_level)
    conn = args.conn
    try:
        worker = _start(args)
        conn.send(("ready", 0, worker.rank_info()))
    except BaseException:
        _report_and_exit(conn, args.rank, 0)
    reader = ShmBroadcastReader(args.broadcast, args.rank)
    exit_code = 0
    try:
        exit_code = _loop(worker, reader, conn, args)
    finally:
        reader.close()
    # Skip interpreter teardown: seconds with torch loaded, and the process group's destructors
    # (gloo aborts at a normal exit with its group alive; NCCL may wait on a dead peer).
    os._exit(exit_code)


def _start(args: WorkerArgs) -> Worker:
    import torch

    from pagellm.distributed.parallel_state import init_tp

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    if args.config.device.device.type == "cuda":
        torch.cuda.set_device(args.config.device.device)
    init_tp(args.rank, args.tp_size, args.backend, args.init_method)
    return Worker(args)


def _loop(worker: Worker, reader: ShmBroadcastReader, conn: Connection,
          args: WorkerArgs) -> int:
    def engine_gone() -> bool:
        return os.getppid() != args.parent_pid

    while True:
        try:
            call_id, method, call_args, reply_ranks = reader.dequeue(should_stop=engine_gone)
        except BrokenBroadcastError:
            logger.warning("tp rank %d: the engine process is gone; exiting.", args.rank)
            return 0
        if method == "shutdown":
            return 0
        assert method in RPC_METHODS, method
        try:
            result = getattr(worker, method)(*call_args)
        except BaseException:
            _report(conn, args.rank, call_id)
            return 1
        if args.rank in reply_ranks:
            conn.send(("ok", call_id, result))


def _report(conn: Connection, rank: int, call_id: int) -> None:
    """Send the current exception (its traceback, and the exception itself when it pickles)."""
    exc = sys.exc_info()[1]
    text = traceback.format_exc()
    logger.error("tp rank %d failed:\n%s", rank, text)
    try:
        exc = pickle.loads(pickle.dumps(exc))
    except Exception:
        exc = None
    try:
        conn.send(("error", call_id, (text, exc)))
    except (OSError, ValueError):
        pass  # the engine is gone too


def _report_and_exit(conn: Connection, rank: int, call_id: int) -> None:
    _report(conn, rank, call_id)
    os._exit(1)  # skip multiprocessing's exit handlers; the message is the status
