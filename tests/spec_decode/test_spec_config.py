"""``--speculative-config``: vLLM's keys, defaults and checks; errors name the key and the flag."""

from __future__ import annotations

import argparse

import pytest

from pagellm.engine_args import EngineArgs
from pagellm.spec_decode.config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    SpeculativeConfig,
    parse_speculative_config,
)


def test_ngram_defaults_follow_vllm() -> None:
    both = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert both == SpeculativeConfig("ngram", 3, prompt_lookup_min=5, prompt_lookup_max=5,
                                     disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE)
    only_max = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                         "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    only_min = parse_speculative_config({"method": "[ngram]", "num_speculative_tokens": 2,
                                         "prompt_lookup_min": 2})
    assert (only_min.method, only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (
        "ngram", 2, 2)
    old_style = parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 4})
    assert old_style.method == "ngram" and old_style.model is None
    assert old_style.num_lookahead_slots == 0
    # Absent: pagellm's measured default; JSON null: propose at any batch size (vLLM's default).
    assert old_style.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    always = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, '
                                      '"disable_by_batch_size": null}')
    assert always.disable_by_batch_size is None and always.enabled_for_batch(10_000)


def test_draft_model_from_model_alone() -> None:
    spec = parse_speculative_config({"model": "/m/draft", "num_speculative_tokens": 3,
                                     "disable_by_batch_size": 8})
    assert spec.method == "draft_model" and spec.model == "/m/draft"
    assert spec.num_lookahead_slots == 3
    assert spec.enabled_for_batch(7) and not spec.enabled_for_batch(8)


def test_nothing_given_means_off() -> None:
    assert parse_speculative_config(None) is None
    assert parse_speculative_config("  ") is None


@pytest.mark.parametrize("value,match", [
    ('{"method": "ngram"', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "unknown key.*'foo'"),
    ({"method": "ngram"}, "'num_speculative_tokens' is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "'num_speculative_tokens' must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "'num_speculative_tokens' must be an"),
    ({"method": "ngram", "num_speculative_tokens": True}, "'num_speculative_tokens' must be an"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "'method' must be one of ngram"),
    ({"method": 3, "num_speculative_tokens": 2}, "'method' must be a string"),
    ({"num_speculative_tokens": 2}, "'method' is required"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "'model' is required"),
    ({"method": "ngram", "model": "/x", "num_speculative_tokens": 2}, "'model' is only for"),
    ({"method": "draft_model", "model": "/x", "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, "'prompt_lookup_max' is only for method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "'prompt_lookup_min' \\(4\\) must be <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "'prompt_lookup_min' must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
     "'disable_by_batch_size' must be >= 2"),
])
def test_errors_name_the_key_and_the_flag(value, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        parse_speculative_config(value)
    assert str(err.value).startswith("--speculative-config")


def test_flag_and_llm_argument() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 2}'])
    args = EngineArgs.from_cli_args(ns)
    assert parse_speculative_config(args.speculative_config).num_speculative_tokens == 2
    assert EngineArgs().speculative_config is None


def test_draft_model_with_tensor_parallel_is_refused() -> None:
    args = EngineArgs(tensor_parallel_size=2, speculative_config={
        "method": "draft_model", "model": "/x", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="draft_model.*--tensor-parallel-size 1"):
        args.create_engine_config()


def test_async_scheduling_together_is_refused() -> None:
    args = EngineArgs(async_scheduling=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="--async-scheduling.*--speculative-config"):
        args.create_engine_config()


def test_cli_error_is_one_line_naming_the_flag(tiny_llama_dir, capsys) -> None:
    from pagellm.entrypoints.cli import main

    assert main(["generate", "--model", str(tiny_llama_dir), "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --speculative-config: unknown key(s) 'lookahead'")
    assert "Traceback" not in err
