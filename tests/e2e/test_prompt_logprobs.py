"""SamplingParams.prompt_logprobs through the offline LLM on a tiny random Llama, against
transformers on the same weights (float32 forward, log_softmax in float64): whole and chunked
prefill, a warm prefix cache, mixed with ordinary requests (whose outputs stay the same),
n > 1 and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from pagellm import LLM, SamplingParams

TOL = 1e-4  # float32 engine vs float32 transformers, compared in float64
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def reference(tiny_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab]: row i is the distribution of token i + 1 given ids[:i + 1]."""
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.double(), dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def llm_whole(tiny_path) -> LLM:
    return LLM(model=tiny_path, dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
               enable_prefix_caching=True)


@pytest.fixture(scope="module")
def llm_chunked(tiny_path) -> LLM:
    # 16-token steps: every prompt here longer than that is prefilled over several steps.
    return LLM(model=tiny_path, dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
               max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)


def assert_matches_reference(prompt_logprobs, ids: list[int], ref: torch.Tensor,
                             k: int) -> None:
    """vLLM's shape and transformers' values: None first, then per token its own logprob and
    rank plus the top-k (ties within TOL may order either way)."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry, row, tok = prompt_logprobs[i], ref[i - 1], ids[i]
        assert entry is not None and tok in entry
        own = entry[tok]
        assert abs(own.logprob - row[tok].item()) < TOL, (i, own, row[tok].item())
        above = int((row > row[tok] + TOL).sum())
        assert above + 1 <= own.rank <= int((row > row[tok] - TOL).sum()) + 1
        top = sorted((lp for t, lp in entry.items() if t != tok or lp.rank <= k),
                     key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == list(range(1, k + 1))
        expected = row.topk(k).values.tolist()
        for lp, value in zip(top, expected, strict=True):
            assert abs(lp.logprob - value) < TOL
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < TOL
            assert lp.decoded_token is not None


@pytest.mark.parametrize("engine", ["llm_whole", "llm_chunked"])
def test_prompt_logprobs_match_transformers(request, engine, reference) -> None:
    llm: LLM = request.getfixturevalue(engine)
    prompts = _prompts(1, [1, 2, 15, 16, 17, 45])
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs, strict=True):
        assert_matches_reference(out.prompt_logprobs, ids, reference(ids), 3)
        assert len(out.outputs[0].token_ids) == 3
    # Asked for nothing: nothing given.
    (plain,) = llm.generate([{"prompt_token_ids": prompts[2]}], GREEDY, use_tqdm=False)
    assert plain.prompt_logprobs is None


def test_warm_prefix_cache_does_not_skip_the_scores(llm_chunked, reference) -> None:
    (ids,) = _prompts(2, [70])
    warm = llm_chunked.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    again = llm_chunked.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens == 64  # the cache is warm: 4 full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    (scored,) = llm_chunked.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    assert scored.num_cached_tokens == 0  # computed whole, for its logits
    assert_matches_reference(scored.prompt_logprobs, ids, reference(ids), 1)
    # The same greedy tokens and sampled-token logprobs as with the cache.
    assert scored.outputs[0].token_ids == warm[0].outputs[0].token_ids
    for a, b in zip(scored.outputs[0].logprobs, warm[0].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < TOL for t in a)


def test_ordinary_requests_unchanged_beside_scored_ones(llm_chunked, reference) -> None:
    ordinary = _prompts(3, [9, 33, 21])
    scored = _prompts(4, [40, 5, 26])
    alone = llm_chunked.generate([{"prompt_token_ids": p} for p in ordinary], GREEDY,
                                 use_tqdm=False)
    score = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    mixed_prompts = [{"prompt_token_ids": p} for pair in zip(ordinary, scored, strict=True)
                     for p in pair]
    mixed = llm_chunked.generate(mixed_prompts, [GREEDY, score] * 3, use_tqdm=False)
    for a, b in zip(alone, mixed[0::2], strict=True):
        assert b.prompt_logprobs is None
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < TOL for t in x)
    for ids, out in zip(scored, mixed[1::2], strict=True):
        assert_matches_reference(out.prompt_logprobs, ids, reference(ids), 2)


def test_n_samples_share_one_scored_prompt(llm_whole, reference) -> None:
    (ids,) = _prompts(5, [30])
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True,
                            prompt_logprobs=2)
    (out,) = llm_whole.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in out.outputs)
    assert_matches_reference(out.prompt_logprobs, ids, reference(ids), 2)
    sched = llm_whole.llm_engine.engine_core.scheduler
    assert sched.kv_cache_manager.usage == 0.0


def test_scores_survive_preemption(tiny_path, reference) -> None:
    # As test_tiny_engine: 48-token steps chunk the prompts and 24 blocks of 16 cannot hold
    # them all, so requests are preempted mid-prefill and their prompts scored again.
    tight = LLM(model=tiny_path, dtype="float32", max_model_len=256, max_num_seqs=16,
                max_num_batched_tokens=48, num_gpu_blocks_override=24)
    prompts = _prompts(6, [60, 75, 50, 90, 66, 80, 70, 55])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core = tight.llm_engine.engine_core
    assert core.make_stats().num_preemptions > 0
    for ids, out in zip(prompts, outs, strict=True):
        assert_matches_reference(out.prompt_logprobs, ids, reference(ids), 1)
    assert core.scheduler.kv_cache_manager.usage == 0.0
    core.scheduler.kv_cache_manager.block_pool.check_invariants()
