"""Penalties and logit bias kept in the runner's persistent batch survive batching, chunked
prefill and preemption (a resumed request re-enters with its output so far): the same greedy
tokens as each request alone."""

from __future__ import annotations

import random

from pagellm import LLM, SamplingParams


def test_penalized_requests_batch_invariant_under_preemption(tiny_model_dir) -> None:
    path = str(tiny_model_dir("llama"))
    roomy = LLM(model=path, dtype="float32", kv_cache_memory="32MiB", max_model_len=256)
    vocab = roomy.llm_engine.config.model.vocab_size
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(20, 90))]}
               for _ in range(16)]
    params = []
    for i in range(16):
        kind = i % 4
        params.append(SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True,
            repetition_penalty=1.3 if kind in (0, 3) else 1.0,
            frequency_penalty=0.8 if kind in (1, 3) else 0.0,
            presence_penalty=0.6 if kind == 1 else 0.0,
            logit_bias={rng.randrange(vocab): 8.0 for _ in range(3)} if kind == 2 else None))
    alone = [roomy.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(prompts, params, strict=True)]
    # As test_tiny_engine: a 48-token budget chunks prompts, 40 blocks force preemptions.
    tight = LLM(model=path, dtype="float32", max_model_len=256, max_num_seqs=16,
                max_num_batched_tokens=48, num_gpu_blocks_override=40)
    together = [o.outputs[0].token_ids
                for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.engine_core.make_stats().num_preemptions > 0
    assert together == alone
