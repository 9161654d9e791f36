"""Prometheus collectors with vLLM's metric names, under the ``pagellm:`` prefix.

Each PrometheusStatLogger owns its registry (no process-global state), which ``/metrics`` renders.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pagellm.metrics.request_stats import IterationMetrics
from pagellm.metrics.stats import SchedulerStats, SpecDecodingStats

FINISH_REASONS = ("stop", "length", "abort", "error")
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def token_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (included)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value >= max_value:
                buckets.append(max_value)
                return buckets
            buckets.append(value)
        exponent += 1


class PrometheusStatLogger:
    def __init__(self, model_name: str, max_model_len: int,
                 registry: CollectorRegistry | None = None,
                 num_speculative_tokens: int = 0) -> None:
        """``num_speculative_tokens`` > 0 (speculative decoding on): the acceptance counters
        too."""
        self.registry = registry or CollectorRegistry(auto_describe=True)
        reg, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagellm:{name}", doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagellm:{name}", doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: list) -> Histogram:
            return Histogram(f"pagellm:{name}", doc, labels, buckets=buckets,
                             registry=reg).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage: 1 means 100 percent.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self.preemptions = counter("num_preemptions", "Preemptions (requests sent back to wait).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        success = Counter("pagellm:request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=reg)
        self.success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "Time to the first token.",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens.",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first scheduling.", _LATENCY_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.req_prompt_tokens = histogram("request_prompt_tokens", "Prompt length per request.",
                                           tokens)
        self.req_generation_tokens = histogram("request_generation_tokens",
                                               "Generated tokens per request.", tokens)
        # The engine reports cumulative counters; Prometheus counters take increments.
        self._last_queries = self._last_hits = self._last_preemptions = 0
        self.spec = (_SpecDecodingCounters(reg, model_name, num_speculative_tokens)
                     if num_speculative_tokens > 0 else None)

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration: IterationMetrics | None) -> None:
        if scheduler_stats is not None:
            s = scheduler_stats
            self.running.set(s.num_running_reqs)
            self.waiting.set(s.num_waiting_reqs)
            self.kv_usage.set(s.kv_cache_usage)
            self.prefix_queries.inc(max(0, s.prefix_cache_queries - self._last_queries))
            self.prefix_hits.inc(max(0, s.prefix_cache_hits - self._last_hits))
            self.preemptions.inc(max(0, s.num_preemptions - self._last_preemptions))
            self._last_queries = s.prefix_cache_queries
            self._last_hits = s.prefix_cache_hits
            self._last_preemptions = s.num_preemptions
            if self.spec is not None and s.spec_decoding is not None:
                self.spec.record(s.spec_decoding)
        if iteration is not None:
            self.prompt_tokens.inc(iteration.num_prompt_tokens)
            self.generation_tokens.inc(iteration.num_generation_tokens)
            for v in iteration.time_to_first_tokens:
                self.ttft.observe(v)
            for v in iteration.inter_token_latencies:
                self.itl.observe(v)
            for f in iteration.finished:
                self.success[f.finish_reason].inc()
                self.e2e.observe(f.e2e_latency)
                if f.queue_time is not None:
                    self.queue_time.observe(f.queue_time)
                self.req_prompt_tokens.observe(f.num_prompt_tokens)
                self.req_generation_tokens.observe(f.num_generation_tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _SpecDecodingCounters:
    """vLLM's speculative-decoding counters, fed with the scheduler's cumulative ones."""

    def __init__(self, reg: CollectorRegistry, model_name: str, num_spec_tokens: int) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagellm:{name}", doc, ["model_name"], registry=reg).labels(
                model_name)

        self.drafts = counter("spec_decode_num_drafts", "Verify steps of requests with drafts.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted.")
        per_pos = Counter("pagellm:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted draft tokens by position in the draft (0: the first).",
                          ["model_name", "position"], registry=reg)
        self.accepted_per_pos = [per_pos.labels(model_name, str(pos))
                                 for pos in range(num_spec_tokens)]
        self.last = SpecDecodingStats(num_spec_tokens)

    def record(self, stats: SpecDecodingStats) -> None:
        delta = stats.since(self.last)
        self.drafts.inc(max(0, delta.num_drafts))
        self.draft_tokens.inc(max(0, delta.num_draft_tokens))
        self.accepted_tokens.inc(max(0, delta.num_accepted_tokens))
        for child, n in zip(self.accepted_per_pos, delta.num_accepted_tokens_per_pos,
                            strict=True):
            child.inc(max(0, n))
        self.last = stats
