from __future__ import annotations

import pytest

from pagellm.core.block_hash import BlockHash
from pagellm.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "little"))


def test_free_queue_order_and_middle_removal() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    assert q.num_free_blocks == 6 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    q.remove(blocks[3])  # middle
    q.remove(blocks[5])  # last
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 4]
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None
    assert q.popleft() is blocks[0]
    q.append(blocks[3])
    q.append_n([blocks[5], blocks[0]])
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 3, 5, 0]
    assert q.num_free_blocks == 6
    assert ids(q.popleft_n(3)) == [1, 2, 4]
    # links stay consistent in both directions
    back, cur = [], q.fake_tail.prev_free_block
    while cur is not q.fake_head:
        assert cur is not None
        back.append(cur.block_id)
        cur = cur.prev_free_block
    assert back == [0, 5, 3]
    with pytest.raises(ValueError):
        q.popleft_n(4)
    q.popleft_n(3)
    with pytest.raises(ValueError):
        q.popleft()
    assert q.num_free_blocks == 0


def test_middle_removal_touches_only_neighbours() -> None:
    # O(1): removing a block rewires its two neighbours and nothing else.
    blocks = [KVCacheBlock(i) for i in range(1000)]
    q = FreeBlockQueue(blocks)
    before = [(b.prev_free_block, b.next_free_block) for b in blocks]
    q.remove(blocks[500])
    changed = [i for i, b in enumerate(blocks)
               if (b.prev_free_block, b.next_free_block) != before[i]]
    assert changed == [499, 500, 501]
    assert blocks[499].next_free_block is blocks[501]
    assert blocks[501].prev_free_block is blocks[499]


def test_alloc_free_refcounts_and_lru_tail_first() -> None:
    pool = BlockPool(10, enable_caching=True)
    a = pool.get_new_blocks(4)
    assert ids(a) == [0, 1, 2, 3] and all(b.ref_cnt == 1 for b in a)
    assert pool.get_num_free_blocks() == 6 and pool.get_usage() == pytest.approx(0.4)
    b = pool.get_new_blocks(2)
    assert ids(b) == [4, 5]
    pool.cache_full_blocks(b, [h(1), h(2)], 0, 2)
    pool.free_blocks(reversed(a))  # a request frees tail first
    # a's blocks hold no cached prefix: at the front, handed out before never-used blocks
    assert free_ids(pool) == [0, 1, 2, 3, 6, 7, 8, 9]
    pool.free_blocks(reversed(b))
    # b's blocks are cached: at the back (least recently freed evicted first, tail first)
    assert free_ids(pool) == [0, 1, 2, 3, 6, 7, 8, 9, 5, 4]
    pool.check_invariants()
    assert ids(pool.get_new_blocks(9)) == [0, 1, 2, 3, 6, 7, 8, 9, 5]
    assert pool.get_cached_block(h(2)) is None and pool.get_cached_block(h(1)) is b[0]
    pool.check_invariants()


def test_freed_blocks_are_reused_first_so_the_working_set_stays_small() -> None:
    for caching in (False, True):
        pool = BlockPool(100, enable_caching=caching)
        used = set()
        for _ in range(50):  # requests of 3 blocks, one at a time
            blocks = pool.get_new_blocks(3)
            used |= set(ids(blocks))
            pool.free_blocks(reversed(blocks))
        assert used == {0, 1, 2}
        pool.check_invariants()


def test_shared_block_freed_only_at_last_reference() -> None:
    pool = BlockPool(4, enable_caching=True)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and pool.get_num_free_blocks() == 3
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and free_ids(pool)[0] == blk.block_id
    with pytest.raises(AssertionError):
        pool.free_blocks([blk])


def test_cache_touch_and_lazy_eviction() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(10), h(11)], 0, 2)  # only the 2 full blocks
    assert pool.get_cached_block(h(10)) is blocks[0]
    assert pool.get_cached_block(h(11)) is blocks[1]
    assert blocks[2].block_hash is None
    pool.free_blocks(reversed(blocks))
    # the unhashed block 2 first (nothing to keep), the cached ones after the never-used 3
    assert free_ids(pool) == [2, 3, 1, 0]
    # freed blocks stay cached; a hit revives block 1 from the middle of the queue
    assert pool.get_cached_block(h(11)) is blocks[1]
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1 and free_ids(pool) == [2, 3, 0]
    pool.check_invariants()
    # reusing block 0 (LRU order: 2, 3, 0) evicts its hash right then, not before
    assert ids(pool.get_new_blocks(2)) == [2, 3]
    assert pool.get_cached_block(h(10)) is blocks[0]
    assert ids(pool.get_new_blocks(1)) == [0]
    assert pool.get_cached_block(h(10)) is None and blocks[0].block_hash is None
    pool.check_invariants()


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(4, enable_caching=True)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [h(1)], 0, 1)
    pool.cache_full_blocks(b, [h(1)], 0, 1)
    assert pool.get_cached_block(h(1)) is a[0] and b[0].block_hash is None
    pool.free_blocks(a)
    pool.get_new_blocks(3)  # the 2 untouched blocks, then a[0]: the hash is evicted
    assert pool.get_cached_block(h(1)) is None
    pool.check_invariants()


def test_caching_disabled_drops_hash_at_zero_refs() -> None:
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)
    pool.touch([blocks[0]])  # a sibling shares block 0
    pool.free_blocks(reversed(blocks))
    assert blocks[1].block_hash is None and pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is blocks[0]  # still held by the sibling
    pool.free_blocks([blocks[0]])
    assert pool.get_cached_block(h(1)) is None and pool.cached_block_hash_to_block == {}
    pool.check_invariants()


def test_reset_prefix_cache() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)
    assert pool.reset_prefix_cache() is False  # in use: nothing changes
    assert pool.get_cached_block(h(1)) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert free_ids(pool) == [2, 3, 1, 0]  # the free order is kept
    pool.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.check_invariants()
    blocks[0].ref_cnt = 0  # referenced count lost but not in the free queue
    with pytest.raises(AssertionError):
        pool.check_invariants()
    blocks[0].ref_cnt = 1
    blocks[1].block_hash = h(5)  # hash not in the map
    with pytest.raises(AssertionError):
        pool.check_invariants()
    blocks[1].block_hash = None
    pool.cached_block_hash_to_block[h(6)] = blocks[1]  # map entry for a hashless block
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_num_blocks_validated() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, enable_caching=True)
