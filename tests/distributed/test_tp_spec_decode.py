"""N-gram speculative decoding with tensor_parallel_size=2: rank 0 verifies and proposes, the
emitted tokens are broadcast and the drafts reach rank 1 through the schedule; greedy tokens and
logprobs equal the one-rank engine without speculation, under chunked prefill and preemption."""

from __future__ import annotations

import random

import pytest
from tp_utils import run, tp1_llm, tp2_llm

from pagellm import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": None}


def _repetitive_prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 300) for _ in range(rng.randint(4, 10))]
        out.append({"prompt_token_ids": phrase * rng.randint(2, 4)})
    return out


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    path = tiny_model_dir("llama")
    tp1, tp2 = tp1_llm(path), tp2_llm(path, speculative_config=SPEC)
    yield tp1, tp2
    tp2.llm_engine.shutdown()


def test_greedy_tokens_and_logprobs_match_tp1(engines) -> None:
    tp1, tp2 = engines
    ps = _repetitive_prompts(8, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    want, got = run(tp1, ps, params), run(tp2, ps, params)
    for w, g in zip(want, got, strict=True):
        wc, gc = w.outputs[0], g.outputs[0]
        assert gc.token_ids == wc.token_ids
        for tok, we, ge in zip(wc.token_ids, wc.logprobs, gc.logprobs, strict=True):
            assert ge[tok].logprob == pytest.approx(we[tok].logprob, abs=1e-4)
    stats = tp2.llm_engine.engine_core.make_stats()
    assert stats.num_preemptions > 0 and stats.spec_decoding.num_accepted_tokens > 0
