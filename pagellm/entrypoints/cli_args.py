"""Engine flags for the CLI commands: ``EngineArgs.add_cli_args`` / ``from_cli_args`` under the
names the commands' callers (and tests) have imported since the first CLI."""

from __future__ import annotations

import argparse

from pagellm.engine_args import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    EngineArgs.add_cli_args(parser, model_positional)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs.from_cli_args(ns)
