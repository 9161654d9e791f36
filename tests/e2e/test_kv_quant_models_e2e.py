"""8-bit KV caches (--kv-cache-dtype) with sliding-window KV cache groups and with a draft
model: the cpu backend against the torch reference (same KV dtype) on tiny Gemma 2 / Mistral
(windowed groups, blocks freed behind the window), and speculative decoding whose draft cache
takes the same KV dtype giving the plain engine's greedy tokens."""

from __future__ import annotations

import random

import pytest
from sliding_window_models import write_sliding_model

from pagellm import LLM, SamplingParams
from pagellm.kernels import cpu_ops

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _prompts(n: int, seed: int, lo: int = 20, hi: int = 100) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(rng.randint(lo, hi))]}
            for _ in range(n)]


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler")
@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_windowed_groups_cpu_matches_torch(tmp_path, arch) -> None:
    path = str(write_sliding_model(tmp_path / arch, arch))
    prompts = _prompts(3, seed=4)
    results = {}
    for backend in ("cpu", "torch"):
        llm = LLM(model=path, dtype="float32", kv_cache_memory="4MiB", max_model_len=256,
                  max_num_batched_tokens=32, attention_backend=backend,
                  kv_cache_dtype="int8_per_token_head")
        runner = llm.llm_engine.engine_core.executor.runner
        assert runner.kv_quant is not None and runner.kv_quant[0].k_scales is not None
        results[backend] = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert results["cpu"] == results["torch"]


def test_draft_cache_takes_the_kv_dtype(tiny_model_dir) -> None:
    path = str(tiny_model_dir("llama"))
    engine = dict(dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
                  kv_cache_dtype="int8_per_token_head")
    plain = LLM(model=path, **engine)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
            "disable_by_batch_size": None}
    llm = LLM(model=path, speculative_config=spec, **engine)
    proposer = llm.llm_engine.engine_core.executor.runner.spec_decode.proposer
    assert proposer.kv_caches[0][0].element_size() == 1 and proposer.kv_quant is not None
    prompts = _prompts(4, seed=5, hi=60)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == \
        _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    stats = llm.llm_engine.engine_core.make_stats().spec_decoding
    # The same weights and the same quantized K/V: the drafts are the target's tokens.
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0, stats
