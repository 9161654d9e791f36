"""The answers of requests whose tool_choice forces a call. Their output is constrained JSON, so
it is read as such: a named function's answer is its arguments object; ``required``'s is an
array of ``{"name": ..., "parameters": {...}}`` objects (vLLM's format)."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedToolOutput,
    ToolParser,
    call_from_object,
)
from pagellm.entrypoints.openai.tool_parsers.partial_json import scan_object, skip_whitespace


class NamedFunctionParser(ToolParser):
    """tool_choice ``{"type": "function", "function": {"name": ...}}``."""

    name = "named_function"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        start = skip_whitespace(text, 0)
        return ParsedToolOutput("", [ParsedCall(self.function_name, text[start:], final)])


class RequiredToolsParser(ToolParser):
    """tool_choice ``required``."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        i = skip_whitespace(text, 0)
        if i >= len(text):
            return ParsedToolOutput("", [], valid=not final)
        if text[i] != "[":
            return ParsedToolOutput("", [], valid=False)
        calls: list[ParsedCall] = []
        i += 1
        while True:
            i = skip_whitespace(text, i)
            if i >= len(text):
                return ParsedToolOutput("", calls, valid=not final)
            if text[i] == "]":
                return ParsedToolOutput("", calls, valid=bool(calls))
            if text[i] == "," and calls:
                i += 1
                continue
            scan = scan_object(text, i)
            if not scan.valid:
                return ParsedToolOutput("", calls, valid=False)
            calls.append(call_from_object(scan))
            if scan.end is None:
                return ParsedToolOutput("", calls, valid=not final)
            i = scan.end
