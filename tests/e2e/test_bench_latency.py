"""``pagellm bench latency`` on a tiny random model: counts and consistency, never wall-clock."""

from __future__ import annotations

import json

import pytest
import torch

from pagellm.benchmarks.latency import decode_weight_bytes, measure_read_bandwidth
from pagellm.entrypoints.cli import main

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-model-len", "256"]


def test_latency_json_is_consistent(tiny_llama_dir, tmp_path, capsys) -> None:
    path = tmp_path / "lat.json"
    batch, in_len, out_len, iters = 3, 20, 6, 4
    assert main(["bench", "latency", str(tiny_llama_dir), *ENGINE, "--input-len", str(in_len),
                 "--output-len", str(out_len), "--batch-size", str(batch),
                 "--num-iters-warmup", "1", "--num-iters", str(iters), "--bandwidth-mib", "32",
                 "--output-json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert (r["batch_size"], r["input_len"], r["output_len"]) == (batch, in_len, out_len)
    assert len(r["latencies_s"]) == iters and r["num_iters"] == iters
    # Every request generated exactly output_len tokens (ignore_eos), all prompts in one step
    # (3 x 20 tokens fit the default budget), then one token per request per decode step.
    assert r["num_output_tokens"] == [batch * out_len] * iters
    assert r["num_decode_steps"] == [out_len - 1] * iters
    assert r["num_steps"] == [out_len] * iters
    for key in ("first_output_ms", "prefill_ms", "decode_ms_per_step"):
        s = r[key]
        assert 0 < s["p10"] <= s["p50"] <= s["p90"] <= s["p99"], key
    lat = r["latency_s"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= max(r["latencies_s"])
    assert r["avg_latency_s"] == pytest.approx(sum(r["latencies_s"]) / iters)
    # The parts add up: prefill + decode steps make the whole batch latency.
    assert r["first_output_ms"]["avg"] <= r["prefill_ms"]["avg"] < lat["avg"] * 1e3
    steps_ms = r["decode_ms_per_step"]["avg"] * (out_len - 1)
    assert r["prefill_ms"]["avg"] + steps_ms == pytest.approx(lat["avg"] * 1e3, rel=1e-6)
    # The floor is bytes / bandwidth, and the ratio is decode time over it.
    assert r["read_bandwidth_gb_s"] > 0
    floor = r["decode_weight_bytes_per_step"] / (r["read_bandwidth_gb_s"] * 1e9) * 1e3
    assert r["decode_floor_ms_per_step"] == pytest.approx(floor)
    assert r["decode_vs_floor"] == pytest.approx(r["decode_ms_per_step"]["avg"] / floor)
    out = capsys.readouterr().out
    assert "Decode per token (ms):" in out and f"batch-{batch} decode" in out


@pytest.mark.parametrize("arch", ["llama", "llama-tied"])
def test_weight_bytes_match_the_checkpoint(tiny_model_dir, arch) -> None:
    """Against the HF model built independently from the same folder: an untied input
    embedding is only gathered, a tied one is read whole as the LM head."""
    from transformers import AutoModelForCausalLM

    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.entrypoints.cli import build_parser
    from pagellm.entrypoints.cli_args import engine_args_from

    model_dir = tiny_model_dir(arch)
    ns = build_parser().parse_args(["bench", "latency", str(model_dir), *ENGINE])
    engine = LLMEngine.from_engine_args(engine_args_from(ns))
    total, per_step = decode_weight_bytes(engine.engine_core.executor.runner.model)
    engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_total = sum(p.numel() * 4 for p in hf.parameters())
    embed = hf.get_input_embeddings().weight
    tied = hf.get_output_embeddings().weight is embed
    assert total == hf_total
    assert tied == (arch == "llama-tied")
    assert per_step == hf_total - (0 if tied else embed.numel() * 4)


def test_bandwidth_and_bad_flags(tiny_llama_dir, capsys) -> None:
    assert measure_read_bandwidth("cpu", 8, repeats=2) > 0
    assert main(["bench", "latency", str(tiny_llama_dir), *ENGINE, "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1" in capsys.readouterr().err
    assert main(["bench", "latency", str(tiny_llama_dir), *ENGINE, "--input-len", "250",
                 "--output-len", "10"]) == 2
    assert "--max-model-len" in capsys.readouterr().err
