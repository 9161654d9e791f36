"""A chat answer's text -> the assistant message: reasoning (--reasoning-parser), content and
tool calls (the request's ToolPlan), whole or as streamed deltas. Both paths parse with the
same parsers, so a streamed answer joins up to the non-streamed one."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.entrypoints.openai.chat_tools import ChatToolOptions, ToolPlan
from pagellm.entrypoints.openai.protocol import ChatResponseMessage, DeltaMessage
from pagellm.entrypoints.openai.reasoning_parsers import (
    ReasoningStreamer,
    ThinkReasoningParser,
    extract_reasoning,
    get_reasoning_parser,
)
from pagellm.entrypoints.openai.tool_parsers import ToolParser
from pagellm.entrypoints.openai.tool_parsers.tool_call_streamer import (
    ToolCallStreamer,
    extract_tool_calls,
)

TOOL_CALLS_FINISH = "tool_calls"


def _finish_reason(finish_reason: str | None, called: bool) -> str | None:
    # A call that was cut short (length) keeps "length": its arguments are incomplete.
    return TOOL_CALLS_FINISH if called and finish_reason == "stop" else finish_reason


def read_message(text: str, finish_reason: str | None, tool_parser: ToolParser | None,
                 max_calls: int | None, reasoning_parser: ThinkReasoningParser | None
                 ) -> tuple[ChatResponseMessage, str | None]:
    """The non-streaming message and finish_reason of one choice."""
    reasoning, content = (extract_reasoning(reasoning_parser, text) if reasoning_parser
                          else (None, text))
    tool_calls = []
    if tool_parser is not None and content is not None:
        content, tool_calls = extract_tool_calls(tool_parser, content, max_calls)
    message = ChatResponseMessage(content=content, reasoning_content=reasoning,
                                  tool_calls=tool_calls)
    return message, _finish_reason(finish_reason, bool(tool_calls))


class ChoiceDeltas:
    """One streamed choice: each piece of text -> the delta it adds (None: nothing to send)."""

    def __init__(self, tool_parser: ToolParser | None, max_calls: int | None,
                 reasoning_parser: ThinkReasoningParser | None) -> None:
        self.reasoning = ReasoningStreamer(reasoning_parser) if reasoning_parser else None
        self.tools = ToolCallStreamer(tool_parser, max_calls) if tool_parser else None

    def feed(self, text: str, finish_reason: str | None) -> tuple[DeltaMessage | None,
                                                                 str | None]:
        final = finish_reason is not None
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        tool_deltas = []
        if self.tools is not None:
            content, tool_deltas = self.tools.feed(content, final)
        finish_reason = _finish_reason(finish_reason, self.tools is not None
                                       and self.tools.called)
        if not (content or reasoning or tool_deltas):
            return None, finish_reason
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                            tool_calls=tool_deltas or None), finish_reason


@dataclass(frozen=True)
class ChatReading:
    """How one request's answers are read (the parsers hold no state; ChoiceDeltas does)."""

    tool_parser: ToolParser | None
    max_calls: int | None
    reasoning_parser: ThinkReasoningParser | None

    @classmethod
    def for_request(cls, plan: ToolPlan, options: ChatToolOptions, constrained: bool
                    ) -> ChatReading | None:
        """None: the answer is plain content. A constrained answer has no reasoning block (the
        grammar rules from the first token), so the reasoning parser is not applied to it."""
        reasoning = (get_reasoning_parser(options.reasoning_parser)
                     if options.reasoning_parser and not constrained else None)
        if plan.parser is None and reasoning is None:
            return None
        return cls(plan.parser, plan.max_calls, reasoning)

    def message(self, text: str, finish_reason: str | None
                ) -> tuple[ChatResponseMessage, str | None]:
        return read_message(text, finish_reason, self.tool_parser, self.max_calls,
                            self.reasoning_parser)

    def choice_deltas(self) -> ChoiceDeltas:
        return ChoiceDeltas(self.tool_parser, self.max_calls, self.reasoning_parser)


class PlainDeltas:
    """One streamed choice without parsers: each piece of text is the content it adds."""

    def feed(self, text: str, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        return DeltaMessage(content=text), finish_reason


def stream_reader(reading: ChatReading | None) -> ChoiceDeltas | PlainDeltas:
    """The reader of one streamed choice: the request's parsers (a fresh state), or plain."""
    return reading.choice_deltas() if reading else PlainDeltas()
