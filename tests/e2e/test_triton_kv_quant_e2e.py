"""End to end with an 8-bit KV cache on the Triton backend (TRITON_INTERPRET=1 on CPU): the
same greedy tokens as the torch backend with the same --kv-cache-dtype, through chunked prefill
and decode."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
pytest.importorskip("triton")

from pagellm import LLM, SamplingParams  # noqa: E402


@pytest.mark.parametrize("kv", ["int8_per_token_head", "fp8"])
def test_triton_matches_torch_with_8bit_kv(tiny_model_dir, kv) -> None:
    path = str(tiny_model_dir("llama"))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=path, dtype="float32", kv_cache_memory="8MiB", max_model_len=256,
                  max_num_batched_tokens=32, attention_backend=backend, kv_cache_dtype=kv)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[backend] = [o.outputs[0].token_ids for o in outs]
    assert results["triton"] == results["torch"]
