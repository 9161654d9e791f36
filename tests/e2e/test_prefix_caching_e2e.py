"""Automatic prefix caching end to end on a tiny random Llama (fp32): identical greedy tokens with
caching on and off, exact hit counts, cache salts, LRU eviction under a small pool, and the
``pagellm bench prefix`` command."""

from __future__ import annotations

import json
import random

import pytest

from pagellm import LLM, SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_tiny_model, tmp_path_factory):
    # A longer context than the default tiny model, for the 1,000-token shared prefix.
    return make_tiny_model(tmp_path_factory.mktemp("tiny-pc"), "llama",
                           max_position_embeddings=2048)


def make_llm(model_dir, caching: bool, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "16MiB")
    kw.setdefault("max_model_len", 2048)
    return LLM(model=str(model_dir), dtype="float32", enable_prefix_caching=caching, **kw)


@pytest.fixture(scope="module")
def llm_off(model_dir) -> LLM:
    return make_llm(model_dir, caching=False)


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def kv_manager(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager


def assert_pool_idle(llm: LLM) -> None:
    """At idle every block is free (cached or not) and the pool's structure holds."""
    kv = kv_manager(llm)
    kv.block_pool.check_invariants()
    assert kv.get_num_free_blocks() == kv.block_pool.num_blocks
    assert not kv.req_to_blocks


def workload() -> list[list[int]]:
    """Shared full-block prefixes, partial-block prefixes, prompts that are exact prefixes of
    each other (ending on and off block boundaries) and duplicates."""
    shared, partial, base = rand_ids(64, 1), rand_ids(40, 2), rand_ids(90, 3)
    return [
        shared + rand_ids(5, 10), shared + rand_ids(17, 11), shared + rand_ids(30, 12),
        partial + rand_ids(9, 13), partial + rand_ids(24, 14),
        base[:32], base[:33], base[:47], base[:48], base[:49], base, base + rand_ids(20, 15),
        shared + rand_ids(5, 10),  # a duplicate
        rand_ids(1, 16), rand_ids(16, 17),
    ]


def expected_hit(prompt: list[int], computed: list[list[int]]) -> int:
    """Independent reference: the longest common prefix with any sequence computed before, in
    whole blocks, leaving at least the last prompt token to compute."""
    best = 0
    for seq in computed:
        n = 0
        for a, b in zip(prompt, seq, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return min(best // BLOCK, (len(prompt) - 1) // BLOCK) * BLOCK


def test_greedy_identical_on_off_and_exact_hits(model_dir, llm_off) -> None:
    prompts = workload()
    ref = llm_off.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in ref)

    llm = make_llm(model_dir, caching=True)
    core = llm.llm_engine.engine_core
    computed: list[list[int]] = []  # every token whose KV was computed and cached so far
    for p, r in zip(prompts, ref, strict=True):
        before = core.stats.num_prompt_tokens
        out = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == r.outputs[0].token_ids, p
        assert out.num_cached_tokens == expected_hit(p, computed), p
        assert core.stats.num_prompt_tokens - before == len(p) - out.num_cached_tokens
        computed.append(p + out.outputs[0].token_ids[:-1])  # the last token is never computed
    stats = core.make_stats()
    assert stats.prefix_cache_hits == sum(expected_hit(p, computed[:i])
                                          for i, p in enumerate(prompts)) > 0
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert_pool_idle(llm)


def test_greedy_identical_batched_and_chunked(model_dir, llm_off) -> None:
    prompts = [{"prompt_token_ids": p} for p in workload()]
    ref = [o.outputs[0].token_ids for o in llm_off.generate(prompts, GREEDY, use_tqdm=False)]
    # Small budget: prefix hits combine with chunked prefills and mixed batches.
    llm = make_llm(model_dir, caching=True, max_num_batched_tokens=40, max_num_seqs=4)
    stats = llm.llm_engine.engine_core.stats
    for _ in range(2):  # cold cache (same-step sharing), then warm cache
        before = stats.num_prompt_tokens
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        # Prefill tokens computed, over chunks of every size: the prompts less the hits.
        assert stats.num_prompt_tokens - before == sum(
            len(p["prompt_token_ids"]) - o.num_cached_tokens
            for p, o in zip(prompts, outs, strict=True))
    assert any(o.num_cached_tokens > 0 for o in outs)
    assert_pool_idle(llm)


@pytest.mark.parametrize("same_batch", [False, True])
def test_1000_token_prefix_second_request_hits_full_blocks(model_dir, llm_off,
                                                           same_batch: bool) -> None:
    shared = rand_ids(1000, 5)
    a, b = shared + rand_ids(20, 6), shared + rand_ids(30, 7)
    llm = make_llm(model_dir, caching=True)
    if same_batch:
        out_a, out_b = llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}], GREEDY,
                                    use_tqdm=False)
    else:
        out_a = llm.generate({"prompt_token_ids": a}, GREEDY, use_tqdm=False)[0]
        out_b = llm.generate({"prompt_token_ids": b}, GREEDY, use_tqdm=False)[0]
    assert out_a.num_cached_tokens == 0
    assert out_b.num_cached_tokens == 1000 // BLOCK * BLOCK == 992
    assert llm.llm_engine.engine_core.make_stats().prefix_cache_hits == 992
    if same_batch:
        ref = llm_off.generate({"prompt_token_ids": b}, GREEDY, use_tqdm=False)[0]
        assert out_b.outputs[0].token_ids == ref.outputs[0].token_ids
    assert_pool_idle(llm)


def test_cache_salts_isolate_tenants(model_dir) -> None:
    llm = make_llm(model_dir, caching=True)
    ids = rand_ids(100, 8)
    full = 96  # 6 full blocks

    def run(salt: str | None) -> tuple[int, list[int]]:
        prompt = {"prompt_token_ids": ids}
        if salt is not None:
            prompt["cache_salt"] = salt
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    hits = {}
    tokens = set()
    for step, salt in enumerate(["a", "a", "b", None, None, "a", "b", ""]):
        hits[step], toks = run(salt)
        tokens.add(tuple(toks))
    assert hits == {0: 0, 1: full,  # same salt hits
                    2: 0,  # another salt misses
                    3: 0,  # unsalted never hits salted
                    4: full, 5: full, 6: full,
                    7: full}  # an empty salt is no salt
    assert len(tokens) == 1  # the salt never changes the output
    # Text prompts carry salts too.
    text = {"prompt": "The quick brown fox jumps over the lazy dog. " * 6, "cache_salt": "t"}
    first, second = (llm.generate(text, GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert_pool_idle(llm)


def test_lru_eviction_order(model_dir) -> None:
    # 16 blocks; each 64-token prompt (max_tokens=1) leaves 4 cached free blocks behind.
    llm = make_llm(model_dir, caching=True, num_gpu_blocks_override=16, max_model_len=128)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    p = {name: rand_ids(64, 20 + i) for i, name in enumerate(["p1", "p2", "p3", "p4", "p5"])}

    def hit(name: str) -> int:
        return llm.generate({"prompt_token_ids": p[name]}, one, use_tqdm=False)[0] \
            .num_cached_tokens

    assert [hit(n) for n in ("p1", "p2", "p3", "p4")] == [0, 0, 0, 0]  # the pool is now full
    assert hit("p1") == 48  # a hit refreshes p1: p2 is now the least recently used
    assert hit("p5") == 0  # evicts p2's blocks, not p1's or p3's
    assert [hit("p1"), hit("p3"), hit("p2")] == [48, 48, 0]
    assert_pool_idle(llm)


def test_small_pool_evicts_and_preempts_yet_outputs_match(model_dir, llm_off) -> None:
    families = [rand_ids(48, 30 + f) for f in range(3)]
    prompts = [{"prompt_token_ids": families[i % 3] + rand_ids(3 + 5 * i, 40 + i)}
               for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm_off.generate(prompts, params, use_tqdm=False)]

    llm = make_llm(model_dir, caching=True, num_gpu_blocks_override=24, max_model_len=256)
    engine = llm.llm_engine
    sched = engine.engine_core.scheduler
    kv = sched.kv_cache_manager
    batch = engine.engine_core.executor.runner.input_batch
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        kv.block_pool.check_invariants()
        # Running requests never lose blocks: the runner's table is the manager's, all held.
        for req in sched.running:
            block_ids = kv.get_block_ids(req.request_id)
            state = batch.requests[req.request_id]
            assert batch.block_table[state.row, : state.num_blocks].tolist() == block_ids
            assert len(block_ids) == -(-req.num_computed_tokens // BLOCK)
            assert all(kv.block_pool.blocks[b].ref_cnt > 0 for b in block_ids)
    assert [results[str(i)] for i in range(len(prompts))] == ref
    assert sched.num_preemptions > 0  # the pool was really too small
    assert_pool_idle(llm)
    assert kv.block_pool.cached_block_hash_to_block  # free blocks stay cached


def test_reset_prefix_cache(model_dir) -> None:
    llm = make_llm(model_dir, caching=True)
    prompt = {"prompt_token_ids": rand_ids(70, 9)}
    assert [llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens
            for _ in range(2)] == [0, 64]
    engine = llm.llm_engine
    engine.add_request("busy", prompt, GREEDY)
    engine.step()
    assert llm.reset_prefix_cache() is False  # refused while a request holds blocks
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() is True
    assert not kv_manager(llm).block_pool.cached_block_hash_to_block
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert_pool_idle(llm)


def test_bench_prefix_command(model_dir, tmp_path) -> None:
    from pagellm.entrypoints.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "prefix", str(model_dir), "--dtype", "float32", "--kv-cache-memory",
               "16MiB", "--max-model-len", "256", "--num-prompts", "5", "--prefix-len", "70",
               "--suffix-len", "3-9", "--output-len", "4", "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    off, on = result["caching_off"], result["caching_on"]
    total = off["prompt_tokens"]
    assert on["prompt_tokens"] == total
    assert off["prefill_tokens_computed"] == total and off["prefix_cache_hit_tokens"] == 0
    # Every request after the first reuses the prefix's 4 full blocks (64 of its 70 tokens).
    assert on["prefix_cache_hit_tokens"] == 4 * 64
    assert on["prefill_tokens_computed"] == total - 4 * 64
    assert result["outputs_match"] == 5
    assert on["output_tokens"] == off["output_tokens"] == 5 * 4
