"""Decode steps through the CUDA-graph path's padded static buffers, run eagerly on CPU.

Real capture and replay need a GPU (scripts/gpu_check.py); here ``GraphRunner`` runs with
``use_cuda_graphs=False``, so a step executes the same function on the same padded buffers a graph
would replay. Checked against the engine's normal eager path: identical greedy tokens (and
logprobs) for batch sizes that hit buckets exactly and that need padding, KV blocks of real
sequences untouched by padding rows, finite outputs over a NaN-filled cache, no host syncs in the
captured region.
"""

from __future__ import annotations

import pytest
import torch
from graph_helpers import Step, assert_no_host_syncs, assert_same_decoding, check_padded_step

from pagellm import LLM
from pagellm.engine_args import EngineArgs
from pagellm.worker.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    GraphRunner,
    bucket_for,
    capture_sizes,
    estimate_graph_memory,
    graphs_off_reason,
)


def test_capture_sizes_follow_vllm_buckets() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]  # max_num_seqs is always a bucket
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    big = capture_sizes(256)
    assert big[:5] == [1, 2, 4, 8, 16] and big[-1] == 256 and len(big) == 3 + 256 // 8
    assert capture_sizes(4096)[-1] == MAX_CAPTURE_SIZE
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_bucket_for_picks_the_smallest_bucket_that_fits() -> None:
    sizes = capture_sizes(20)  # [1, 2, 4, 8, 16, 20]
    expect = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 20, 20: 20, 21: None}
    assert {n: bucket_for(sizes, n) for n in expect} == expect


def test_graph_memory_estimate_scales_the_profiled_peak() -> None:
    # 2048 profiled tokens took 1 GiB: the 256-row bucket needs an eighth, plus per-graph state.
    sizes = capture_sizes(256)
    est = estimate_graph_memory(1 << 30, 2048, sizes)
    assert est == (1 << 27) + len(sizes) * (2 << 20)
    assert estimate_graph_memory(1 << 30, 2048, []) == 0


def test_graphs_are_off_on_cpu_and_with_enforce_eager(tiny_llama_dir) -> None:
    base = dict(model=str(tiny_llama_dir), device="cpu", kv_cache_memory="8MiB",
                max_model_len=256)
    cpu = EngineArgs(**base).create_engine_config()
    assert "CUDA device" in graphs_off_reason(cpu, tp_size=1)
    eager = EngineArgs(**base, enforce_eager=True).create_engine_config()
    assert graphs_off_reason(eager, tp_size=1) == "--enforce-eager"


# ---- the engine: padded path vs eager path ---------------------------------------------------

@pytest.fixture(scope="module")
def torch_llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="8MiB",
               max_model_len=256, max_num_seqs=12, attention_backend="torch")


def test_padded_decode_matches_eager_torch_backend(torch_llm) -> None:
    graphs = assert_same_decoding(torch_llm, n=11)
    # Decode steps of 11..1 sequences: exact buckets (8, 4, 2, 1) and padded ones (12, 8, 4).
    assert set(graphs.num_steps) == {1, 2, 4, 8, 12}
    assert graphs.num_steps[12] >= 3 and graphs.num_steps[8] >= 4 and graphs.num_steps[4] >= 2


# ---- one padded step against the unpadded forward, cache by cache --------------------------

@pytest.mark.parametrize("bucket_sizes", [[1, 2, 4, 8], [3]])
def test_padded_step_writes_only_real_slots_and_scratch(torch_llm, bucket_sizes) -> None:
    check_padded_step(torch_llm.llm_engine.engine_core.executor.runner, bucket_sizes)


def test_stale_rows_of_a_larger_step_become_padding(torch_llm) -> None:
    runner = torch_llm.llm_engine.engine_core.executor.runner
    cfg = runner.config
    big = Step(runner, (3, 9, 20, 33, 47), seed=2)
    small = Step(runner, (6, 21, 50), seed=3)
    kv = big.clone_kv()
    graphs = GraphRunner(
        runner.model, kv, [4, 8], max_model_len=cfg.scheduler.max_model_len,
        block_size=cfg.cache.block_size, null_block_id=runner.num_blocks,
        scratch_block_id=runner.num_blocks + 1, hidden_size=cfg.model.hf_config.hidden_size,
        dtype=runner.dtype, device=runner.device, use_cuda_graphs=False)
    with torch.inference_mode():
        graphs.run(big.input_ids, big.positions, big.meta)  # rows 0-4 real, 5-7 padding
        graphs.run(small.input_ids, small.positions, small.meta)  # bucket 4: row 3 was real
    pad_slot = (runner.num_blocks + 1) * cfg.cache.block_size
    assert graphs.slot_mapping[3].item() == pad_slot
    assert graphs.seq_lens[3].item() == 1 and graphs.positions[3].item() == 0
    assert (graphs.block_tables[3] == runner.num_blocks).all()
    # Columns past the small step's tables no longer hold the big step's block ids.
    width = small.meta.block_tables.shape[1]
    assert (graphs.block_tables[:3, width:] == runner.num_blocks).all()


def test_captured_region_has_no_host_syncs(torch_llm) -> None:
    # The torch backend is capture-safe below 16 sequences (it buckets lengths on the host above
    # that, which is why the engine graphs only the triton backend).
    assert_no_host_syncs(torch_llm, size=8)
