"""KV cache groups: layouts by attention type, and the manager's per-group tables, freeing behind
the window, capacity checks over all groups and the prefix-cache rule."""

from __future__ import annotations

import pytest
from core_fakes import make_request

from pagellm.core.kv_cache_groups import kv_cache_layout, num_skipped_blocks
from pagellm.core.kv_cache_manager import KVCacheManager


def test_single_type_models_keep_one_group_and_one_tensor_per_layer() -> None:
    full = kv_cache_layout([None] * 5)
    assert full.num_groups == 1 and full.num_tensors == 5
    assert full.tensor_of_layer == (0, 1, 2, 3, 4) and full.windows == [None]
    mistral = kv_cache_layout([4096] * 3)
    assert mistral.windows == [4096] and mistral.num_tensors == 3


def test_gemma2_layout_two_groups_share_tensors() -> None:
    layout = kv_cache_layout([8, None] * 13)  # Gemma-2-2B: sliding first, alternating
    assert layout.windows == [8, None] and layout.num_tensors == 13
    assert layout.groups[0].layers == tuple(range(0, 26, 2))
    assert layout.group_of_layer[:4] == (0, 1, 0, 1)
    assert layout.tensor_of_layer[:4] == (0, 0, 1, 1)  # layer j of each group: tensor j


def test_gemma3_layout_splits_the_larger_type() -> None:
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # 22 local, 4 global
    layout = kv_cache_layout(windows)
    assert layout.num_tensors == 4
    assert [len(g.layers) for g in layout.groups] == [4, 4, 4, 4, 4, 2, 4]
    assert layout.windows == [512] * 6 + [None]
    # Every layer has exactly one (group, tensor) home; no two layers of a group share one.
    homes = set(zip(layout.group_of_layer, layout.tensor_of_layer, strict=True))
    assert len(homes) == 26


def test_blocks_for_tokens() -> None:
    layout = kv_cache_layout([16, None])
    # full: 7 blocks of 100 tokens; window 16 + a 32-token chunk: ceil(47 / 16) + 1 = 4.
    assert layout.blocks_for_tokens(100, 16, 32) == 7 + 4
    assert layout.blocks_for_tokens(20, 16, 32) == 2 + 2  # never more than the full length


def test_num_skipped_blocks() -> None:
    assert num_skipped_blocks(100, None, 16) == 0
    # The next query (position 40) sees keys from 25: blocks 0 (0-15) goes, 16-31 stays.
    assert num_skipped_blocks(40, 16, 16) == 1
    assert num_skipped_blocks(47, 16, 16) == 2
    assert num_skipped_blocks(10, 16, 16) == 0


def _grow(kv: KVCacheManager, req, upto: int, step: int = 1) -> None:
    while req.num_computed_tokens < upto:
        n = min(step, upto - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n


def test_windowed_group_frees_behind_the_window_and_full_group_grows() -> None:
    kv = KVCacheManager(4, 40, enable_caching=False, group_windows=[8, None])
    req = make_request("a", list(range(60)))
    _grow(kv, req, 60, step=5)
    full, windowed = kv.get_group_blocks("a", 1), kv.get_group_blocks("a", 0)
    assert len(full) == len(windowed) == 15
    live = [b for b in windowed if b is not kv.null_block]
    # Freed by the last allocation (at 55 computed: keys from 48 on): blocks 0..11 are gone.
    assert len(live) == 15 - 12 and all(b is kv.null_block for b in windowed[:12])
    assert kv.get_num_free_blocks() == 40 - 15 - 3
    ids = {b.block_id for b in full} | {b.block_id for b in live}
    assert len(ids) == 18  # no block in two tables
    kv.free(req)
    assert kv.get_num_free_blocks() == 40
    kv.block_pool.check_invariants()


def test_allocation_counts_every_group() -> None:
    kv = KVCacheManager(4, 7, enable_caching=False, group_windows=[8, None])
    req = make_request("a", list(range(20)))
    assert kv.allocate_slots(req, 16) is None  # 4 blocks x 2 groups > 7
    assert kv.get_num_free_blocks() == 7
    assert kv.allocate_slots(req, 12) is not None  # 3 x 2
    assert kv.get_other_group_block_ids("a") == [[b.block_id for b in kv.get_group_blocks("a", 1)]]
    assert kv.get_other_group_block_ids("a", last=1) == [[kv.get_group_blocks("a", 1)[-1]
                                                          .block_id]]


def test_prefix_caching_is_off_with_several_groups(caplog) -> None:
    with caplog.at_level("INFO", logger="pagellm"):
        kv = KVCacheManager(4, 16, enable_caching=True, group_windows=[8, None])
    assert not kv.enable_caching and "Prefix caching is disabled" in caplog.text
    assert KVCacheManager(4, 16, enable_caching=True, group_windows=[8]).enable_caching


@pytest.mark.parametrize("grown", [12, 40])
def test_single_windowed_group_prefix_hits_need_the_whole_chain(grown) -> None:
    """With one windowed group, blocks freed behind the window stay cached until evicted: a
    later prompt hits them only while its whole chain is still in the cache."""
    kv = KVCacheManager(4, 64, enable_caching=True, group_windows=[8])
    a = make_request("a", list(range(48)))
    _grow(kv, a, grown, step=4)
    b = make_request("b", list(range(48)))
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == min(grown, 44)  # at most (48 - 1) // 4 blocks: the last token computes
    assert all(blk.block_hash is not None for blk in blocks)
