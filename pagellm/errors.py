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
