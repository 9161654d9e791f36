from __future__ import annotations

import ast
import pathlib

import pytest
from core_fakes import make_request

import pagellm.core
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.request import Request


def manager(num_blocks: int = 16, block_size: int = 4, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(block_size, num_blocks, caching, "sha256", max_model_len=1024)


def start(kv: KVCacheManager, req: Request, num_new: int | None = None) -> int:
    """Prefix lookup + allocation as the scheduler does for a waiting request."""
    blocks, hit = kv.get_computed_blocks(req)
    n = req.num_tokens - hit if num_new is None else num_new
    assert kv.allocate_slots(req, n, blocks, hit) is not None
    req.num_computed_tokens = hit + n
    return hit


def test_allocate_grow_and_free() -> None:
    kv = manager(num_blocks=8)
    req = make_request("a", list(range(10)))
    new = kv.allocate_slots(req, 6)
    assert new is not None and [b.block_id for b in new] == [0, 1]
    req.num_computed_tokens = 6
    new = kv.allocate_slots(req, 2)  # tokens 6..7 fit in block 1
    assert new == []
    req.num_computed_tokens = 8
    new = kv.allocate_slots(req, 2)
    assert new is not None and [b.block_id for b in new] == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(req)
    assert kv.get_block_ids("a") == [] and kv.get_num_free_blocks() == 8
    free = kv.block_pool.free_block_queue.get_all_free_blocks()
    # the partial block 2 (no hash) first; the cached full blocks last, tail first
    assert [b.block_id for b in free] == [2, 3, 4, 5, 6, 7, 1, 0]
    kv.block_pool.check_invariants()


def test_allocation_is_all_or_nothing() -> None:
    kv = manager(num_blocks=4)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None  # 3 blocks
    b = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None  # needs 2, 1 free
    assert kv.get_num_free_blocks() == 1 and kv.get_block_ids("b") == []
    assert kv.allocate_slots(b, 4) is not None


def test_prefix_hit_full_blocks_only_and_capped() -> None:
    kv = manager()
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert start(kv, a) == 0
    b = make_request("b", list(range(10)) + [99])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8 and blocks == kv.get_blocks("a")[:2]
    # a prompt equal to a's first 8 tokens: at most num_tokens - 1 = 7 -> 1 block
    c = make_request("c", list(range(8)))
    blocks, hit = kv.get_computed_blocks(c)
    assert hit == 4 and blocks == kv.get_blocks("a")[:1]
    # a different first token misses everything
    d = make_request("d", [50] + list(range(1, 10)))
    assert kv.get_computed_blocks(d) == ([], 0)


def test_hit_on_freed_cached_blocks_counts_them_against_free_space() -> None:
    kv = manager(num_blocks=6)
    a = make_request("a", list(range(16)))  # 4 full blocks
    start(kv, a)
    kv.free(a)  # all 6 free, 4 of them cached
    b = make_request("b", list(range(16)) + list(range(200, 208)))  # 24 tokens = 6 blocks
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 16 and len(blocks) == 4
    # 4 revived + 2 new = 6 = all free blocks: fits exactly
    assert kv.allocate_slots(b, 8, blocks, hit) is not None
    assert kv.get_num_free_blocks() == 0
    assert kv.get_block_ids("b") == [0, 1, 2, 3, 4, 5]
    kv.block_pool.check_invariants()
    kv.free(b)
    # one more block than the pool holds (4 revived + 3 new > 6 free): refused, nothing changes
    c = make_request("c", list(range(16)) + list(range(300, 312)))
    blocks, hit = kv.get_computed_blocks(c)
    assert hit == 16
    assert kv.allocate_slots(c, 12, blocks, hit) is None
    assert kv.get_num_free_blocks() == 6 and all(b.ref_cnt == 0 for b in blocks)
    kv.block_pool.check_invariants()


def test_prefix_stats_count_once_per_successful_lookup() -> None:
    kv = manager(num_blocks=6)
    a = make_request("a", list(range(16)))
    start(kv, a)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (16, 0)
    b = make_request("b", list(range(12)) + list(range(100, 112)))  # hits 3 blocks, needs 6
    for _ in range(3):  # retried while the pool is short: not counted
        blocks, hit = kv.get_computed_blocks(b)
        assert hit == 12 and kv.allocate_slots(b, 12, blocks, hit) is None
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (16, 0)
    kv.free(a)
    start(kv, b)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (16 + 24, 12)


def test_caching_disabled_shares_only_within_a_group() -> None:
    kv = manager(caching=False)
    a = make_request("a", list(range(10)))
    start(kv, a)
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    assert kv.block_pool.cached_block_hash_to_block == {}
    s1 = make_request("s1", list(range(10)), group_id="g")
    s2 = make_request("s2", list(range(10)), group_id="g")
    other = make_request("o", list(range(10)), group_id="h")
    start(kv, s1)
    assert kv.get_computed_blocks(other)[1] == 0
    assert start(kv, s2) == 8
    assert kv.get_block_ids("s2")[:2] == kv.get_block_ids("s1")[:2]
    assert kv.get_block_ids("s2")[2] != kv.get_block_ids("s1")[2]
    assert kv.prefix_cache_queries == 0  # stats only with prefix caching on
    kv.free(s1)
    kv.free(s2)
    # once no sibling holds them, the blocks lose their hashes: no cross-request cache
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert kv.get_computed_blocks(make_request("s3", list(range(10)), group_id="g"))[1] == 0
    kv.block_pool.check_invariants()


def test_core_imports_no_torch() -> None:
    allowed = ("pagellm.core", "pagellm.request", "pagellm.sampling_params", "pagellm.metrics")
    core_dir = pathlib.Path(pagellm.core.__file__).parent
    for path in core_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not name.startswith(("torch", "numpy")), (path.name, name)
                if name.startswith("pagellm"):
                    assert name.startswith(allowed), (path.name, name)
