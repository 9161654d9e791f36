"""`pagellm bench throughput --structured-output json` on the tiny model: both runs complete and
the figures are consistent (no timing assertions)."""

from __future__ import annotations

import argparse

from pagellm.benchmarks.throughput import add_throughput_parser, benchmark_throughput


def test_bench_throughput_structured_json(tiny_path) -> None:
    parser = argparse.ArgumentParser()
    add_throughput_parser(parser.add_subparsers())
    ns = parser.parse_args(["throughput", tiny_path, "--dtype", "float32", "--max-model-len",
                            "256", "--kv-cache-memory", "32MiB", "--num-prompts", "3",
                            "--input-len", "8", "--output-len", "24",
                            "--structured-output", "json"])
    result = benchmark_throughput(ns)
    s = result["structured"]
    assert result["output_tokens"] == 3 * 24
    assert 0 < s["json_output_tokens"] <= 3 * 24
    assert s["json_vs_free_throughput"] > 0
    assert s["compile_cold_ms"] > 0 and s["compile_cached_ms"] >= 0
