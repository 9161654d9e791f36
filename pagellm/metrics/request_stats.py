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
    """vLLM's per-request phases: queue (arrival to first scheduling), prefill (first
    scheduling to first token), decode (first to last token), inference (prefill + decode);
    None where the request never reached that point."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency: float
    queue_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None = None  # the resolved max_tokens
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    mean_time_per_output_token: float | None = None  # decode time / (tokens - 1); 0 for one


@dataclass(slots=True)
class IterationMetrics:
    """What changed since the previous batch of outputs."""

    num_prompt_tokens: int = 0  # prompts of requests that got their first token now
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    # Once all n samples of a request have finished: its n, and its samples' most tokens.
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Group:
    """The samples of one n > 1 request still unfinished, and their most tokens so far."""

    n: int
    unfinished: int = 0
    max_generation_tokens: int = 0


@dataclass(slots=True)
class _Timing:
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None = None
    group_id: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


class RequestStatsTracker:
    """Per-sample timing state, keyed by the engine's (child) request id."""

    def __init__(self) -> None:
        self._timings: dict[str, _Timing] = {}
        self._groups: dict[str, _Group] = {}
        # Prompt tokens of the samples without a first token yet (vLLM's count for
        # --max-num-queued-tokens: a prompt counts whole until its first token arrives).
        self.num_prefill_tokens = 0

    def __len__(self) -> int:
        return len(self._timings)

    def add(self, req_id: str, arrival_time: float, num_prompt_tokens: int,
            max_tokens: int | None = None, n: int = 1, group_id: str | None = None) -> None:
        """``group_id``: the parent request of one of n > 1 samples (all added before any
        output comes)."""
        self._timings[req_id] = _Timing(arrival_time, num_prompt_tokens, max_tokens, group_id)
        if group_id is not None:
            self._groups.setdefault(group_id, _Group(n)).unfinished += 1
        self.num_prefill_tokens += num_prompt_tokens

    def update(self, outputs: list[EngineCoreOutput], first_scheduled_times: dict[str, float],
               stopped: list[str], now: float | None = None) -> IterationMetrics:
        """Account one batch of outputs; ``stopped`` lists requests a stop string finished: they
        finish as "stop" whatever their engine output says (it may also have reached
        max_tokens in that step, or carry no finish reason)."""
        now = time.monotonic() if now is None else now
        it = IterationMetrics()
        by_string = set(stopped)
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
                reason = "stop" if out.req_id in by_string else out.finish_reason
                self._finish(it, out.req_id, reason, now)
        for req_id in stopped:
            if req_id in self._timings:
                self._finish(it, req_id, "stop", now)
        return it

    def abort(self, req_ids: list[str], now: float | None = None,
              reason: str = "abort") -> IterationMetrics:
        """Finish requests the engine will not report on: aborted, or failed ("error")."""
        now = time.monotonic() if now is None else now
        it = IterationMetrics()
        for req_id in req_ids:
            if req_id in self._timings:
                self._finish(it, req_id, reason, now)
        return it

    def _finish(self, it: IterationMetrics, req_id: str, reason: str, now: float) -> None:
        t = self._timings.pop(req_id)
        if t.first_token_time is None:
            self.num_prefill_tokens -= t.num_prompt_tokens
        sched, first, last = t.first_scheduled_time, t.first_token_time, t.last_token_time
        queue_time = prefill = inference = decode = per_token = None
        if sched is not None:
            queue_time = max(0.0, sched - t.arrival_time)
        if first is not None and last is not None:
            decode = last - first
            per_token = decode / (t.num_generation_tokens - 1) \
                if t.num_generation_tokens > 1 else 0.0
            if sched is not None:
                prefill = max(0.0, first - sched)
                inference = max(0.0, last - sched)
        it.finished.append(FinishedRequestStats(
            reason, now - t.arrival_time, queue_time, t.num_prompt_tokens,
            t.num_generation_tokens, t.max_tokens, prefill, decode, inference, per_token))
        if t.group_id is None:
            it.n_params.append(1)
            it.max_num_generation_tokens.append(t.num_generation_tokens)
            return
        group = self._groups[t.group_id]
        group.unfinished -= 1
        group.max_generation_tokens = max(group.max_generation_tokens, t.num_generation_tokens)
        if group.unfinished == 0:
            del self._groups[t.group_id]
            it.n_params.append(group.n)
            it.max_num_generation_tokens.append(group.max_generation_tokens)
