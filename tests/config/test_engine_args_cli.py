"""EngineArgs' fields are the one definition of the engine options: the generated flags, the
mapping back, LLM's keywords and create_engine_config's checks agree with them."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from pagellm.config import DTYPES, EnvSettings, read_env, resolve_dtype
from pagellm.config_flags import flag_name, opt_of
from pagellm.engine_args import EngineArgs


def _parser(model_positional: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, model_positional)
    for f in dataclasses.fields(EngineArgs):
        if opt_of(f).server:  # `pagellm serve` places these among its own flags
            EngineArgs.add_cli_arg(parser, f.name)
    return parser


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings}


def test_every_field_has_its_flag() -> None:
    actions = _actions(_parser(model_positional=False))
    assert set(actions) - {"help"} == EngineArgs.field_names()
    for f in dataclasses.fields(EngineArgs):
        opt, action = opt_of(f), actions[f.name]
        assert opt.help and action.help == opt.help, f.name
        assert flag_name(f) in action.option_strings
        assert action.default == f.default, f.name
        if opt.choices is not None:
            assert tuple(action.choices) == opt.choices, f.name


def test_flags_keep_their_spelling() -> None:
    actions = _actions(_parser())
    assert actions["tensor_parallel_size"].option_strings == ["--tensor-parallel-size", "-tp"]
    assert actions["served_model_name"].nargs == "+"
    assert actions["model"].help == "same as MODEL"  # MODEL (positional) has the field's help
    assert "--no-enable-prefix-caching" in actions["enable_prefix_caching"].option_strings


def test_no_flags_give_the_defaults() -> None:
    assert EngineArgs.from_cli_args(_parser().parse_args([])) == EngineArgs()


def test_flags_map_back() -> None:
    ns = _parser().parse_args(["M", "-tp", "2", "--kv-cache-memory", "4GiB", "--block-size",
                               "32", "--enable-prefix-caching", "--served-model-name", "a", "b"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.model, args.tensor_parallel_size, args.kv_cache_memory) == ("M", 2, "4GiB")
    assert args.block_size == 32 and args.enable_prefix_caching
    assert args.served_model_name == "a"  # the reported name; the server answers to all
    with pytest.raises(SystemExit, match="disagree"):
        EngineArgs.from_cli_args(_parser().parse_args(["M", "--model", "N"]))


@pytest.mark.parametrize("alias", DTYPES)
def test_dtype_accepts_every_alias(alias: str) -> None:
    assert _parser().parse_args(["--dtype", alias]).dtype == alias
    dtype = resolve_dtype(alias, None, torch.device("cpu"))
    assert dtype in (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(EngineArgs)
                                  if opt_of(f).choices is not None])
def test_create_engine_config_checks_the_same_choices(name: str) -> None:
    field = next(f for f in dataclasses.fields(EngineArgs) if f.name == name)
    with pytest.raises(ValueError, match=flag_name(field)):  # before any model is read
        EngineArgs(**{name: "no-such-value"}).create_engine_config()
    with pytest.raises(SystemExit):
        _parser().parse_args([flag_name(field), "no-such-value"])


def test_llm_refuses_an_unknown_option_by_name() -> None:
    from pagellm import LLM

    with pytest.raises(TypeError, match="max_num_seq'"):
        LLM(max_num_seq=4)


def test_engine_config_holds_the_environment(tiny_llama_dir, monkeypatch) -> None:
    monkeypatch.setenv("PAGELLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    monkeypatch.setenv("PAGELLM_FAULT_INJECT", "before:3")
    config = EngineArgs(model=str(tiny_llama_dir), device="cpu", max_model_len=512,
                        kv_cache_memory="64MiB").create_engine_config()
    assert config.env == read_env()
    assert config.env.allow_long_max_model_len and config.model.max_model_len == 512
    from pagellm.engine.fault_injection import FaultInjector

    assert FaultInjector.from_env(config.env) == FaultInjector("before", 3)
    assert FaultInjector.from_env(EnvSettings()) is None


def test_read_env() -> None:
    env = read_env({"PAGELLM_FUSED_CPU": "off", "PAGELLM_NO_GGUF_CACHE": "1",
                    "TRITON_INTERPRET": "1", "OPENAI_API_KEY": "k", "PAGELLM_API_KEY": ""})
    assert not env.fused_cpu and not env.gguf_cache and env.triton_interpret
    assert env.openai_api_key == "k" and env.api_key is None
    assert read_env({}) == EnvSettings()
