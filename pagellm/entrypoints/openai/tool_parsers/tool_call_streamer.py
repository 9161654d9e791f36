"""Streaming tool calls: each new piece of text goes on the stream's parse, and only the
difference is sent: content text, then for each call a first delta with its id, type and name,
then fragments of its arguments. Joined, the fragments are the non-streaming answer's
arguments. A piece costs about its own length (no re-read of the text so far, no re-visit of
the calls already sent), so a stream costs time linear in its length."""

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
        self.state = parser.new_state()
        self.max_calls = max_calls
        self.num_content_chars = 0
        self.sent: list[_SentCall] = []

    @property
    def called(self) -> bool:
        return bool(self.sent)

    @property
    def scanned_chars(self) -> int:
        """The characters of the text read so far, parsing and sending: the stream's work."""
        return self.state.text.chars_read

    def feed(self, delta: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and the tool-call deltas that ``delta`` (and, when ``final``, the end
        of the text) adds."""
        state = self.state
        state.feed(delta, final)
        calls = state.calls
        if final and not self.sent and not state.acceptable():
            # As parse_final: the text is content (what was sent of it is a prefix).
            content, calls = state.text[self.num_content_chars:], []
        else:
            content = state.content_after(self.num_content_chars)
        self.num_content_chars += len(content)
        deltas: list[DeltaToolCall] = []
        count = len(calls) if self.max_calls is None else min(len(calls), self.max_calls)
        # A call that was sent and has not changed has nothing new to send.
        for index in range(min(len(self.sent), state.unchanged), count):
            call = calls[index]
            if index < len(self.sent):
                sent = self.sent[index]
                header = None
            elif call.name is None:
                break  # a later call is never sent before this one's name
            else:
                sent = _SentCall(call.id or tool_call_id())
                self.sent.append(sent)
                header = call.name
            fragment = ""
            if call.streamable or call.complete:
                fragment = call.arguments_after(sent.num_argument_chars)
                sent.num_argument_chars = max(sent.num_argument_chars, call.length)
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
    tool_calls = [ToolCall(id=c.id or tool_call_id(),
                           function=FunctionCall(name=c.name or "", arguments=c.arguments))
                  for c in calls]
    content = parsed.content
    if tool_calls and not content:
        return None, tool_calls
    return content, tool_calls
