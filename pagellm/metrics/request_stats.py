"""Front-end request timing: what one batch of engine outputs means for the latency metrics.

Times are time.monotonic(), measured where the outputs arrive (the front end), so TTFT and
inter-token latency include the transport and queueing a client would see. Each of the n samples
of a request counts as its own request here (as in vLLM), so prompt tokens count once per sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagellm.core.sched_output import EngineCoreOutput


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency: float
    queue_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass(slots=True)
class IterationMetrics:
    """What changed since the previous batch of outputs."""

    num_prompt_tokens: int = 0  # prompts of requests that got their first token now
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(slots=True)
class _Timing:
    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


class RequestStatsTracker:
    """Per-sample timing state, keyed by the engine's (child) request id."""

    def __init__(self) -> None:
        self._timings: dict[str, _Timing] = {}
        # Prompt tokens of the samples without a first token yet (vLLM's count for
        # --max-num-queued-tokens: a prompt counts whole until its first token arrives).
        self.num_prefill_tokens = 0

    def __len__(self) -> int:
        return len(self._timings)

    def add(self, req_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self._timings[req_id] = _Timing(arrival_time, num_prompt_tokens)
        self.num_prefill_tokens += num_prompt_tokens

    def update(self, outputs: list[EngineCoreOutput], first_scheduled_times: dict[str, float],
               stopped: list[str], now: float | None = None) -> IterationMetrics:
        """Account one batch of outputs; ``stopped`` lists requests a stop string finished (their
        engine output carried no finish reason)."""
        now = time.monotonic() if now is None else now
        it = IterationMetrics()
        for out in outputs:
            t = self._timings.get(out.req_id)
            if t is None:
                continue  # aborted meanwhile
            if out.req_id in first_scheduled_times:
                t.first_scheduled_time = first_scheduled_times[out.req_id]
            num_new = len(out.new_token_ids)
            if num_new:
                if t.first_token_time is None:
                    t.first_token_time = now
                    self.num_prefill_tokens -= t.num_prompt_tokens
                    it.num_prompt_tokens += t.num_prompt_tokens
                    it.time_to_first_tokens.append(now - t.arrival_time)
                else:
                    assert t.last_token_time is not None
                    it.inter_token_latencies.append(now - t.last_token_time)
                t.last_token_time = now
                t.num_generation_tokens += num_new
                it.num_generation_tokens += num_new
            if out.finish_reason is not None:
                it.finished.append(self._finish(out.req_id, out.finish_reason, now))
        for req_id in stopped:
            if req_id in self._timings:
                it.finished.append(self._finish(req_id, "stop", now))
        return it

    def abort(self, req_ids: list[str], now: float | None = None,
              reason: str = "abort") -> IterationMetrics:
        """Finish requests the engine will not report on: aborted, or failed ("error")."""
        now = time.monotonic() if now is None else now
        it = IterationMetrics()
        for req_id in req_ids:
            if req_id in self._timings:
                it.finished.append(self._finish(req_id, reason, now))
        return it

    def _finish(self, req_id: str, reason: str, now: float) -> FinishedRequestStats:
        t = self._timings.pop(req_id)
        if t.first_token_time is None:
            self.num_prefill_tokens -= t.num_prompt_tokens
        queue_time = None
        if t.first_scheduled_time is not None:
            queue_time = max(0.0, t.first_scheduled_time - t.arrival_time)
        return FinishedRequestStats(reason, now - t.arrival_time, queue_time,
                                    t.num_prompt_tokens, t.num_generation_tokens)
