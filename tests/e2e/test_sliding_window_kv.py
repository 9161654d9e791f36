"""Sliding-window KV freeing end to end (tiny Gemma 2: 2 sliding + 2 global layers, window 16,
and Mistral: every layer sliding): the engine's greedy tokens equal transformers' past the
window, while the windowed KV cache group holds only about window / block_size blocks of a long
request and the full group grows with it; the pool is whole again at the end."""

from __future__ import annotations

import random

import pytest
import torch
from sliding_window_models import WINDOW, write_sliding_model

from pagellm import LLM, SamplingParams

BLOCK = 16
PROMPT_LEN, NEW = 100, 30


def prompt_ids() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(3, 380) for _ in range(PROMPT_LEN)]


def hf_greedy(path, ids: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    ref.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_windowed_group_frees_blocks_and_tokens_match(tmp_path, arch):
    path = write_sliding_model(tmp_path / arch, arch)
    ids = prompt_ids()
    # Chunks of 32 tokens: the prefill too runs past the window with blocks freed behind it.
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="4MiB", max_model_len=256,
              max_num_batched_tokens=32, enable_prefix_caching=False)
    engine = llm.llm_engine
    kv = engine.engine_core.scheduler.kv_cache_manager
    windows = kv.group_windows
    assert WINDOW in windows
    if arch == "gemma2":
        assert windows == [WINDOW, None] and kv.num_groups == 2
    else:
        assert windows == [WINDOW]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": ids}, params)
    held_window: list[int] = []
    tokens: list[int] = []
    before = 0  # tokens computed when the step allocated: what the freeing went by
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        request = engine.engine_core.scheduler.requests.get("r")
        if request is None:
            break
        computed = request.num_computed_tokens
        held = 0
        for group, window in enumerate(windows):
            table = kv.get_group_blocks("r", group)
            live = sum(b is not kv.null_block for b in table)
            assert len(table) == -(-computed // BLOCK)
            if window is None:
                assert live == len(table)  # the full group keeps every block
            else:
                # Blocks wholly before the window of the step's first query are gone.
                assert live == len(table) - max(before - window + 1, 0) // BLOCK
                held_window.append(live)
            held += live
        before = computed
        assert kv.get_num_free_blocks() == kv.block_pool.num_blocks - held
    assert max(held_window) <= -(-(WINDOW + 32) // BLOCK) + 1  # window + one chunk
    assert held_window[-1] <= WINDOW // BLOCK + 1
    assert tokens == hf_greedy(path, ids)
    kv.block_pool.check_invariants()
    assert kv.get_num_free_blocks() == kv.block_pool.num_blocks
