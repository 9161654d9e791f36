"""Recurrent-state snapshots for prefix caching (core/state_snapshots.py) and their use by the
KV cache manager: where snapshots are taken, which hit a request gets, eviction, failed steps,
tenants."""

from __future__ import annotations

import pytest
from core_fakes import make_request

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.state_snapshots import StateSnapshotCache


def _hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 4 for i in range(n)]


def test_lookup_takes_the_longest_cached_multiple_of_the_interval() -> None:
    snaps = StateSnapshotCache(num_slots=4, first_slot=10, interval_blocks=2)
    h = _hashes(8)
    assert [snaps.reserve(h[i]) for i in (1, 3)] == [10, 11]
    snaps.begin_step()
    assert snaps.lookup(h, 8) == (4, 11)
    assert snaps.lookup(h, 3) == (2, 10)  # at most 3 blocks: the snapshot after 2
    assert snaps.lookup(h, 1) == (0, -1)
    assert snaps.lookup(_hashes(2)[:1] + [b"x"] * 7, 8) == (0, -1)  # another prefix
    assert list(snaps.positions(0, 8)) == [2, 4, 6, 8]
    assert list(snaps.positions(3, 6)) == [4, 6]
    assert snaps.reserve(h[1]) is None  # cached already


def test_snapshots_being_written_are_neither_hit_nor_evicted() -> None:
    snaps = StateSnapshotCache(num_slots=2, first_slot=0, interval_blocks=1)
    h = _hashes(4)
    assert snaps.reserve(h[0]) == 0
    assert snaps.lookup(h, 4) == (0, -1)  # its restore would run before the step writes it
    assert snaps.reserve(h[1]) == 1
    snaps.begin_step()  # both in flight in the step before (async scheduling)
    assert snaps.reserve(h[2]) is None  # nothing evictable
    assert snaps.lookup(h, 4) == (2, 1)  # the step before runs first: readable
    snaps.begin_step()
    assert snaps.reserve(h[2]) == 0  # evicts the least recently used (h[0]; h[1] was hit)
    assert snaps.num_evicted == 1
    snaps.begin_step()
    assert snaps.lookup(h, 1) == (0, -1)


def test_a_failed_step_drops_its_snapshots() -> None:
    snaps = StateSnapshotCache(num_slots=2, first_slot=0, interval_blocks=1)
    h = _hashes(2)
    snaps.reserve(h[0])
    snaps.begin_step()
    snaps.reserve(h[1])
    snaps.uncache_step()
    snaps.begin_step()
    assert snaps.lookup(h, 2) == (1, 0) and snaps.num_cached == 1
    snaps.reserve(h[1])
    snaps.uncache_step(include_previous=True)
    assert snaps.num_cached == 1  # the step before this one had written nothing new


def _manager(**kw) -> KVCacheManager:
    return KVCacheManager(block_size=4, num_blocks=64, enable_caching=True, num_state_slots=2,
                          num_snapshot_slots=8, snapshot_interval_blocks=2, **kw)


def test_manager_plans_snapshots_and_resumes_from_them() -> None:
    kv = _manager()
    prompt = list(range(100, 121))  # 21 tokens: snapshots after 8 and 16
    a = make_request("a", prompt)
    kv.begin_step()
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 10) is not None  # first chunk: 10 tokens
    assert kv.take_state_plan("a") == (-1, [(8, 2)])  # snapshot slots follow the 2 running
    a.num_computed_tokens = 10
    kv.begin_step()
    assert kv.allocate_slots(a, 11) is not None
    assert kv.take_state_plan("a") == (-1, [(6, 3)])  # after 16 = 10 + 6 tokens
    a.num_computed_tokens = 21
    kv.begin_step()
    b = make_request("b", prompt + [5, 6, 7])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 16 and len(blocks) == 4
    assert kv.allocate_slots(b, 8, blocks, hit) is not None
    # Resumes from the snapshot after 16 tokens; its own tokens reach the next one at 24.
    assert kv.take_state_plan("b") == (3, [(8, 4)])
    assert kv.get_state_slot("b") != kv.get_state_slot("a")
    # Another tenant sending the same tokens: no hit.
    kv.begin_step()
    other = make_request("c", prompt + [5, 6, 7], cache_salt="tenant-b")
    assert kv.get_computed_blocks(other)[1] == 0


def test_no_free_state_slot_fails_the_allocation_unchanged() -> None:
    kv = _manager()
    reqs = [make_request(r, list(range(10))) for r in "abc"]
    for r in reqs[:2]:
        assert kv.allocate_slots(r, 10) is not None
    free = kv.get_num_free_blocks()
    assert kv.allocate_slots(reqs[2], 10) is None
    assert kv.get_num_free_blocks() == free
    kv.free(reqs[0])
    assert kv.allocate_slots(reqs[2], 10) is not None


@pytest.mark.parametrize("slots", [0, 5])
def test_caching_needs_snapshot_slots(slots: int) -> None:
    kv = KVCacheManager(block_size=4, num_blocks=16, enable_caching=True, num_state_slots=2,
                        num_snapshot_slots=slots)
    assert kv.enable_caching == bool(slots)
    assert (kv.snapshots is not None) == bool(slots)
