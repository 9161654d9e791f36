"""Errors the engine reports to its callers, in one place (no torch: the front end and the
server import them without the model stack)."""

from __future__ import annotations

from typing import Any


class RequestFailedError(RuntimeError):
    """The model step that ran these requests raised: they were finished with finish_reason
    ``"error"`` (their KV blocks freed) and the engine went on serving the others. The cause
    is in the engine's log; clients only learn that it was the server's fault.

    ``outputs`` holds, for the offline ``LLM``, every prompt's RequestOutput in input order
    (the failed ones included), so the work that succeeded is not lost.
    """

    def __init__(self, message: str, request_ids: list[str],
                 outputs: list[Any] | None = None) -> None:
        super().__init__(message)
        self.request_ids = request_ids
        self.outputs = outputs


class RequestIdInUseError(ValueError):
    """A new request's id (or one of its samples' ids) is that of a request in flight: the
    engine could not tell the two apart, so the new one is refused, nothing changed. The server
    answers 400 (the id came from the client's X-Request-Id)."""


class EngineStepsFailedError(RuntimeError):
    """Too many model steps in a row raised: the engine stops instead of failing every
    request that comes (see EngineCore.MAX_CONSECUTIVE_STEP_FAILURES)."""


class EngineDeadError(RuntimeError):
    """The engine core process exited or failed; no request can be served any more."""


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died or raised; the engine cannot continue."""


class EngineSleepingError(RuntimeError):
    """A request arrived while the engine sleeps (``sleep()``: its KV cache, maybe its weights,
    freed): call ``wake_up()`` first. The server answers it with 503."""


class WeightUpdateError(RuntimeError):
    """A weight update (``LLM.load_weights``, ``update_weights_from_disk``) failed on the
    server's side: an error while weights were changing (a read error, a rank failing), after
    the update had been checked (a ValueError refuses it before anything changes).

    ``restored``: True when every rank serves the previous weights again (restored from the
    update's backup, or never changed); False when they could not be restored and the engine
    is out of service: every later request fails until it is restarted. The prefix cache was
    reset whenever weights had changed. The message says which, and never holds the cause's
    text (that goes to the server's log)."""

    def __init__(self, message: str, restored: bool) -> None:
        super().__init__(message)
        self.restored = restored

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses processes (tensor-parallel ranks, the engine core): keep ``restored``.
        return type(self), (self.args[0], self.restored)
