"""The engine core in its own process, and the front end's handle on it.

``EngineCoreProc`` runs EngineCore's busy loop in a child process: requests and aborts come in on
one pyzmq socket, EngineCoreOutputs and scheduler stats go out on another, both on ipc:// paths in
a private temp dir. ``EngineCoreClient`` (in the front end) starts that process, sends to it and
owns the sockets; AsyncLLM reads the output socket.

Wire format: pickled tuples (both ends are this codebase; the sockets live in a 0700 directory).
  front -> core: ("add", [Request]), ("abort", [req_id], RequestStatus),
                 ("utility", call_id, method_name[, args]), ("shutdown",)
  core -> front: ("ready", {"pid", "num_blocks"}), ("outputs", EngineCoreOutputs),
                 ("utility", call_id, result), ("error", message)
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import zmq

from pagellm.core.sched_output import EngineCoreOutput
from pagellm.errors import EngineDeadError
from pagellm.metrics.stats import SchedulerStats
from pagellm.request import FinishReason, Request, RequestStatus

logger = logging.getLogger("pagellm")

_PARENT_CHECK_MS = 1000  # how often an idle engine checks that its parent is still alive
_UTILITIES = ("reset_prefix_cache", "update_weights_from_disk", "sleep", "wake_up",
              "is_sleeping")
# Utilities that run only once the running requests have drained: meanwhile new requests are
# held back (admitted right after), so in-flight ones finish on the weights they started with.
# wake_up too, so it never overtakes a sleep still waiting for the drain.
_AFTER_DRAIN = ("update_weights_from_disk", "sleep", "wake_up")


@dataclass(slots=True)
class EngineCoreOutputs:
    """One step's results. ``first_scheduled_times`` holds, for requests whose first output is in
    this batch, when the scheduler first ran them (time.monotonic, shared by both processes on
    Linux), so the front end can measure queue time."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None
    first_scheduled_times: dict[str, float] = field(default_factory=dict)
    timestamp: float = 0.0
    # Sequences this engine has received so far: a data-parallel front end counts those it
    # sent and not yet received as waiting (engine/dp_client.py).
    num_requests_received: int = 0


def _dumps(msg: tuple) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the parent dies, so a killed server leaves no orphan."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the idle loop's getppid() check still catches it


class EngineCoreProc:
    """EngineCore plus its busy loop, inside the engine process."""

    def __init__(self, core: Any, input_path: str, output_path: str, parent_pid: int) -> None:
        self.core = core
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.connect(input_path)
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.setsockopt(zmq.SNDHWM, 0)
        self.output_socket.connect(output_path)
        # Requests by id, to read first_scheduled_time after the scheduler sets it.
        self._unseen: dict[str, Request] = {}
        # Requests whose admission raised: sent, failed, with the next outputs.
        self._failed_adds: list[EngineCoreOutput] = []
        # _AFTER_DRAIN calls waiting for the engine to drain, and the requests held meanwhile.
        self._pending_utilities: list[tuple[int, str, tuple]] = []
        self._held: list[Request] = []
        self._num_received = 0
        self._running = True

    def send(self, msg: tuple) -> None:
        self.output_socket.send(_dumps(msg), copy=False)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            self._num_received += len(msg[1])
            if self._pending_utilities:
                self._held.extend(msg[1])
                return
            for request in msg[1]:
                self._add_request(request)
        elif kind == "abort":
            ids = set(msg[1])
            self._held = [r for r in self._held if r.request_id not in ids]
            for req_id in msg[1]:
                self._unseen.pop(req_id, None)
            self.core.abort_requests(msg[1], msg[2])
        elif kind == "utility":
            _, call_id, method, *rest = msg
            assert method in _UTILITIES, method
            args = tuple(rest[0]) if rest else ()
            if method in _AFTER_DRAIN:
                self._pending_utilities.append((call_id, method, args))
                self._run_pending()
            else:
                self._run_utility(call_id, method, args)
        elif kind == "shutdown":
            self._running = False
        else:
            raise AssertionError(f"unknown message {kind!r}")

    def _run_utility(self, call_id: int, method: str, args: tuple) -> None:
        try:
            result: Any = getattr(self.core, method)(*args)
        except Exception as e:  # report to the caller, keep serving
            result = e
        self.send(("utility", call_id, result))

    def _run_pending(self) -> None:
        """Run the _AFTER_DRAIN calls once no request is running; then admit the held ones."""
        if not self._pending_utilities or self.core.has_unfinished_requests():
            return
        pending, self._pending_utilities = self._pending_utilities, []
        for call in pending:
            self._run_utility(*call)
        held, self._held = self._held, []
        for request in held:
            self._add_request(request)

    def _add_request(self, request: Request) -> None:
        """Admit one request. If that raises, only this request fails (finish_reason "error"
        in the next outputs): the engine and every other request go on."""
        try:
            self.core.add_request(request)
        except Exception as e:
            # NOTE: the id only: the prompt is user data and stays out of the log.
            logger.error("Could not admit request %s: %s: %s", request.request_id,
                         type(e).__name__, e, exc_info=e)
            self._failed_adds.append(EngineCoreOutput(
                req_id=request.request_id, new_token_ids=[],
                finish_reason=FinishReason.ERROR.value))
            return
        self._unseen[request.request_id] = request

    def _parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def _drain_input(self, block: bool) -> bool:
        """Handle every queued message; when ``block``, wait for at least one first."""
        handled = False
        if block:
            while not self.input_socket.poll(_PARENT_CHECK_MS):
                if not self._parent_alive():
                    logger.warning("Engine core: the server process is gone; exiting.")
                    self._running = False
                    return False
        while True:
            try:
                frame = self.input_socket.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return handled
            self._handle(pickle.loads(frame.buffer))
            handled = True

    def run_busy_loop(self) -> None:
        core = self.core
        while self._running:
            self._run_pending()
            handled = self._drain_input(block=not core.has_unfinished_requests())
            if not self._running:
                break
            stepped = core.has_unfinished_requests()
            outputs = core.step() if stepped else []
            if self._failed_adds:
                outputs = self._failed_adds + outputs
                self._failed_adds = []
            if not (stepped or handled):
                continue
            first_sched: dict[str, float] = {}
            for out in outputs:
                request = self._unseen.pop(out.req_id, None)
                if request is not None and request.first_scheduled_time is not None:
                    first_sched[out.req_id] = request.first_scheduled_time
            # NOTE: stats go out even when no token did (an abort while idle), so the
            # front end's gauges return to zero.
            self.send(("outputs", EngineCoreOutputs(outputs, core.make_stats(), first_sched,
                                                    time.monotonic(), self._num_received)))

    def close(self) -> None:
        try:
            self.core.shutdown()
        finally:
            self.input_socket.close(linger=0)
            self.output_socket.close(linger=1000)
            self.ctx.term()


def _make_core(config: Any, eos_token_id: int | None, core_factory: Any) -> Any:
    if core_factory is not None:
        return core_factory(config, eos_token_id)
    from pagellm.engine.core import EngineCore

    return EngineCore(config, eos_token_id)


def run_engine_core(config: Any, eos_token_id: int | None, input_path: str, output_path: str,
                    parent_pid: int, core_factory: Any = None, log_level: int = logging.INFO
                    ) -> None:
    """Entry point of the engine process."""
    _die_with_parent()
    # Ctrl-C reaches the whole process group: let the server decide when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level,
                            format="%(levelname)s %(asctime)s [engine] %(message)s")
    proc = None
    exit_code = 0
    ctx = zmq.Context()
    try:
        try:
            core = _make_core(config, eos_token_id, core_factory)
        except Exception:
            # Tell the front end why, so it can print the reason instead of "process died".
            sock = ctx.socket(zmq.PUSH)
            sock.connect(output_path)
            sock.send(_dumps(("error", traceback.format_exc())))
            sock.close(linger=2000)
            raise
        proc = EngineCoreProc(core, input_path, output_path, parent_pid)
        proc.send(("ready", {"pid": os.getpid(),
                             "num_blocks": getattr(core, "num_blocks", None)}))
        proc.run_busy_loop()
    except SystemExit:
        pass
    except Exception:
        logger.exception("Engine core failed")
        if proc is not None:
            proc.send(("error", traceback.format_exc()))
        exit_code = 1
    finally:
        if proc is not None:
            proc.close()
        ctx.term()
    if exit_code:
        os._exit(exit_code)  # skip multiprocessing's exit handlers; the status is the message


class EngineCoreClient:
    """Starts the engine process and holds both ends of the transport (front-end side)."""

    def __init__(self, config: Any, eos_token_id: int | None, core_factory: Any = None,
                 startup_timeout_s: float = 600.0, wait: bool = True) -> None:
        """``wait=False``: start the process and return; ``wait_ready()`` waits for it
        (a data-parallel front end starts every engine before waiting for any)."""
        self._tmpdir = tempfile.mkdtemp(prefix="pagellm-")  # created 0700
        self.input_path = f"ipc://{self._tmpdir}/input.sock"
        self.output_path = f"ipc://{self._tmpdir}/output.sock"
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(self.input_path)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(self.output_path)
        self._closed = False
        mp = multiprocessing.get_context("spawn")  # fork after torch/threads is unsafe
        self.proc = mp.Process(
            target=run_engine_core, name="pagellm-engine-core", daemon=False,
            args=(config, eos_token_id, self.input_path, self.output_path, os.getpid(),
                  core_factory, logging.getLogger("pagellm").getEffectiveLevel()))
        self.info: dict = {}
        self._startup_timeout_s = startup_timeout_s
        self._startup_deadline = time.monotonic() + startup_timeout_s
        try:
            self.proc.start()
        except BaseException:
            self.shutdown()
            raise
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the engine reports ready (RuntimeError if it fails or times out)."""
        try:
            self.info = self._wait_ready(self._startup_deadline)
        except BaseException:
            self.shutdown()
            raise
        logger.info("Engine core process started (pid %d)", self.proc.pid)

    def _wait_ready(self, deadline: float) -> dict:
        while time.monotonic() < deadline:
            if self.output_socket.poll(200):
                msg = pickle.loads(self.output_socket.recv())
                if msg[0] == "ready":
                    return msg[1]
                if msg[0] == "error":
                    raise RuntimeError(f"The engine core failed to start:\n{msg[1]}")
            elif not self.proc.is_alive():
                raise RuntimeError(f"The engine core process exited during start-up "
                                   f"(exit code {self.proc.exitcode}).")
        raise RuntimeError(f"The engine core did not start within "
                           f"{self._startup_timeout_s:.0f} s.")

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def send(self, msg: tuple) -> None:
        if self._closed:
            raise EngineDeadError("The engine has been shut down.")
        self.input_socket.send(_dumps(msg), copy=False)

    def add_requests(self, requests: list[Request]) -> None:
        self.send(("add", requests))

    def abort_requests(self, req_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        if req_ids and not self._closed:
            self.send(("abort", list(req_ids), status))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the engine to stop, then make sure it has; idempotent."""
        if self._closed:
            return
        self._closed = True
        proc = self.proc
        if proc.is_alive():
            try:
                self.input_socket.send(_dumps(("shutdown",)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            proc.join(timeout_s)
            if proc.is_alive():
                logger.warning("Engine core did not stop in %.0f s; terminating it.", timeout_s)
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        elif proc.pid is not None:
            proc.join(0)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
