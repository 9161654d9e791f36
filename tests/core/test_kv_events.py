"""KV cache events recorded by the block pool (core/kv_events.py), checked against the pool's own
hash map: replaying the events (stored adds, removed drops, cleared empties) must give exactly
the map's keys after every operation, and every BlockStored must be a chain that
core/block_hash.py reproduces from its token ids."""

from __future__ import annotations

import random
from types import SimpleNamespace

from core_fakes import FakeRunner, check_step, content_token, make_request

from pagellm.core.block_hash import (
    BlockHash,
    extend_block_hashes,
    get_hash_fn,
    hash_block_tokens,
)
from pagellm.core.block_pool import BlockPool
from pagellm.core.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from pagellm.core.scheduler import Scheduler

BS = 4
SHA = get_hash_fn("sha256")


class Replica:
    """What a subscriber keeps: the set of cached hashes, built from events alone."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.num_stored = self.num_removed = self.num_cleared = 0

    def apply(self, events: list) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                check_chain(e)
                assert not self.hashes & set(e.block_hashes), "a hash stored twice"
                self.hashes |= set(e.block_hashes)
                self.num_stored += len(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert e.medium == MEDIUM_GPU
                assert set(e.block_hashes) <= self.hashes, "removed a hash never stored"
                self.hashes -= set(e.block_hashes)
                self.num_removed += len(e.block_hashes)
            else:
                assert isinstance(e, AllBlocksCleared)
                self.hashes.clear()
                self.num_cleared += 1


def check_chain(e: BlockStored, extra_first: tuple[str, ...] = ()) -> None:
    """Each hash is the block hash of its tokens chained on the one before (the parent first)."""
    assert e.block_size == BS and e.medium == MEDIUM_GPU and e.lora_id is None
    assert len(e.token_ids) == BS * len(e.block_hashes) and e.block_hashes
    parent = e.parent_block_hash
    for k, h in enumerate(e.block_hashes):
        assert isinstance(h, bytes) and len(h) == 32
        tokens = e.token_ids[k * BS:(k + 1) * BS]
        keys = extra_first if k == 0 and parent is None else ()
        assert hash_block_tokens(SHA, parent, tokens, keys) == h
        parent = h


def hashes_of(tokens: list[int]) -> list[BlockHash]:
    out: list[BlockHash] = []
    extend_block_hashes(SHA, BS, tokens, out)
    return out


def pool_keys(pool: BlockPool) -> set[bytes]:
    return set(pool.cached_block_hash_to_block)


def synced(pool: BlockPool, replica: Replica) -> None:
    replica.apply(pool.take_events())
    assert replica.hashes == pool_keys(pool)
    assert pool.take_events() == []  # drained
    pool.check_invariants()


def test_no_events_unless_enabled_with_caching() -> None:
    for pool in (BlockPool(8, True), BlockPool(8, False, True, BS)):
        assert pool.kv_event_queue is None
        tokens = list(range(8))
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(blocks, hashes_of(tokens), 0, 2, tokens)
        pool.free_blocks(reversed(blocks))
        pool.get_new_blocks(8)
        assert pool.take_events() == []


def test_stored_chain_parent_and_tokens_incrementally() -> None:
    pool, replica = BlockPool(16, True, True, BS), Replica()
    tokens = list(range(100, 120))  # 5 full blocks
    hashes = hashes_of(tokens)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(blocks, hashes, 0, 3, tokens)
    events = pool.take_events()
    assert events == [BlockStored(hashes[:3], None, tokens[:12], BS)]
    replica.apply(events)
    pool.cache_full_blocks(blocks, hashes, 3, 5, tokens)
    events = pool.take_events()
    assert events == [BlockStored(hashes[3:5], hashes[2], tokens[12:20], BS)]
    replica.apply(events)
    synced(pool, replica)
    assert replica.num_stored == 5


def test_a_block_already_mapped_splits_the_run() -> None:
    """A block whose hash another block holds is not stored again; the blocks after it are
    one more chain whose parent is that hash."""
    pool, replica = BlockPool(16, True, True, BS), Replica()
    tokens = list(range(12))
    hashes = hashes_of(tokens)
    first = pool.get_new_blocks(3)
    pool.cache_full_blocks(first, hashes, 1, 2, tokens)  # only block 1 (no parent given here)
    replica.apply(pool.take_events())
    other = pool.get_new_blocks(3)  # the same content computed again (no prefix hit)
    pool.cache_full_blocks(other, hashes, 0, 3, tokens)
    assert pool.take_events() == [BlockStored([hashes[0]], None, tokens[0:4], BS),
                                  BlockStored([hashes[2]], hashes[1], tokens[8:12], BS)]
    assert other[1].block_hash is None and pool.get_cached_block(hashes[1]) is first[1]
    replica.hashes |= set(hashes)
    synced(pool, replica)


def test_eviction_on_reuse_uncache_and_reset() -> None:
    pool, replica = BlockPool(6, True, True, BS), Replica()
    a, b = list(range(8)), list(range(50, 66))
    ha, hb = hashes_of(a), hashes_of(b)
    blocks_a = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks_a, ha, 0, 2, a)
    blocks_b = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks_b, hb, 0, 4, b)
    synced(pool, replica)
    pool.free_blocks(reversed(blocks_a))  # tail first: a's last block is evicted first
    pool.free_blocks(reversed(blocks_b[2:]))
    synced(pool, replica)  # freeing keeps hashes (lazy eviction): no event
    assert not pool.reset_prefix_cache()  # b's first blocks are in use: refused, no event
    synced(pool, replica)
    # A prefix hit revives a's blocks: no event either.
    pool.touch(blocks_a)
    pool.free_blocks(reversed(blocks_a))
    synced(pool, replica)
    # Reuse evicts the least recently freed first, one BlockRemoved for the call.
    pool.get_new_blocks(3)
    events = pool.take_events()
    assert events == [BlockRemoved([hb[3], hb[2], ha[1]])]
    replica.apply(events)
    synced(pool, replica)
    assert pool_keys(pool) == {ha[0], hb[0], hb[1]}
    pool.uncache_blocks(blocks_b[:2])
    assert pool.take_events() == [BlockRemoved([hb[0], hb[1]])]
    replica.hashes -= {hb[0], hb[1]}
    synced(pool, replica)
    for block in pool.blocks:
        if block.ref_cnt:
            pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    replica.hashes.clear()
    synced(pool, replica)
    assert pool_keys(pool) == set()


def _scheduler(num_blocks: int) -> Scheduler:
    sched_cfg = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
    cache_cfg = SimpleNamespace(block_size=BS, enable_prefix_caching=True,
                                prefix_caching_hash_algo="sha256")
    return Scheduler(sched_cfg, cache_cfg, num_blocks, enable_kv_cache_events=True)


def test_random_traffic_replays_to_the_pool_map() -> None:
    """Shared prefixes, cache salts, preemption and eviction in a small pool, through the
    scheduler: after every step the events give exactly the pool's cached hashes."""
    rng = random.Random(7)
    sched = _scheduler(num_blocks=24)
    runner = FakeRunner(BS, next_token=content_token)
    pool = sched.kv_cache_manager.block_pool
    replica = Replica()
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    for i in range(60):
        if rng.random() < 0.5 or not sched.has_unfinished_requests():
            prompt = rng.choice(prefixes) + [rng.randrange(1, 500)
                                             for _ in range(rng.randrange(0, 12))]
            salt = rng.choice([None, None, "tenant-b"])
            sched.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 8),
                                           cache_salt=salt))
        out = sched.schedule()
        check_step(sched, out)
        sched.update_from_output(out, runner.execute(out))
        _apply_checked(replica, sched.kv_cache_manager.take_events())
        assert replica.hashes == pool_keys(pool), f"step {i}"
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        _apply_checked(replica, sched.kv_cache_manager.take_events())
    assert replica.hashes == pool_keys(pool)
    assert replica.num_removed > 0, "the pool was meant to evict"
    assert sched.reset_prefix_cache()
    _apply_checked(replica, sched.kv_cache_manager.take_events())
    assert replica.hashes == pool_keys(pool) == set() and replica.num_cleared == 1


def _apply_checked(replica: Replica, events: list) -> None:
    """Apply, checking a stored chain's first block unsalted or salted with tenant-b."""
    for e in events:
        if isinstance(e, BlockStored):
            try:
                check_chain(e)
            except AssertionError:
                check_chain(e, ("salt=tenant-b",))
            assert not replica.hashes & set(e.block_hashes), "a hash stored twice"
            replica.hashes |= set(e.block_hashes)
            replica.num_stored += len(e.block_hashes)
        else:
            replica.apply([e])
