"""Streaming tool calls: each new piece of text is parsed with what came before, and only the
difference is sent: content text, then for each call a first delta with its id, type and name,
then fragments of its arguments. Joined, the fragments are the non-streaming answer's
arguments."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.entrypoints.openai.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    tool_call_id,
)
from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser


@dataclass
class _SentCall:
    id: str
    num_argument_chars: int = 0


class ToolCallStreamer:
    """One choice's stream. ``max_calls`` 1: parallel_tool_calls false."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.num_content_chars = 0
        self.sent: list[_SentCall] = []

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, delta: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and the tool-call deltas that ``delta`` (and, when ``final``, the end
        of the text) adds."""
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        if final and not self.sent:
            parsed = self.parser.parse_final(self.text)
        content = parsed.content[self.num_content_chars:]
        self.num_content_chars = max(self.num_content_chars, len(parsed.content))
        deltas: list[DeltaToolCall] = []
        calls = parsed.calls if self.max_calls is None else parsed.calls[:self.max_calls]
        for index, call in enumerate(calls):
            if index < len(self.sent):
                sent = self.sent[index]
                header = None
            elif call.name is None:
                break  # a later call is never sent before this one's name
            else:
                sent = _SentCall(tool_call_id())
                self.sent.append(sent)
                header = call.name
            arguments = call.arguments if (call.streamable or call.complete) else ""
            fragment = arguments[sent.num_argument_chars:]
            sent.num_argument_chars = max(sent.num_argument_chars, len(arguments))
            if header is not None:
                deltas.append(DeltaToolCall(index=index, id=sent.id, type="function",
                                            function=DeltaFunctionCall(name=header,
                                                                       arguments=fragment)))
            elif fragment:
                deltas.append(DeltaToolCall(index=index,
                                            function=DeltaFunctionCall(arguments=fragment)))
        return content, deltas


def extract_tool_calls(parser: ToolParser, text: str, max_calls: int | None = None
                       ) -> tuple[str | None, list[ToolCall]]:
    """The non-streaming answer: (content, or None when empty; the calls)."""
    parsed = parser.parse_final(text)
    calls = parsed.calls if max_calls is None else parsed.calls[:max_calls]
    tool_calls = [ToolCall(function=FunctionCall(name=c.name or "", arguments=c.arguments))
                  for c in calls]
    content = parsed.content
    if tool_calls and not content:
        return None, tool_calls
    return content, tool_calls
