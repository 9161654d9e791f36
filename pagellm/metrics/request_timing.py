"""One finished request's phases, from the timestamps its last RequestOutput carries.

``RequestOutput.metrics`` holds time.monotonic() values (vLLM's RequestMetrics names):
arrival_time (the front end took the request), first_scheduled_time (the scheduler first ran
it), first_token_time, last_token_time and finished_time. The OpenTelemetry span
(entrypoints/openai/tracing.py) and the response's ``metrics`` object
(entrypoints/openai/request_metrics.py) both read the phases from here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass


def _interval(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    # Both processes read the one monotonic clock; a difference below zero is rounding.
    return max(0.0, end - start)


@dataclass(frozen=True, slots=True)
class RequestTiming:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @classmethod
    def of(cls, metrics: Mapping[str, float]) -> RequestTiming:
        return cls(metrics["arrival_time"], metrics.get("first_scheduled_time"),
                   metrics.get("first_token_time"), metrics.get("last_token_time"),
                   metrics.get("finished_time"))

    @property
    def time_in_queue(self) -> float | None:
        """Arrival to the first step that ran it."""
        return _interval(self.arrival_time, self.first_scheduled_time)

    @property
    def time_to_first_token(self) -> float | None:
        """Arrival to the first output token."""
        return _interval(self.arrival_time, self.first_token_time)

    @property
    def prefill_time(self) -> float | None:
        """First scheduled to the first output token."""
        return _interval(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        """First output token to the last."""
        return _interval(self.first_token_time, self.last_token_time)

    @property
    def inference_time(self) -> float | None:
        """First scheduled to the last output token (prefill plus decode)."""
        return _interval(self.first_scheduled_time, self.last_token_time)

    @property
    def e2e(self) -> float | None:
        """Arrival to finished."""
        return _interval(self.arrival_time, self.finished_time)


def wall_clock_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as Unix-epoch nanoseconds (what span timestamps are)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
