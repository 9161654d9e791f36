"""``hermes``: Hermes 2 Pro, Qwen2.5, Qwen3 and other ChatML tool formats, one call per
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block; text before the first block
is the message content (text between or after blocks is dropped, as vLLM does)."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedToolOutput,
    ToolParser,
    call_from_object,
)
from pagellm.entrypoints.openai.tool_parsers.partial_json import (
    partial_marker_length,
    scan_object,
    skip_whitespace,
)

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        start = text.find(CALL_START)
        if start < 0:
            held = 0 if final else partial_marker_length(text, CALL_START)
            return ParsedToolOutput(text[:len(text) - held])
        calls: list[ParsedCall] = []
        valid = True
        while start >= 0:
            body_start = start + len(CALL_START)
            end = text.find(CALL_END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            i = skip_whitespace(body, 0)
            if i >= len(body):  # nothing written yet (or an empty block)
                valid = valid and end < 0 and not final
                break
            scan = scan_object(body, i)
            if not scan.valid:
                valid = False
                break
            call = call_from_object(scan)
            if end >= 0 and not call.complete:
                valid = False
            calls.append(call)
            if end < 0:
                break
            start = text.find(CALL_START, end + len(CALL_END))
        if final and (not calls or not calls[-1].complete):
            valid = False
        return ParsedToolOutput(text[:text.find(CALL_START)], calls, valid)
