"""The CUDA-graph decode path with the Triton backend (the one the engine graphs on a GPU), its
padded static buffers run eagerly under TRITON_INTERPRET=1 on CPU: the same greedy tokens as the
normal eager path, through exact and padded buckets."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
pytest.importorskip("triton")

from graph_helpers import (  # noqa: E402
    assert_no_host_syncs,
    assert_same_decoding,
    check_padded_step,
)

from pagellm import LLM  # noqa: E402


@pytest.fixture(scope="module")
def triton_llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="8MiB",
               max_model_len=256, max_num_seqs=8, attention_backend="triton")


def test_padded_decode_matches_eager_triton_backend(triton_llm) -> None:
    graphs = assert_same_decoding(triton_llm, n=6)
    # Decode steps of 6..1 sequences: buckets 8 (padded), 4 (exact and padded), 2, 1.
    assert set(graphs.num_steps) == {1, 2, 4, 8}
    assert graphs.num_steps[8] >= 2 and graphs.num_steps[4] >= 2


@pytest.mark.parametrize("bucket_sizes", [[1, 2, 4, 8], [3]])
def test_padded_triton_step_writes_only_real_slots_and_scratch(triton_llm, bucket_sizes) -> None:
    check_padded_step(triton_llm.llm_engine.engine_core.executor.runner, bucket_sizes)


def test_triton_captured_region_has_no_host_syncs(triton_llm) -> None:
    assert_no_host_syncs(triton_llm, size=8)
