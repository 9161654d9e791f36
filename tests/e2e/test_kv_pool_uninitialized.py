"""The KV pool is allocated uninitialized: the torch backend needs every block zeroed when it is
handed out; the CPU kernels never read a slot no token was written to, so there the runner skips
the zeroing.

A pool poisoned with NaN (what uninitialized memory may hold) must give exactly the outputs of a
fresh one, for both attention backends, with chunked prefill, prefix-cache hits and block reuse
(more requests than the pool holds at once)."""

from __future__ import annotations

import random

import pytest
import torch

from pagellm import LLM, SamplingParams


def _run(path, backend: str, poison: bool, dtype: str = "float32") -> list[list[int]]:
    llm = LLM(model=str(path), dtype=dtype, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=32, num_gpu_blocks_override=24, block_size=16,
              enable_prefix_caching=True, attention_backend=backend)
    runner = llm.llm_engine.engine_core.executor.runner
    # The CPU kernels (built in CI) read only written slots: no zeroing, poison stays put.
    assert runner.zero_new_blocks == (backend == "torch")
    num_blocks = runner.num_blocks
    for k, v in runner.kv_caches:
        assert torch.count_nonzero(k[num_blocks:]) == 0  # null and scratch blocks are zero
        if poison:
            k[:num_blocks].fill_(float("nan"))
            v[:num_blocks].fill_(float("nan"))
    rng = random.Random(0)
    vocab = llm.llm_engine.config.model.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [{"prompt_token_ids": (shared if i % 2 else []) +
                [rng.randrange(3, vocab) for _ in range(rng.randint(5, 60))]} for i in range(10)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def llama_hd32_dir(tmp_path_factory, make_tiny_model):
    """head_dim 32: the AMX paths (prefill kernel, decode tile scores, fused decode) run."""
    return make_tiny_model(tmp_path_factory.mktemp("llama_hd32"), "llama", hidden_size=128,
                           intermediate_size=256)


@pytest.mark.parametrize(("backend", "dtype", "model"),
                         [("cpu", "float32", "hd16"), ("cpu", "bfloat16", "hd16"),
                          ("cpu", "bfloat16", "hd32"), ("torch", "float32", "hd16")])
def test_nan_poisoned_pool_gives_identical_outputs(request, backend, dtype, model):
    path = request.getfixturevalue("tiny_llama_dir" if model == "hd16" else "llama_hd32_dir")
    assert _run(path, backend, True, dtype) == _run(path, backend, False, dtype)
