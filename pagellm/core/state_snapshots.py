"""Prefix caching for models with recurrent layers: snapshots of the recurrent state at block
boundaries (pure Python).

A recurrent layer's state after token ``p`` sums up every token before it, so a prefix hit
needs that state at the hit's end; the KV blocks of the attention layers are not enough. While
a request computes its tokens, the state is copied, every ``interval`` blocks, into a snapshot
slot (one more slot of the state tensors, worker/state_cache.py); the snapshot is keyed by the
hash of the block it ends (core/block_hash.py: the whole prefix and the tenant's cache salt),
so it is found exactly when that block is. A later request whose prompt shares a prefix resumes
from the nearest snapshot at or below the blocks it hits: its own slot gets a copy of the
snapshot's state and its prefill starts there.

Snapshots are evicted least recently used first, like free cached blocks; nothing references
one after its copy, so every snapshot is evictable, except those written in the step being
scheduled (``uncache_step`` drops them if that step fails, as for blocks).
"""

from __future__ import annotations

from collections import OrderedDict

from pagellm.core.block_hash import BlockHash


class StateSnapshotCache:
    def __init__(self, num_slots: int, first_slot: int, interval_blocks: int) -> None:
        """``num_slots`` snapshot slots with ids ``first_slot ..``; a snapshot every
        ``interval_blocks`` blocks of a request's tokens."""
        if num_slots < 1 or interval_blocks < 1:
            raise ValueError(f"state snapshots need slots and an interval >= 1, got "
                             f"{num_slots} slots every {interval_blocks} blocks")
        self.num_slots = num_slots
        self.interval_blocks = interval_blocks
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        # block hash -> slot, least recently used first.
        self._cached: OrderedDict[BlockHash, int] = OrderedDict()
        self._this_step: list[BlockHash] = []
        self._prev_step: list[BlockHash] = []
        self.num_evicted = 0

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, hashes: list[BlockHash], max_blocks: int) -> tuple[int, int]:
        """``(blocks, slot)``: the longest prefix of ``max_blocks`` or fewer blocks, a multiple
        of the interval, whose snapshot is cached and not being written by the step being
        scheduled (touched as used); ``(0, -1)`` if none. A snapshot the step before writes is
        fine: the runner runs steps in order."""
        k = min(max_blocks, len(hashes)) // self.interval_blocks * self.interval_blocks
        writing = set(self._this_step)  # its restore copy would run before they are written
        while k > 0:
            slot = self._cached.get(hashes[k - 1])
            if slot is not None and hashes[k - 1] not in writing:
                self._cached.move_to_end(hashes[k - 1])
                return k, slot
            k -= self.interval_blocks
        return 0, -1

    def positions(self, start_blocks: int, end_blocks: int) -> range:
        """Block counts in ``(start_blocks, end_blocks]`` at which a snapshot is taken."""
        step = self.interval_blocks
        first = (start_blocks // step + 1) * step
        return range(first, end_blocks + 1, step)

    def reserve(self, block_hash: BlockHash) -> int | None:
        """A slot for the snapshot ending block ``block_hash`` (the least recently used one
        evicted if none is free), registered now; None when it is cached already or every slot
        is being written in the steps in flight."""
        if block_hash in self._cached:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            in_flight = set(self._this_step) | set(self._prev_step)
            victim = next((h for h in self._cached if h not in in_flight), None)
            if victim is None:
                return None
            slot = self._cached.pop(victim)
            self.num_evicted += 1
        self._cached[block_hash] = slot
        self._this_step.append(block_hash)
        return slot

    def begin_step(self) -> None:
        self._prev_step, self._this_step = self._this_step, []

    def uncache_step(self, include_previous: bool = False) -> None:
        """The step scheduled since ``begin_step`` failed: its snapshots were never written."""
        dropped = self._this_step + (self._prev_step if include_previous else [])
        for h in dropped:
            slot = self._cached.pop(h, None)
            if slot is not None:
                self._free.append(slot)
        self._this_step = []
        if include_previous:
            self._prev_step = []

    def reset(self) -> None:
        for slot in self._cached.values():
            self._free.append(slot)
        self._cached.clear()
        self._this_step, self._prev_step = [], []
