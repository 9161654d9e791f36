"""The whole engine on tiny Mamba-2 hybrids (Granite 4, Nemotron-H): greedy tokens against
transformers' generate, invariance under batching, chunked prefill and preemption (the conv
window and SSM state recomputed from tokens), state slots all back at idle."""

from __future__ import annotations

import random

import pytest
import torch

from pagellm import LLM, SamplingParams

ARCHS = ["granite4", "nemotron-h"]


def _prompts(n: int, vocab: int, seed: int, lo: int = 3, hi: int = 90) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]}
            for _ in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model_dir, arch) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
              max_num_batched_tokens=64)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(4, llm.llm_engine.config.model.vocab_size, seed=1, lo=20, hi=150)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, got in zip(prompts, _tokens(outs), strict=True):
        ids = torch.tensor([p["prompt_token_ids"]])
        with torch.no_grad():
            expect = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == expect[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_invariance_under_chunking_and_preemption(tiny_model_dir, arch) -> None:
    path = str(tiny_model_dir(arch))
    roomy = LLM(model=path, dtype="float32", kv_cache_memory="32MiB", max_model_len=256)
    prompts = _prompts(16, roomy.llm_engine.config.model.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = [_tokens(roomy.generate(p, params, use_tqdm=False))[0] for p in prompts]
    # A 40-token budget chunks most prompts; 24 blocks of 16 tokens cannot hold 16 requests of
    # ~65 tokens at once, so the scheduler preempts and the state is recomputed from tokens.
    tight = LLM(model=path, dtype="float32", max_model_len=256, max_num_seqs=16,
                max_num_batched_tokens=40, num_gpu_blocks_override=24)
    together = _tokens(tight.generate(prompts, params, use_tqdm=False))
    core = tight.llm_engine.engine_core
    assert core.make_stats().num_preemptions > 0
    assert together == alone
    kv = core.scheduler.kv_cache_manager
    assert kv.usage == 0.0
    assert kv.state_slots is not None and kv.state_slots.num_free == kv.state_slots.num_slots
