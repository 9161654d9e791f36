"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, freeing."""

from __future__ import annotations

import logging

from pagellm.core.block_hash import (
    BlockHash,
    ExtraKeys,
    extend_block_hashes,
    get_hash_fn,
    request_extra_keys,
)
from pagellm.core.block_pool import BlockPool, KVCacheBlock
from pagellm.core.kv_cache_groups import num_skipped_blocks
from pagellm.core.kv_events import KVCacheEvent
from pagellm.core.state_slots import StateSlotPool
from pagellm.core.state_snapshots import StateSnapshotCache
from pagellm.request import Request

logger = logging.getLogger("pagellm")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Hands out KV blocks to requests and finds their cached prefixes.

    Contract: after ``allocate_slots(req, n, ...)`` succeeds the request holds exactly
    ``ceil((num_computed_tokens + num_new_computed_tokens + n) / block_size)`` blocks, and every
    full block among them is in the prefix cache already (cached at allocation, before the runner
    computes it, so a request scheduled in the same step can share it: the runner writes a
    layer's K/V for the whole batch before attending). Since those hashes promise K/V the step
    has not written yet, the blocks hashed since ``begin_step()`` are remembered, and
    ``uncache_step()`` drops them when the step fails. Block hashes are kept here per request
    and extended incrementally; ``request.py`` stays free of cache state.

    KV cache groups (core/kv_cache_groups.py; ``group_windows``, one entry per group): every
    group keeps its own table per request, all of one length (``req_to_blocks`` is group 0's);
    each allocation takes the same number of new blocks for every group. A windowed group
    returns the blocks that fell out of the request's window to the pool (``null_block`` takes
    their place) before each allocation. Prefix caching is off with several groups (a hit would
    need every group's blocks); a single windowed group keeps it: a hit is a chain of cached
    blocks whose K/V are all still there.

    Recurrent layers (``num_state_slots`` > 0, core/state_slots.py): every scheduled request
    also holds one state slot, taken by its first allocation (which fails, changing nothing,
    when none is free) and returned by ``free``. A prefix hit also needs the recurrent state at
    the hit's end: with ``num_snapshot_slots`` the state is snapshotted every
    ``snapshot_interval_blocks`` blocks (core/state_snapshots.py) and a hit is cut back to the
    nearest snapshot; ``take_state_plan`` says which snapshot a request resumes from and
    which ones its step writes. Without snapshot slots prefix caching is off for such models.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool,
        hash_algo: str = "sha256",
        max_model_len: int | None = None,
        group_windows: list[int | None] | None = None,
        enable_kv_cache_events: bool = False,
        kv_dtype_key: str | None = None,
        num_state_slots: int = 0,
        num_snapshot_slots: int = 0,
        snapshot_interval_blocks: int = 1,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        self.group_windows = list(group_windows) if group_windows else [None]
        self.num_groups = len(self.group_windows)
        self._has_window = any(w is not None for w in self.group_windows)
        if self.num_groups > 1 and enable_caching:
            logger.info("Prefix caching is disabled: the model keeps KV in %d groups (full and "
                        "sliding-window layers)", self.num_groups)
            enable_caching = False
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots else None
        self.snapshots: StateSnapshotCache | None = None
        if self.state_slots is not None and enable_caching:
            if num_snapshot_slots:
                # Snapshot slots follow the running ones in the state tensors.
                self.snapshots = StateSnapshotCache(num_snapshot_slots, num_state_slots,
                                                    snapshot_interval_blocks)
            else:
                logger.info("Prefix caching is disabled: the model has recurrent (linear "
                            "attention) layers and no state snapshot slots")
                enable_caching = False
        # req_id -> the snapshot slot its state starts from (a hit) / the (tokens, slot)
        # snapshots this step writes, until the scheduler takes them (take_state_plan).
        self._state_restores: dict[str, int] = {}
        self._state_checkpoints: dict[str, list[tuple[int, int]]] = {}
        # Stands in a windowed group's table for a block freed behind the window.
        self.null_block = KVCacheBlock(-1)
        # req_id -> tables of groups 1.. (only with several groups).
        self.req_to_group_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.hash_fn = get_hash_fn(hash_algo)
        # --kv-cache-dtype's key in every first block's hash (KVCacheDtype.hash_key; None for
        # auto), so blocks of one KV dtype never match another's.
        self.kv_dtype_key = kv_dtype_key
        # KV cache events (--kv-events-config) are recorded by the pool, with caching on only.
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events,
                                    block_size)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        # req_id -> number of its leading blocks already offered to the hash map.
        self.num_cached_blocks: dict[str, int] = {}
        # Cumulative prefix-cache stats in tokens (only with enable_caching).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # req_id -> (queried, hit) tokens of a lookup, counted once its allocation succeeds, so a
        # request retried over several steps for lack of blocks is counted once.
        self._pending_stats: dict[str, tuple[int, int]] = {}
        # Blocks hashed since begin_step(): their K/V exists only once that step has run.
        self._hashed_this_step: list[KVCacheBlock] = []
        # Those hashed for the step scheduled before it (async scheduling: it may still run).
        self._hashed_prev_step: list[KVCacheBlock] = []

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def _extra_keys(self, request: Request) -> ExtraKeys | None:
        return request_extra_keys(request.cache_salt, request.group_id, self.enable_caching,
                                  self.kv_dtype_key)

    def _block_hashes(self, request: Request) -> list[BlockHash] | None:
        """The request's full-block hashes, extended to its current tokens (None: not hashed)."""
        extra = self._extra_keys(request)
        if extra is None:
            return None
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        extend_block_hashes(
            self.hash_fn, self.block_size, request.all_token_ids, hashes, extra
        )
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached full blocks matching the request's tokens, and the number
        of tokens they hold. At least the last token is always left to compute (its logits are
        needed), so the hit is at most ``num_tokens - 1`` rounded down to a block. The blocks are
        not referenced yet: pass them to ``allocate_slots``.

        A request that asks for prompt logprobs reads no cached block (as vLLM): every prompt
        position must run through the model for its logits. It still caches what it computes."""
        hashes = self._block_hashes(request)
        if hashes is None or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        if self.snapshots is not None:
            # Recurrent layers resume from a state snapshot: the hit ends at the last one.
            num_blocks, slot = self.snapshots.lookup(hashes, len(blocks))
            blocks = blocks[:num_blocks]
            self._state_restores[request.request_id] = slot
        num_hit_tokens = len(blocks) * self.block_size
        if self.enable_caching:
            self._pending_stats[request.request_id] = (request.num_tokens, num_hit_tokens)
        return blocks, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Reserve KV slots for ``num_new_tokens`` tokens to compute after the request's
        ``num_computed_tokens`` plus ``num_new_computed_tokens`` prefix-hit tokens held by
        ``new_computed_blocks``. Returns the newly taken blocks (possibly none), or None, with
        nothing changed, when the pool cannot supply them all."""
        new_computed_blocks = new_computed_blocks or []
        assert num_new_computed_tokens == len(new_computed_blocks) * self.block_size
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        assert self.max_model_len is None or num_total <= self.max_model_len, (req_id, num_total)
        # Past the known tokens: speculative tokens to verify, a token still being sampled
        # (async scheduling) or lookahead slots a draft model writes; never cached below.
        assert num_total <= request.num_tokens + request.num_unknown_slots, (
            "only known tokens, speculative tokens and lookahead slots can be scheduled")

        if self._has_window and req_blocks:
            self._free_skipped_blocks(req_id, request.num_computed_tokens)
        num_new_blocks = cdiv(num_total, self.block_size) - len(req_blocks)
        num_new_blocks -= len(new_computed_blocks)
        # A hit on a cached free block takes it out of the free queue too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if (max(num_new_blocks, 0) * self.num_groups + num_revived
                > self.block_pool.get_num_free_blocks()):
            return None
        if self.state_slots is not None and self.state_slots.ensure(req_id) is None:
            return None

        if new_computed_blocks:
            assert not req_blocks, "prefix hits only at a request's (re)start"
            self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        self.req_to_blocks[req_id] = req_blocks
        if self.num_groups > 1:
            tables = self.req_to_group_blocks.setdefault(
                req_id, [[] for _ in range(self.num_groups - 1)])
            for table in tables:
                table.extend(self.block_pool.get_new_blocks(max(num_new_blocks, 0)))

        pending = self._pending_stats.pop(req_id, None)
        if pending is not None:
            self.prefix_cache_queries += pending[0]
            self.prefix_cache_hits += pending[1]

        hashes = self._block_hashes(request)
        if self.snapshots is not None and hashes is not None:
            self._plan_snapshots(req_id, hashes, num_computed,
                                 min(num_total, request.num_tokens))
        if hashes is not None:
            # A block is cached once all its tokens are known (its K/V is what a later prompt
            # with those tokens needs); one holding unknown slots waits for a later allocation.
            num_full = min(num_total, request.num_tokens) // self.block_size
            num_cached = self.num_cached_blocks.get(req_id, 0)
            if num_full > num_cached:
                self._hashed_this_step += self.block_pool.cache_full_blocks(
                    req_blocks, hashes, num_cached, num_full, request.all_token_ids)
                self.num_cached_blocks[req_id] = num_full
        return new_blocks

    def _plan_snapshots(self, req_id: str, hashes: list[BlockHash], num_computed: int,
                        known_end: int) -> None:
        """Reserve the snapshots at the interval's block boundaries that this allocation's
        tokens (``num_computed`` .. ``known_end``, known tokens only) cross."""
        assert self.snapshots is not None
        bs = self.block_size
        plan = self._state_checkpoints.setdefault(req_id, [])
        for num_blocks in self.snapshots.positions(num_computed // bs, known_end // bs):
            slot = self.snapshots.reserve(hashes[num_blocks - 1])
            if slot is not None:
                plan.append((num_blocks * bs - num_computed, slot))

    def take_state_plan(self, req_id: str) -> tuple[int, list[tuple[int, int]]]:
        """``(restore_slot, checkpoints)`` of the request's allocation this step: the snapshot
        slot its state starts from (-1: none) and the ``(tokens, slot)`` snapshots to write
        after that many of its new tokens."""
        return (self._state_restores.pop(req_id, -1),
                self._state_checkpoints.pop(req_id, None) or [])

    def begin_step(self) -> None:
        """A new step is being scheduled. The blocks hashed for the one before are kept aside:
        with async scheduling that step may still be running (see ``uncache_step``)."""
        self._hashed_prev_step = self._hashed_this_step
        self._hashed_this_step = []
        if self.snapshots is not None:
            self.snapshots.begin_step()
            self._state_restores.clear()  # lookups of requests that found no blocks
            self._state_checkpoints.clear()

    def uncache_step(self, include_previous: bool = False) -> None:
        """The step scheduled since ``begin_step()`` failed: no forward wrote the blocks it
        hashed, so a later prompt must not hit them (it would read stale K/V, maybe another
        tenant's). Only requests of that step hold them, and they all fail with it.
        ``include_previous``: the step scheduled before it failed too (async scheduling, where
        both were in flight and both steps' requests fail)."""
        self.block_pool.uncache_blocks(self._hashed_this_step)
        self._hashed_this_step = []
        if self.snapshots is not None:
            self.snapshots.uncache_step(include_previous)
        if include_previous:
            self.block_pool.uncache_blocks(self._hashed_prev_step)
            self._hashed_prev_step = []

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (so its tail is evicted first), and
        forget its hashes (recomputed if it is scheduled again after a preemption)."""
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, [])
        for table in self.req_to_group_blocks.pop(req_id, []):
            self.block_pool.free_blocks(b for b in reversed(table) if b is not self.null_block)
        self.block_pool.free_blocks(b for b in reversed(blocks) if b is not self.null_block)
        self.req_to_block_hashes.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        self._pending_stats.pop(req_id, None)
        if self.state_slots is not None:
            self.state_slots.release(req_id)

    def get_state_slot(self, req_id: str) -> int:
        """The request's state slot (-1: the model has no recurrent layers)."""
        if self.state_slots is None:
            return -1
        slot = self.state_slots.slot_of(req_id)
        assert slot is not None, f"{req_id} holds no state slot"
        return slot

    def get_blocks(self, req_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(req_id, [])

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, [])]

    def get_group_blocks(self, req_id: str, group: int) -> list[KVCacheBlock]:
        """Group ``group``'s table of the request (``null_block`` where freed)."""
        if group == 0:
            return self.req_to_blocks.get(req_id, [])
        tables = self.req_to_group_blocks.get(req_id)
        return tables[group - 1] if tables else []

    def get_other_group_block_ids(self, req_id: str, last: int | None = None
                                  ) -> list[list[int]]:
        """Block ids of groups 1.. (empty with one group); ``last``: only each table's last
        ``last`` entries (the blocks an allocation just added)."""
        out = []
        for table in self.req_to_group_blocks.get(req_id, []):
            part = table if last is None else table[len(table) - last:]
            out.append([b.block_id for b in part])
        return out

    def _free_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Return to the pool the blocks of windowed groups that no query from
        ``num_computed_tokens`` on can see (newest first: the pool hands them out again
        first); ``null_block`` takes their place in the table."""
        for group, window in enumerate(self.group_windows):
            if window is None:
                continue
            table = self.get_group_blocks(req_id, group)
            freed = []
            for i in range(min(num_skipped_blocks(num_computed_tokens, window, self.block_size),
                               len(table)) - 1, -1, -1):
                if table[i] is self.null_block:
                    break  # freed by an earlier step, and so is everything before it
                freed.append(table[i])
                table[i] = self.null_block
            self.block_pool.free_blocks(freed)

    def reset_prefix_cache(self) -> bool:
        done = self.block_pool.reset_prefix_cache()
        if done and self.snapshots is not None:
            self.snapshots.reset()
        return done

    def take_events(self) -> list[KVCacheEvent]:
        """The block pool's KV cache events since the last call (engine/kv_events.py)."""
        return self.block_pool.take_events()
