"""What every tool-call parser gives: the plain content and the calls found in a model's text.

A parser's ``ToolParseState`` is fed a stream's text piece by piece (``final``: the text is
complete) and keeps a content prefix that will not change and the calls as far as they are
written. Each piece costs about its own length: the state goes on from where it stopped instead
of re-reading the text so far. A non-streaming response feeds the whole text at once to the same
state, so streaming and non-streaming agree."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from pagellm.entrypoints.openai.protocol_tools import ChatTool
from pagellm.entrypoints.openai.tool_parsers.partial_json import (
    GrowingText,
    ObjectScanner,
    next_char,
)

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ParsedCall:
    name: str | None  # None until its JSON string is complete
    complete: bool
    # The raw JSON text of the arguments so far is ``source[start:end]``, mostly a span of the
    # stream's text: the streamer reads only the characters it has not sent.
    source: str | GrowingText
    start: int
    end: int
    # True when the arguments are already a prefix of the final text (an object being written);
    # a string or other value is sent only once complete.
    streamable: bool = True
    id: str | None = None  # the call's id as the model wrote it (Kimi's); else one is made

    @classmethod
    def of(cls, name: str | None, arguments: str, complete: bool,
           streamable: bool = True) -> ParsedCall:
        return cls(name, complete, arguments, 0, len(arguments), streamable)

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def arguments(self) -> str:
        return self.source[self.start:self.end]

    def arguments_after(self, n: int) -> str:
        """``arguments[n:]``, reading only those characters."""
        return self.source[self.start + n:self.end] if n < self.length else ""

    def valid(self) -> bool:
        if not self.complete or not self.name:
            return False
        try:
            return isinstance(json.loads(self.arguments), dict)
        except ValueError:
            return False


@dataclass
class ParsedToolOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    # False: the text has a call marker but no well-formed call (only judged when final); the
    # response then shows the whole text as content, as vLLM does.
    valid: bool = True


def call_from_object(scan: ObjectScanner, limit: int) -> ParsedCall:
    """A call from a ``{"name": ..., "arguments"|"parameters": {...}}`` object scan whose text
    so far ends at ``limit``."""
    args = next((scan.fields[k] for k in ARGUMENT_KEYS if k in scan.fields), None)
    name = scan.string_field("name")
    complete = scan.complete
    if args is None:
        return ParsedCall.of(name, "{}" if complete else "", complete)
    if args.first == "{":
        return ParsedCall(name, complete, scan.text, args.start,
                          limit if args.end is None else args.end)
    if args.end is None:
        return ParsedCall.of(name, "", complete, streamable=False)
    if not args.is_decoded:  # decoded once, not at every piece of text that follows
        raw = scan.raw(args)
        if raw.startswith('"'):  # arguments written as a JSON string holding JSON
            try:
                raw = json.loads(raw)
            except ValueError:
                pass
        args.decoded, args.is_decoded = raw, True
    return ParsedCall.of(name, args.decoded or "", complete, streamable=False)


class ToolParseState(ABC):
    """One text's parse, fed piece by piece. After each ``feed``: the content is
    ``text[:content_end]``; ``calls`` the calls so far, of which the first ``unchanged`` are
    the same objects as before that feed."""

    def __init__(self) -> None:
        self.text = GrowingText()
        self.content_end = 0
        self.calls: list[ParsedCall] = []
        self.num_settled = 0  # calls[:num_settled] stay as they are (barring reset_calls)
        # Content after the first call (formats that keep text between and after their calls):
        # the content is ``text[:content_end] + later_content``; it only grows.
        self.later_content = GrowingText()
        self.unchanged = 0
        # False: the text has a call marker but no well-formed call (only judged when final).
        self.valid = True

    def feed(self, delta: str, final: bool) -> None:
        self.text.append(delta)
        # The calls still being written are made again from their scans.
        self.unchanged = min(len(self.calls), self.num_settled)
        del self.calls[self.num_settled:]
        self.advance(final)

    @abstractmethod
    def advance(self, final: bool) -> None:
        """Reads the text added since the last call and updates the content, calls and
        validity."""

    def settle(self, call: ParsedCall) -> None:
        self.calls.append(call)
        self.num_settled += 1

    def reset_calls(self) -> None:
        """The calls so far were a misreading of the text (see llama3_json)."""
        self.calls.clear()
        self.num_settled = self.unchanged = 0

    def last_call_complete(self) -> bool:
        return bool(self.calls) and self.calls[-1].complete

    def acceptable(self) -> bool:
        """The complete text's calls are well formed (else the text is content)."""
        return self.valid and all(c.valid() for c in self.calls)

    def content_after(self, n: int) -> str:
        """The content from its ``n``-th character on, reading only those characters."""
        head = self.text[n:self.content_end] if n < self.content_end else ""
        m = max(0, n - self.content_end)
        return head + (self.later_content[m:] if m < len(self.later_content) else "")

    def output(self) -> ParsedToolOutput:
        return ParsedToolOutput(self.content_after(0), list(self.calls), self.valid)


class ToolParser(ABC):
    """``new_state()``: a text's parse, to feed the text to. Subclasses set ``name`` (the
    --tool-call-parser value). A parser holds no state of a text: one serves many streams."""

    name: ClassVar[str]
    # The call marker is a special token the detokenizer would drop (Mistral's [TOOL_CALLS]):
    # requests with tools keep special tokens in the text.
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def new_state(self) -> ToolParseState:
        ...

    def for_tools(self, tools: list[ChatTool]) -> ToolParser:
        """The parser for one request's tools: a format whose values are typed by the tools'
        schemas (qwen3_coder) reads them; the others need none."""
        return self

    def parse_final(self, text: str) -> ParsedToolOutput:
        """The complete text's calls; a text whose calls are not well formed is content."""
        state = self.new_state()
        state.feed(text, final=True)
        return state.output() if state.acceptable() else ParsedToolOutput(text)


class CallArray:
    """The ``{...}`` call objects of a JSON array (Mistral's, tool_choice required's), read from
    just past its ``[`` into ``state``'s calls. ``closed`` once its ``]`` is read."""

    def __init__(self, state: ToolParseState, pos: int) -> None:
        self.state = state
        self.pos = pos  # between items: the text before it is read
        self.scan: ObjectScanner | None = None
        self.closed = False
        self.valid = True  # False: an item that is not an object; nothing more is read
        self.space_after = True  # only whitespace after the "]" so far

    def advance(self) -> None:
        state, text = self.state, self.state.text
        while self.valid:
            if self.scan is not None:
                scan = self.scan
                scan.advance(len(text))
                if not scan.valid:
                    self.valid = False
                    return
                if scan.end is None:
                    state.calls.append(call_from_object(scan, len(text)))
                    return
                state.settle(call_from_object(scan, scan.end))
                self.scan, self.pos = None, scan.end
            if self.closed:
                after = text[self.pos:]
                self.space_after = self.space_after and (not after or after.isspace())
                self.pos = len(text)
                return
            self.pos, c = next_char(text, self.pos)
            if not c:
                return
            if c == "]":
                self.closed = True
                self.pos += 1
            elif c == "," and state.num_settled:
                self.pos += 1
            else:
                self.scan = ObjectScanner(text, self.pos)
