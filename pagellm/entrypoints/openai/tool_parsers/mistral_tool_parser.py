"""``mistral``: Mistral's ``[TOOL_CALLS]`` calls, in both formats its tokenizers produce:
``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 to v7) and
``[TOOL_CALLS]name[ARGS]{...}`` repeated per call (v11 and later). Text before the first
``[TOOL_CALLS]`` is content. ``[TOOL_CALLS]`` is a special token, so requests with tools keep
special tokens in the text."""

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
    value_end,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        start = text.find(TOOL_CALLS)
        if start < 0:
            held = 0 if final else partial_marker_length(text, TOOL_CALLS)
            return ParsedToolOutput(text[:len(text) - held])
        content, body = text[:start], text[start + len(TOOL_CALLS):]
        i = skip_whitespace(body, 0)
        if i >= len(body):
            return ParsedToolOutput(content, [], valid=not final)
        if body[i] == "[":
            calls, valid = _json_array_calls(body, i + 1)
        else:
            calls, valid = _named_calls(body)
        if final and (not calls or not calls[-1].complete):
            valid = False
        return ParsedToolOutput(content, calls, valid)


def _json_array_calls(body: str, i: int) -> tuple[list[ParsedCall], bool]:
    calls: list[ParsedCall] = []
    while True:
        i = skip_whitespace(body, i)
        if i >= len(body):
            return calls, True
        if body[i] == "]":
            return calls, i + 1 == len(body.rstrip())
        if body[i] == "," and calls:
            i += 1
            continue
        scan = scan_object(body, i)
        if not scan.valid:
            return calls, False
        calls.append(call_from_object(scan))
        if scan.end is None:
            return calls, True
        i = scan.end


def _named_calls(body: str) -> tuple[list[ParsedCall], bool]:
    """``name[ARGS]{...}`` segments, separated by further ``[TOOL_CALLS]`` markers."""
    calls: list[ParsedCall] = []
    for segment in body.split(TOOL_CALLS):
        args_at = segment.find(ARGS)
        if args_at < 0:
            # The name is still being written (its end is the [ARGS] marker).
            return calls, True
        name = segment[:args_at].strip()
        rest = segment[args_at + len(ARGS):]
        i = skip_whitespace(rest, 0)
        if i >= len(rest):
            calls.append(ParsedCall(name or None, "", False))
            return calls, True
        if rest[i] != "{":
            return calls, False
        end = value_end(rest, i)
        if end is None:
            calls.append(ParsedCall(name or None, rest[i:], False))
            return calls, True
        calls.append(ParsedCall(name or None, rest[i:end], True))
    return calls, True
