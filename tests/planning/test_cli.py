"""`pagellm plan` as a user runs it: table, JSON, exit status, errors naming the flag."""

from __future__ import annotations

import json

import pytest
import torch
from qwen_configs import QWEN25_7B, QWEN25_72B, write_config

from pagellm.entrypoints.cli import main
from pagellm.planning.devices import GPU_MEMORY_MIB, MiB, parse_device

RANK_KEYS = {"weight_bytes", "kv_bytes_per_token", "kv_budget_bytes", "num_blocks",
             "token_capacity", "max_concurrency", "fits"}


def test_json_per_rank_and_exit_status(tmp_path, capsys):
    model = write_config(tmp_path / "Qwen2.5-72B-Instruct", QWEN25_72B)
    assert main(["plan", model, "--dtype", "float16", "-tp", "2", "--device", "h100",
                 "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    for rank in out["ranks"]:
        assert RANK_KEYS <= set(rank)
        assert rank["fits"] is False
        assert rank["num_blocks"] == rank["kv_budget_bytes"] // (16 * rank["kv_bytes_per_token"])
        assert rank["token_capacity"] == 16 * rank["num_blocks"]
        assert rank["max_concurrency"] == round(rank["num_blocks"] / (32768 // 16), 3)
    assert out["fits"] is False
    assert out["device"]["total_bytes"] == GPU_MEMORY_MIB["h100"][0] * MiB
    flags = [s["flags"] for s in out["suggestions"]]
    assert "--tensor-parallel-size 4" in flags and "--quantization int8" in flags
    assert all(s["fits"] for s in out["suggestions"])
    # The same plan with int8 weights (a what-if) fits.
    assert main(["plan", model, "--dtype", "float16", "-tp", "2", "--device", "h100",
                 "--quantization", "int8", "--json"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert int8["ranks"][0]["weight_bytes"] < out["ranks"][0]["weight_bytes"] * 0.52
    assert any("what-if" in w for w in int8["warnings"])


def test_table_names_the_fixes(tmp_path, capsys):
    model = write_config(tmp_path / "Qwen2.5-72B-Instruct", QWEN25_72B)
    assert main(["plan", model, "--dtype", "float16", "-tp", "2", "--device", "80GiB"]) == 1
    text = capsys.readouterr().out
    assert "target: 80GiB (a GPU with 80GiB) x 2, dtype float16" in text
    assert "status" in text and "does not fit" in text
    assert "nearest settings that fit:" in text
    assert "--tensor-parallel-size 4" in text and "--quantization int8" in text


def test_bare_config_file_and_fitting_plan(tmp_path, capsys):
    path = tmp_path / "qwen7b.json"
    path.write_text(json.dumps(QWEN25_7B))
    assert main(["plan", str(path), "--dtype", "float16", "--device", "h100",
                 "--max-model-len", "8192"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("pagellm plan: qwen7b (Qwen2ForCausalLM, 7.62B parameters")
    assert "max concurrency @ 8192" in text and "nearest settings" not in text


def test_dtype_auto_follows_the_engine_on_cuda(tmp_path, capsys):
    model = write_config(tmp_path / "q7", QWEN25_7B)  # torch_dtype bfloat16
    assert main(["plan", model, "--device", "l4", "--max-model-len", "4096", "--json"]) in (0, 1)
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["dtype"] == "bfloat16"
    assert out["ranks"][0]["kv_bytes_per_token"] == 2 * 28 * 4 * 128 * 2


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "tpu"], "--device 'tpu': use cpu, cuda[:N], a GPU name"),
    (["-tp", "3"], "--tensor-parallel-size 3 cannot split this model"),
    (["--max-model-len", "65536"], "--max-model-len 65536 is larger than the model's context"),
    (["--block-size", "12"], "--block-size must be one of"),
    (["--max-num-seqs", "512", "--max-num-batched-tokens", "256"],
     "--max-num-batched-tokens (256) must be >= --max-num-seqs (512)"),
])
def test_errors_name_the_flag(tmp_path, capsys, argv, message):
    model = write_config(tmp_path / "q7", QWEN25_7B)
    assert main(["plan", model, "--device", "h100", *argv]) == 2
    assert message in capsys.readouterr().err


def test_parse_device():
    assert parse_device("H200").total_bytes == 143771 * MiB
    assert parse_device("24GB").total_bytes == 24 * 10**9
    assert parse_device("cpu").kind == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device on this machine"):
            parse_device("cuda")


@pytest.mark.parametrize("flags", [
    {}, {"max_num_batched_tokens": 64}, {"max_num_seqs": 8, "max_model_len": 128, "block_size": 32},
    {"dtype": "float32", "kv_cache_memory": "3MiB"},
])
def test_settings_equal_the_engine_config(tiny_llama_dir, flags):
    from pagellm.engine_args import EngineArgs
    from pagellm.planning.model_spec import ModelSpec
    from pagellm.planning.planner import plan_from_args

    args = EngineArgs(model=str(tiny_llama_dir), device="cpu", **flags)
    config = args.create_engine_config()
    report = plan_from_args(args, "cpu")
    s = report.settings
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len, s.block_size,
            s.kv_cache_memory, s.dtype) == (
        config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
        config.model.max_model_len, config.cache.block_size, config.cache.kv_cache_memory,
        str(config.model.dtype).removeprefix("torch."))
    assert report.spec == ModelSpec.from_hf_config(config.model.hf_config, report.spec.name,
                                                   report.spec.checkpoint_format,
                                                   report.spec.checkpoint_bytes)
