"""Parallel sampling (n > 1) end to end on a tiny random Llama: N seeded samples, reproducible
whatever the batch, each with its own index and finish reason, sharing the prompt's KV blocks."""

from __future__ import annotations

import random

import pytest

from pagellm import LLM, SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(make_tiny_model, tmp_path_factory):
    # A longer context than the default tiny model, for 256-token prompts.
    return make_tiny_model(tmp_path_factory.mktemp("tiny-n"), "llama",
                           max_position_embeddings=1024)


def make_llm(model_dir, caching: bool, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "16MiB")
    return LLM(model=str(model_dir), dtype="float32", max_model_len=1024,
               enable_prefix_caching=caching, **kw)


@pytest.fixture(scope="module")
def llm_off(model_dir) -> LLM:
    return make_llm(model_dir, caching=False)


@pytest.fixture(scope="module")
def llm_on(model_dir) -> LLM:
    return make_llm(model_dir, caching=True)


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


PROMPT = {"prompt_token_ids": prompt_ids(40, 1)}
SAMPLED = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)


def samples(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def assert_pool_idle(llm: LLM) -> None:
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    kv.block_pool.check_invariants()
    assert kv.get_num_free_blocks() == kv.block_pool.num_blocks
    assert not kv.req_to_blocks


def test_n_distinct_seeded_samples_with_indices(llm_off) -> None:
    out = llm_off.generate(PROMPT, SAMPLED, use_tqdm=False)[0]
    assert out.finished and len(out.outputs) == 4
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(t) for t in samples(out)}) == 4, samples(out)
    assert out.num_cached_tokens == 0  # caching off: sibling sharing is not a cache hit
    # Sample i is the n=1 request with seed + i (each child has its own seed stream).
    singles = llm_off.generate([PROMPT] * 4, [SAMPLED.clone(n=1, seed=7 + i) for i in range(4)],
                               use_tqdm=False)
    assert [s.outputs[0].token_ids for s in singles] == samples(out)
    assert_pool_idle(llm_off)


def test_reproducible_across_runs_batches_and_caching(model_dir, llm_off, llm_on) -> None:
    ref = samples(llm_off.generate(PROMPT, SAMPLED, use_tqdm=False)[0])
    assert samples(llm_off.generate(PROMPT, SAMPLED, use_tqdm=False)[0]) == ref
    # In a batch with other prompts (longer prefills and decodes side by side), placed mid-batch.
    others = [{"prompt_token_ids": prompt_ids(n, 10 + n)} for n in (7, 90, 33)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batch = llm_off.generate(others[:2] + [PROMPT] + others[2:],
                             [greedy, SamplingParams(n=3, temperature=0.8, max_tokens=9),
                              SAMPLED, greedy], use_tqdm=False)
    assert samples(batch[2]) == ref
    # Small token budget: chunked prefills and a different batch every step.
    chunked = make_llm(model_dir, caching=False,
                       max_num_batched_tokens=24, max_num_seqs=3)
    assert samples(chunked.generate(others + [PROMPT], [greedy] * 3 + [SAMPLED],
                                    use_tqdm=False)[3]) == ref
    cached = []
    for _ in range(2):  # the second run hits the cache the first one filled
        out = llm_on.generate(PROMPT, SAMPLED, use_tqdm=False)[0]
        assert samples(out) == ref
        cached.append(out.num_cached_tokens)
    assert cached == [0, 32]  # the prompt's 2 full blocks of 40 tokens, once cached
    for llm in (llm_off, llm_on, chunked):
        assert_pool_idle(llm)


def test_each_sample_has_its_own_finish_reason(llm_off) -> None:
    ref = samples(llm_off.generate(PROMPT, SAMPLED, use_tqdm=False)[0])
    # A token that sample 0 draws and sample 1 never does: stops 0 early, lets 1 run to length.
    stop_id = next(t for t in ref[0][1:] if t not in ref[1])
    params = SAMPLED.clone(stop_token_ids=[stop_id])
    out = llm_off.generate(PROMPT, params, use_tqdm=False)[0]
    for i, comp in enumerate(out.outputs):
        assert comp.index == i
        if stop_id in ref[i]:
            cut = ref[i].index(stop_id) + 1
            assert comp.token_ids == ref[i][:cut]
            assert (comp.finish_reason, comp.stop_reason) == ("stop", stop_id)
        else:
            assert comp.token_ids == ref[i]
            assert (comp.finish_reason, comp.stop_reason) == ("length", None)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[1].finish_reason == "length"
    assert_pool_idle(llm_off)


@pytest.mark.parametrize("caching", [False, True])
def test_prompt_blocks_shared_not_copied(model_dir, caching: bool) -> None:
    n, prompt_len, max_tokens = 4, 256, 8
    llm = make_llm(model_dir, caching)
    engine = llm.llm_engine
    kv = engine.engine_core.scheduler.kv_cache_manager
    engine.add_request("g", {"prompt_token_ids": prompt_ids(prompt_len, 2)},
                       SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=max_tokens,
                                      ignore_eos=True))
    prompt_blocks = prompt_len // BLOCK
    child_ids = [f"{i}_g" for i in range(n)]
    used_per_step, outs = [], []
    while engine.has_unfinished_requests():
        outs += engine.step()
        used_per_step.append(kv.block_pool.num_blocks - kv.get_num_free_blocks())
        live = [kv.get_block_ids(c) for c in child_ids if kv.get_block_ids(c)]
        if len(live) == n:
            # Every sibling's table starts with the same physical blocks: all full prompt blocks
            # but the last (its last prompt token is recomputed to get logits).
            shared = live[0][: prompt_blocks - 1]
            assert all(t[: prompt_blocks - 1] == shared for t in live)
    # After the one prefill step: 1x the prompt plus one private block per sibling, not n x.
    assert used_per_step[0] == prompt_blocks + (n - 1)
    # Peak: the shared prompt plus, per sibling, its recomputed last block and one decode block.
    assert max(used_per_step) <= prompt_blocks - 1 + 2 * n < n * prompt_blocks
    final = [o for o in outs if o.finished]
    assert len(final) == 1 and len(final[0].outputs) == n
    assert len({tuple(c.token_ids) for c in final[0].outputs}) == n
    assert_pool_idle(llm)
    pool = kv.block_pool
    if caching:
        assert pool.cached_block_hash_to_block  # the prompt stays cached (free) for later hits
    else:
        # Sibling sharing is private to the group: nothing stays hashed, no later request hits.
        assert not pool.cached_block_hash_to_block
        again = llm.generate({"prompt_token_ids": prompt_ids(prompt_len, 2)},
                             SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
        assert again.num_cached_tokens == 0


def test_num_cached_tokens_is_sample_zeros_whatever_the_output_order(tiny_tokenizer) -> None:
    from pagellm.core.sched_output import EngineCoreOutput
    from pagellm.engine.output_processor import OutputKind, OutputProcessor

    proc = OutputProcessor(tiny_tokenizer)
    params = SamplingParams(n=2, max_tokens=2)
    proc.add_request("r", None, [5, 6, 7], params, ["0_r", "1_r"], OutputKind.CUMULATIVE)
    # Sibling 1 reports first (it hit the blocks sample 0 computed); then sample 0 (no hit).
    first = proc.process_outputs([EngineCoreOutput("1_r", [9], num_cached_tokens=16)])
    second = proc.process_outputs([EngineCoreOutput("0_r", [8], num_cached_tokens=0)])
    assert first.request_outputs[0].num_cached_tokens == 16  # the best known so far
    assert second.request_outputs[0].num_cached_tokens == 0
    last = proc.process_outputs([EngineCoreOutput("1_r", [9], finish_reason="length",
                                                  num_cached_tokens=16),
                                 EngineCoreOutput("0_r", [8], finish_reason="length")])
    final = last.request_outputs[-1]
    assert final.finished and final.num_cached_tokens == 0
    assert [c.token_ids for c in final.outputs] == [[8, 8], [9, 9]]
