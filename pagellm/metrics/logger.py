"""The periodic one-line engine stats log, written every few seconds while the engine is busy."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pagellm.metrics.request_stats import IterationMetrics
from pagellm.metrics.stats import SchedulerStats, SpecDecodingStats

logger = logging.getLogger("pagellm")

DEFAULT_LOG_INTERVAL_S = 5.0


class LoggingStatLogger:
    """Accumulates token counts between ``log()`` calls; ``log()`` writes one line when there was
    work since the last line (plus one final line after the engine goes idle)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last_log_time = clock()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.stats = SchedulerStats()
        self._last_was_busy = False
        self._last_spec: SpecDecodingStats | None = None  # counters at the last spec line

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration: IterationMetrics | None) -> None:
        if scheduler_stats is not None:
            self.stats = scheduler_stats
        if iteration is not None:
            self.num_prompt_tokens += iteration.num_prompt_tokens
            self.num_generation_tokens += iteration.num_generation_tokens

    def log(self) -> str | None:
        now = self.clock()
        elapsed = max(now - self.last_log_time, 1e-9)
        s = self.stats
        busy = bool(self.num_prompt_tokens or self.num_generation_tokens
                    or s.num_running_reqs or s.num_waiting_reqs)
        if not busy and not self._last_was_busy:
            self.last_log_time = now
            return None
        hit_rate = (100.0 * s.prefix_cache_hits / s.prefix_cache_queries
                    if s.prefix_cache_queries else 0.0)
        line = (f"Engine: prompt throughput {self.num_prompt_tokens / elapsed:.1f} tokens/s, "
                f"generation throughput {self.num_generation_tokens / elapsed:.1f} tokens/s, "
                f"running: {s.num_running_reqs} reqs, waiting: {s.num_waiting_reqs} reqs, "
                f"KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, "
                f"prefix cache hit rate: {hit_rate:.1f}%, preemptions: {s.num_preemptions}")
        logger.info(line)
        spec_line = self._spec_line(elapsed)
        if spec_line is not None:
            logger.info(spec_line)
            line += "\n" + spec_line
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.last_log_time = now
        self._last_was_busy = busy
        return line

    def _spec_line(self, elapsed: float) -> str | None:
        """vLLM's speculative-decoding line over the drafts verified since the last one."""
        spec = self.stats.spec_decoding
        if spec is None:
            return None
        last = self._last_spec or SpecDecodingStats(spec.num_spec_tokens)
        self._last_spec = spec
        d = spec.since(last)
        if d.num_drafts <= 0:
            return None
        per_pos = ", ".join(f"{n / d.num_drafts:.3f}" for n in d.num_accepted_tokens_per_pos)
        rate = 100.0 * d.num_accepted_tokens / d.num_draft_tokens if d.num_draft_tokens else 0.0
        return (f"SpecDecoding metrics: Mean acceptance length: "
                f"{1 + d.num_accepted_tokens / d.num_drafts:.2f}, Accepted throughput: "
                f"{d.num_accepted_tokens / elapsed:.2f} tokens/s, Drafted throughput: "
                f"{d.num_draft_tokens / elapsed:.2f} tokens/s, Accepted: "
                f"{d.num_accepted_tokens} tokens, Drafted: {d.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {per_pos}, Avg Draft acceptance rate: "
                f"{rate:.1f}%")
