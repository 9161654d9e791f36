"""Plain-data snapshots the engine hands to the metrics/logging layer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    """``num_drafts``: verify steps of a request (one per request that had drafts in a step);
    ``num_accepted_tokens_per_pos[j]``: how many of them accepted draft j + 1 (and all before)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_draft_tokens <= self.num_spec_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def snapshot(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))

    def since(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts added after ``earlier`` (a snapshot of the same counters)."""
        return SpecDecodingStats(
            self.num_spec_tokens, self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [a - b for a, b in zip(self.num_accepted_tokens_per_pos,
                                   earlier.num_accepted_tokens_per_pos, strict=True)])


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
    # Speculative decoding's cumulative acceptance counters (None: speculation off).
    spec_decoding: SpecDecodingStats | None = None
