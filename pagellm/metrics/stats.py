"""Plain-data snapshots the engine hands to the metrics/logging layer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler's state after a step. Prefix-cache counters are cumulative token counts
    (queries: tokens looked up; hits: tokens served from the cache), counted only with prefix
    caching on; ``num_preemptions`` is cumulative; ``num_steps`` counts ``schedule()`` calls."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
