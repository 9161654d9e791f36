"""Tool-call parsers, by their --tool-call-parser names (vLLM's)."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedToolOutput,
    ToolParser,
    ToolParseState,
)
from pagellm.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from pagellm.entrypoints.openai.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser
from pagellm.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}.")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ParsedCall", "ParsedToolOutput", "ToolParseState", "ToolParser",
           "get_tool_parser"]
