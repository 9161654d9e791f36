"""EngineArgs validation and KV sizing arithmetic (no model weights loaded)."""

from __future__ import annotations

import pytest

from pagellm.config import parse_size
from pagellm.engine_args import EngineArgs
from pagellm.memory_plan import check_fits, kv_bytes_per_token, plan_kv_cache


@pytest.mark.parametrize("text,expect", [
    ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("2G", 2 << 30), ("1.5GB", 1_500_000_000),
    ("1024", 1024), (2048, 2048), (None, None),
])
def test_parse_size(text, expect) -> None:
    assert parse_size(text) == expect


@pytest.mark.parametrize("text", ["lots", "-1GiB", "0"])
def test_parse_size_rejects(text) -> None:
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        parse_size(text)


def test_default_model_kv_bytes_per_token() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64 -> 2*30*3*64 = 11,520 values per token.
    assert kv_bytes_per_token(30, 3, 64, 4) == 46_080
    assert kv_bytes_per_token(30, 3, 64, 2) == 23_040
    # K/V heads split across TP ranks; replicated when there are fewer heads than ranks.
    assert kv_bytes_per_token(30, 4, 64, 2, tp_size=2) == 2 * 30 * 2 * 64 * 2
    assert kv_bytes_per_token(30, 2, 64, 2, tp_size=4) == 2 * 30 * 1 * 64 * 2


def test_plan_and_fit_error_give_numbers_and_fix() -> None:
    plan = plan_kv_cache(100 * 46_080 * 16, 46_080, 16, max_model_len=4096)
    assert plan.num_blocks == 100 and plan.token_capacity == 1600
    assert not plan.fits
    with pytest.raises(ValueError, match=r"--max-model-len 4096.*1600 tokens.*--kv-cache-memory"):
        check_fits(plan, "--kv-cache-memory")
    ok = plan_kv_cache(100 * 46_080 * 16, 46_080, 16, max_model_len=800)
    assert ok.fits and ok.max_concurrency == pytest.approx(2.0)


@pytest.mark.parametrize("kwargs,flag", [
    ({"block_size": 7}, "--block-size"),
    ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
    ({"tensor_parallel_size": 0}, "--tensor-parallel-size"),
    ({"load_format": "pickle"}, "--load-format"),
    ({"dtype": "int3"}, "--dtype"),
    ({"max_model_len": 10**6}, "--max-model-len"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "--max-num-batched-tokens"),
    ({"model": "/nonexistent/model"}, "model"),
    ({"device": "tpu"}, "--device"),
])
def test_bad_engine_args_name_the_flag(kwargs, flag) -> None:
    with pytest.raises(ValueError, match=flag):
        EngineArgs(**kwargs).create_engine_config()
