"""``llama3_json``: Llama 3.1/3.2/3.3 JSON tool calls. The answer is one or more
``{"name": ..., "parameters": {...}}`` objects separated by ``;``, optionally after
``<|python_tag|>``; text before the tag is content. An answer that neither starts with ``{`` nor
holds the tag is plain content, as in vLLM."""

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

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            content, body = text[:tag], text[tag + len(PYTHON_TAG):]
        else:
            first = skip_whitespace(text, 0)
            if first < len(text) and text[first] == "{":
                content, body = "", text
            elif first >= len(text) and not final:
                return ParsedToolOutput("")  # only whitespace yet: a call may follow
            else:
                held = 0 if final else partial_marker_length(text, PYTHON_TAG)
                return ParsedToolOutput(text[:len(text) - held])
        calls: list[ParsedCall] = []
        valid = True
        i = skip_whitespace(body, 0)
        while i < len(body):
            scan = scan_object(body, i)
            if not scan.valid:
                valid = False
                break
            calls.append(call_from_object(scan))
            if scan.end is None:
                break
            i = skip_whitespace(body, scan.end)
            if i < len(body):
                if body[i] != ";":
                    valid = False
                    break
                i = skip_whitespace(body, i + 1)
        if final and (not calls or not calls[-1].complete):
            valid = False
        return ParsedToolOutput(content, calls, valid)
