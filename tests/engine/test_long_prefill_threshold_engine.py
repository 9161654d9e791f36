"""--long-prefill-token-threshold end to end: greedy outputs are the same with and without the
cap (a tiny random model, float32), the cap makes prompts take more steps, and bad values are
refused naming the flag."""

from __future__ import annotations

import random

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine_args import EngineArgs


def test_greedy_outputs_identical_with_and_without_the_cap(tiny_llama_dir) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for threshold in (0, 8):
        llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB",
                  max_model_len=256, max_num_batched_tokens=64,
                  long_prefill_token_threshold=threshold)
        vocab = llm.llm_engine.config.model.vocab_size
        rng = random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab)
                                         for _ in range(rng.randint(5, 90))]}
                   for _ in range(8)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        core = llm.llm_engine.engine_core
        runs[threshold] = ([o.outputs[0].token_ids for o in outs],
                           core.make_stats().num_steps)
        assert core.scheduler.kv_cache_manager.usage == 0.0
    assert runs[8][0] == runs[0][0]
    assert runs[8][1] > runs[0][1]  # the prompts went in 8-token chunks


@pytest.mark.parametrize("value", [-1, 257])
def test_out_of_range_threshold_is_refused(tiny_llama_dir, value: int) -> None:
    args = EngineArgs(model=str(tiny_llama_dir), max_model_len=256,
                      long_prefill_token_threshold=value)
    with pytest.raises(ValueError, match="--long-prefill-token-threshold"):
        args.create_engine_config()
