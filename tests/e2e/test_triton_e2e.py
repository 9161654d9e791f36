"""End to end with the Triton attention backend (under TRITON_INTERPRET=1 on CPU): the same
greedy tokens as the torch backend on a tiny model, through chunked prefill and decode."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
pytest.importorskip("triton")

from pagellm import LLM, SamplingParams  # noqa: E402


def test_triton_backend_matches_torch_backend(tiny_model_dir) -> None:
    path = str(tiny_model_dir("llama"))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=path, dtype="float32", kv_cache_memory="8MiB", max_model_len=256,
                  max_num_batched_tokens=32, attention_backend=backend)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[backend] = [o.outputs[0].token_ids for o in outs]
    assert results["triton"] == results["torch"]
