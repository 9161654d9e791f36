"""`pagellm plan` with --kv-cache-dtype: bytes per token by hand (8-bit values, int8's bfloat16
scale per token and kv head), token capacity at least 1.9x bf16's for the 8-bit dtypes, the
suggestion that names the KV dtype when it is what makes a context fit, and the refusal."""

from __future__ import annotations

import pytest
from qwen_configs import QWEN25_7B, QWEN25_72B, write_config

from pagellm.engine_args import EngineArgs
from pagellm.planning.planner import plan_from_args
from pagellm.planning.recommend import suggest
from pagellm.planning.report import format_report


@pytest.mark.parametrize("kv,per_token", [
    ("auto", 2 * 28 * 4 * 128 * 2),
    ("fp8", 2 * 28 * 4 * 128),
    ("fp8_e5m2", 2 * 28 * 4 * 128),
    ("int8_per_token_head", 2 * 28 * 4 * (128 + 2)),
])
def test_bytes_per_token_and_capacity(tmp_path, kv, per_token):
    model = write_config(tmp_path / "Qwen2.5-7B-Instruct", QWEN25_7B)

    def plan(kv_dtype: str):
        args = EngineArgs(model=model, dtype="bfloat16", max_model_len=8192,
                          kv_cache_dtype=kv_dtype)
        return plan_from_args(args, "h100").ranks[0].kv

    got, bf16 = plan(kv), plan("auto")
    assert got.kv_bytes_per_token == per_token
    assert got.num_blocks == got.kv_budget_bytes // (per_token * 16)
    if kv != "auto":
        assert got.token_capacity >= 1.9 * bf16.token_capacity


def test_suggestion_names_the_kv_dtype(tmp_path):
    model = write_config(tmp_path / "Qwen2.5-72B-Instruct", QWEN25_72B)
    # The model's own 32k context does not fit in fp16 KV; in int8 it does.
    report = plan_from_args(EngineArgs(model=model, dtype="float16", tensor_parallel_size=2),
                            "h100")
    rank = report.ranks[0]
    assert not report.fits
    fixes = {x.flags: x for x in suggest(report.spec, report.device, report.settings, rank)}
    fix = fixes["--kv-cache-dtype int8_per_token_head"]
    assert fix.fits and fix.token_capacity > 1.9 * rank.kv.token_capacity
    assert "KV cache dtype auto" in format_report(report)
    # Already 8-bit: no KV dtype suggestion.
    report8 = plan_from_args(EngineArgs(model=model, dtype="float16", tensor_parallel_size=2,
                                        max_model_len=32768, kv_cache_dtype="fp8"), "h100")
    rank8 = report8.ranks[0]
    flags = [x.flags for x in suggest(report8.spec, report8.device, report8.settings, rank8)]
    assert not any(f.startswith("--kv-cache-dtype") for f in flags)


def test_bad_kv_dtype_refused(tmp_path):
    model = write_config(tmp_path / "Qwen2.5-7B-Instruct", QWEN25_7B)
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        plan_from_args(EngineArgs(model=model, kv_cache_dtype="int4"), "h100")
