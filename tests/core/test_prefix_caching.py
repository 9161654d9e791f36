from __future__ import annotations

import random

import pytest
from core_fakes import (
    FakeRunner,
    check_step,
    content_token,
    make_request,
    make_scheduler,
    output_tokens,
    run_until_idle,
)

from pagellm.core.scheduler import Scheduler
from pagellm.request import Request


def first_step_of(sched: Scheduler, runner: FakeRunner, *reqs: Request) -> dict[str, int]:
    """Add the requests, run one step, return req_id -> scheduled tokens."""
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    check_step(sched, out)
    sched.update_from_output(out, runner.execute(out))
    return out.num_scheduled_tokens


def assert_idle_with_cache(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert not sched.has_unfinished_requests()
    assert kv.get_num_free_blocks() == sched.num_blocks
    kv.block_pool.check_invariants()


@pytest.mark.parametrize("same_step", [False, True])
def test_shared_1000_token_prefix_hits_exactly_the_full_blocks(same_step: bool) -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(1, 30000) for _ in range(1000)]
    a = make_request("a", prefix + [rng.randrange(1, 30000) for _ in range(20)])
    b = make_request("b", prefix + [rng.randrange(1, 30000) for _ in range(30)])
    sched = make_scheduler(num_blocks=200, block_size=16, max_num_batched_tokens=4096,
                           max_model_len=2048)
    runner = FakeRunner(16, next_token=content_token)
    if same_step:  # b hits the blocks a computes in this very step
        scheduled = first_step_of(sched, runner, a, b)
    else:
        assert first_step_of(sched, runner, a) == {"a": 1020}
        run_until_idle(sched, runner)
        scheduled = first_step_of(sched, runner, b)
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 992  # 62 full blocks of 16; block 62 mixes in b's own tokens
    assert scheduled["b"] == 1030 - 992
    kv = sched.kv_cache_manager
    if same_step:
        assert kv.get_block_ids("b")[:62] == kv.get_block_ids("a")[:62]
        assert kv.get_block_ids("b")[62] != kv.get_block_ids("a")[62]
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (1020 + 1030, 992)
    outs = run_until_idle(sched, runner)
    assert outs["b"][-1].num_cached_tokens == 992
    assert_idle_with_cache(sched)
    # the same tokens as b computed without any cache
    ref = make_scheduler(num_blocks=200, block_size=16, max_num_batched_tokens=4096,
                         max_model_len=2048, enable_prefix_caching=False)
    ref.add_request(make_request("b", b.prompt_token_ids))
    ref_runner = FakeRunner(16, next_token=content_token)
    ref_out = run_until_idle(ref, ref_runner)["b"]
    assert b.output_token_ids == output_tokens(ref_out)


def test_exact_prefix_prompts_capped_at_num_tokens_minus_one() -> None:
    p = list(range(100, 164))  # 4 blocks of 16
    sched = make_scheduler(num_blocks=64, block_size=16, max_model_len=512)
    runner = FakeRunner(16)
    first_step_of(sched, runner, make_request("a", p[:48]))
    b = make_request("b", p)
    first_step_of(sched, runner, b)
    assert b.num_cached_tokens == 48  # a's 3 full blocks
    c = make_request("c", p[:32])
    assert first_step_of(sched, runner, c)["c"] == 16  # at most 31 tokens -> 1 block
    assert c.num_cached_tokens == 16
    d = make_request("d", p)  # all 4 blocks cached, but the last token must be recomputed
    first_step_of(sched, runner, d)
    assert d.num_cached_tokens == 48
    run_until_idle(sched, runner)
    assert_idle_with_cache(sched)


def test_cache_salts_isolate_tenants() -> None:
    prompt = list(range(1, 41))  # 5 blocks of 8
    sched = make_scheduler(num_blocks=64, block_size=8)
    runner = FakeRunner(8)
    reqs = {
        "t1": make_request("t1", prompt, cache_salt="tenant-1"),
        "t1b": make_request("t1b", prompt, cache_salt="tenant-1"),
        "t2": make_request("t2", prompt, cache_salt="tenant-2"),
        "none": make_request("none", prompt),
        "empty": make_request("empty", prompt, cache_salt=""),
    }
    for rid in ("t1", "t1b", "t2", "none", "empty"):
        first_step_of(sched, runner, reqs[rid])
        run_until_idle(sched, runner)
    cached = {rid: r.num_cached_tokens for rid, r in reqs.items()}
    # same salt hits; another salt and unsalted miss; "" is unsalted (hits None)
    assert cached == {"t1": 0, "t1b": 32, "t2": 0, "none": 0, "empty": 32}
    late = make_request("late", prompt, cache_salt="tenant-3")
    first_step_of(sched, runner, late)  # unsalted blocks are cached, salted chain never hits
    assert late.num_cached_tokens == 0
    run_until_idle(sched, runner)
    assert_idle_with_cache(sched)


def test_lru_eviction_tail_first() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    runner = FakeRunner(4)
    pa, pb = [1] * 4 + [2] * 4, [3] * 4 + [4] * 4
    for rid, p in (("a", pa), ("b", pb)):  # 2 blocks each, finished after one token
        first_step_of(sched, runner, make_request(rid, p, max_tokens=1))
    pool = sched.kv_cache_manager.block_pool
    free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert free == [4, 5, 6, 7, 1, 0, 3, 2]  # unused, then a (tail first), then b
    # c needs 5 new blocks: the 4 unused ones, then a's tail block
    c = make_request("c", list(range(100, 120)), max_tokens=2)
    first_step_of(sched, runner, c)
    assert sched.kv_cache_manager.get_block_ids("c") == [4, 5, 6, 7, 1]
    kv = sched.kv_cache_manager
    # probe only (allocating would evict more): a kept its head block, b kept both
    assert kv.get_computed_blocks(make_request("a2", pa + [9]))[1] == 4
    assert kv.get_computed_blocks(make_request("b2", pb + [9]))[1] == 8
    run_until_idle(sched, runner)
    assert_idle_with_cache(sched)


def test_small_pool_shared_prefixes_match_reference() -> None:
    """Many requests sharing prefixes in a pool far too small: evictions and preemptions
    happen, running requests never lose a block (the fake runner checks every KV read), and
    every output matches a run with a huge pool and no cache."""
    rng = random.Random(3)
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    prompts = [rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randrange(0, 9))]
               for _ in range(24)]
    max_tokens = [rng.randrange(1, 20) for _ in prompts]

    def run(num_blocks: int, caching: bool, seqs: int, budget: int) -> tuple[dict, Scheduler]:
        sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=seqs,
                               max_num_batched_tokens=budget, enable_prefix_caching=caching)
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
            sched.add_request(make_request(f"r{i}", p, max_tokens=m))
        outs = run_until_idle(sched, FakeRunner(4, next_token=content_token))
        return {k: output_tokens(v) for k, v in outs.items()}, sched

    ref, _ = run(1000, False, 64, 4096)
    got, sched = run(20, True, 6, 24)
    assert got == ref
    stats = sched.make_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0
    assert_idle_with_cache(sched)
    assert sched.kv_cache_manager.block_pool.cached_block_hash_to_block  # cached, yet free


def test_reset_prefix_cache() -> None:
    prompt = list(range(1, 21))
    sched = make_scheduler(num_blocks=16, block_size=4)
    runner = FakeRunner(4)
    first_step_of(sched, runner, make_request("a", prompt, max_tokens=3))
    assert sched.reset_prefix_cache() is False  # a is running
    run_until_idle(sched, runner)
    b = make_request("b", prompt)
    first_step_of(sched, runner, b)
    assert b.num_cached_tokens == 16
    run_until_idle(sched, runner)
    assert sched.reset_prefix_cache() is True
    assert sched.kv_cache_manager.block_pool.cached_block_hash_to_block == {}
    c = make_request("c", prompt)
    first_step_of(sched, runner, c)
    assert c.num_cached_tokens == 0
    run_until_idle(sched, runner)
    assert_idle_with_cache(sched)


def test_caching_disabled_only_siblings_share() -> None:
    prompt = list(range(1, 66))  # 65 tokens: 4 full blocks of 16 + 1
    sched = make_scheduler(num_blocks=40, block_size=16, max_num_batched_tokens=1024,
                           enable_prefix_caching=False)
    runner = FakeRunner(16, next_token=content_token)
    first_step_of(sched, runner, make_request("a", prompt, max_tokens=2))
    run_until_idle(sched, runner)
    b = make_request("b", prompt, max_tokens=2)
    first_step_of(sched, runner, b)
    assert b.num_cached_tokens == 0  # no cache across requests
    run_until_idle(sched, runner)
    kv = sched.kv_cache_manager
    assert kv.block_pool.cached_block_hash_to_block == {}
    # 4 samples of one prompt, scheduled together: the 4 full blocks are computed once
    sibs = [make_request(f"s{i}", prompt, max_tokens=3, group_id="g") for i in range(4)]
    scheduled = first_step_of(sched, runner, *sibs)
    assert [s.num_cached_tokens for s in sibs] == [0, 64, 64, 64]
    assert scheduled == {"s0": 65, "s1": 1, "s2": 1, "s3": 1}
    assert kv.usage == pytest.approx((4 + 4 * 1) / 40)  # 4 shared + 1 private block each
    unrelated = make_request("u", prompt, max_tokens=1, group_id="other")
    first_step_of(sched, runner, unrelated)
    assert unrelated.num_cached_tokens == 0
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    outs = run_until_idle(sched, runner)
    assert len({tuple(output_tokens(outs[f"s{i}"])) for i in range(4)}) == 1
    assert_idle_with_cache(sched)
    assert kv.block_pool.cached_block_hash_to_block == {}


def test_siblings_share_through_the_cache_when_enabled() -> None:
    prompt = list(range(1, 66))
    sched = make_scheduler(num_blocks=40, block_size=16, max_num_batched_tokens=1024,
                           hash_algo="blake2b")
    runner = FakeRunner(16)
    sibs = [make_request(f"s{i}", prompt, group_id="g", cache_salt="t") for i in range(3)]
    first_step_of(sched, runner, *sibs)
    assert [s.num_cached_tokens for s in sibs] == [0, 64, 64]
    assert sched.kv_cache_manager.usage == pytest.approx((4 + 3) / 40)
    other_group = make_request("o", prompt, group_id="h", cache_salt="t")
    first_step_of(sched, runner, other_group)  # the group id is not part of the cache key
    assert other_group.num_cached_tokens == 64
    run_until_idle(sched, runner)
    assert_idle_with_cache(sched)


def test_a_failed_step_uncaches_the_blocks_it_would_have_written() -> None:
    """Blocks are hashed when allocated, before the runner writes them: when that step fails,
    their hashes must go (a hit would read never-written K/V), while the blocks of earlier,
    successful steps stay cached."""
    prompt = list(range(1, 21))  # 5 blocks of 4
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    runner = FakeRunner(4)
    first_step_of(sched, runner, make_request("a", prompt))  # blocks 0-1 computed
    failed = sched.schedule()  # a's next chunk hashes blocks 2-3, then the step fails
    assert sched.fail_step(failed) == ["a"]
    assert len(sched.kv_cache_manager.block_pool.cached_block_hash_to_block) == 2
    retry = make_request("retry", prompt)
    first_step_of(sched, runner, retry)
    assert retry.num_cached_tokens == 8  # the successful step's blocks only
    run_until_idle(sched, runner)  # the fake runner checks every block's content
    assert_idle_with_cache(sched)
