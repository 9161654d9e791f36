"""``--enable-per-request-metrics`` (vLLM's): a ``metrics`` object with one request's timing in
its response body (the last chunk with usage, when streamed).

Timing describes one generation stream, so as in vLLM it is null for a request of several
streams (n > 1, or several prompts to /v1/completions); token usage stays exact for those.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from pagellm.metrics.request_timing import RequestTiming


class PerRequestTimingMetrics(BaseModel):
    """vLLM's field names; a field is null when its timestamps are missing."""

    time_to_first_token_ms: float | None = None  # first scheduled -> first output token
    generation_time_ms: float | None = None  # first output token -> last (decode)
    queue_time_ms: float | None = None  # arrival -> first scheduled
    mean_itl_ms: float | None = None  # decode time / (tokens - 1); null for one token
    tokens_per_second: float | None = None  # tokens / (first scheduled -> last token)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def timing_metrics(metrics: Mapping[str, float], num_generated: int) -> PerRequestTimingMetrics:
    """The object for one stream: ``metrics`` is its finished RequestOutput's, ``num_generated``
    the completion tokens the response reports for it."""
    t = RequestTiming.of(metrics)
    decode, inference = t.decode_time, t.inference_time
    return PerRequestTimingMetrics(
        time_to_first_token_ms=_ms(t.prefill_time), generation_time_ms=_ms(decode),
        queue_time_ms=_ms(t.time_in_queue),
        mean_itl_ms=_ms(decode / (num_generated - 1)) if decode is not None
        and num_generated > 1 else None,
        tokens_per_second=num_generated / inference if inference else None)


def metrics_field(finished: list[Mapping[str, float]], n: int,
                  num_generated: int) -> dict[str, Any] | None:
    """The response's ``metrics`` value: ``finished`` holds each of its streams' final
    metrics; null unless the request is exactly one stream."""
    if n != 1 or len(finished) != 1:
        return None
    return timing_metrics(finished[0], num_generated).model_dump()
