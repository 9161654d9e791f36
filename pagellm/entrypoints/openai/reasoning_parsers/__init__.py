"""Reasoning parsers, by their --reasoning-parser names (vLLM's)."""

from __future__ import annotations

from pagellm.entrypoints.openai.reasoning_parsers.reasoning_streamer import (
    ReasoningStreamer,
    extract_reasoning,
)
from pagellm.entrypoints.openai.reasoning_parsers.think_reasoning_parser import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ThinkReasoningParser,
)

REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def get_reasoning_parser(name: str) -> ThinkReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r}; one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}.")
    return REASONING_PARSERS[name]()


__all__ = ["REASONING_PARSERS", "ReasoningStreamer", "ThinkReasoningParser", "extract_reasoning",
           "get_reasoning_parser"]
