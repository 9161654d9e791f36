"""Tool-call parsers, by their --tool-call-parser names (vLLM's)."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedToolOutput,
    ToolParser,
    ToolParseState,
)
from pagellm.entrypoints.openai.tool_parsers.deepseek_tool_parsers import (
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
)
from pagellm.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from pagellm.entrypoints.openai.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser
from pagellm.entrypoints.openai.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser
from pagellm.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from pagellm.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser
from pagellm.entrypoints.openai.tool_parsers.qwen3_coder_tool_parser import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        Qwen3CoderToolParser, DeepSeekV3ToolParser, DeepSeekV31ToolParser,
                        KimiK2ToolParser, PythonicToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}.")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ParsedCall", "ParsedToolOutput", "ToolParseState", "ToolParser",
           "get_tool_parser"]
