"""``mistral``: Mistral's ``[TOOL_CALLS]`` calls, in both formats its tokenizers produce:
``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 to v7) and
``[TOOL_CALLS]name[ARGS]{...}`` repeated per call (v11 and later). Text before the first
``[TOOL_CALLS]`` is content. ``[TOOL_CALLS]`` is a special token, so requests with tools keep
special tokens in the text."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    CallArray,
    ParsedCall,
    ToolParser,
    ToolParseState,
)
from pagellm.entrypoints.openai.tool_parsers.partial_json import (
    MarkerSearch,
    ValueScanner,
    next_char,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class _NamedCalls:
    """``name[ARGS]{...}`` segments, each running up to the next ``[TOOL_CALLS]``."""

    def __init__(self, state: ToolParseState, start: int) -> None:
        self.state = state
        self.stopped = False  # a segment ended the calls: the rest is not read
        self.valid = True
        self._segment(start)

    def _segment(self, start: int) -> None:
        text = self.state.text
        self.start = start
        self.cut = MarkerSearch(text, TOOL_CALLS, start)  # the segment's end
        self.args = MarkerSearch(text, ARGS, start)
        self.name: str | None = None
        self.value: ValueScanner | None = None  # once the name is read
        self.pos = 0  # the value's text before it is read
        self.after = False  # the value is complete: the segment's rest is dropped

    def advance(self) -> None:
        if self.stopped:
            return
        state, text = self.state, self.state.text
        self.valid = True
        while True:
            cut = self.cut.find()
            if self.after:
                if cut is None:
                    return
                self._segment(cut + len(TOOL_CALLS))
                continue
            if self.value is None:
                at = self.args.find()
                if at is None or (cut is not None and cut < at):
                    self.stopped = cut is not None  # a whole segment without [ARGS]
                    return  # else the name is still being written (its end is [ARGS])
                self.name = text[self.start:at].strip() or None
                self.value, self.pos = ValueScanner(), at + len(ARGS)
            # The value's scan stops short of what may be the next marker's start (a cut
            # segment ends before it) and reads ahead on a copy.
            end = len(text) if cut is None else cut
            held = 0 if cut is not None else self.cut.held
            self.pos = self.value.advance(text, self.pos, end - held)
            value = self.value
            if held:
                value = value.copy()
                value.advance(text, self.pos, end)
            if value.start is None:
                call = ParsedCall.of(self.name, "", False)
            elif value.first != "{":
                self.valid, self.stopped = False, cut is not None
                return
            else:
                call = ParsedCall(self.name, value.end is not None, text, value.start,
                                  end if value.end is None else value.end)
            if value.end is not None and value is self.value:
                state.settle(call)
                self.after = True
                continue
            if cut is None:
                state.calls.append(call)
                return
            state.settle(call)  # cut short: the calls end here
            self.stopped = True
            return


class _MistralState(ToolParseState):
    def __init__(self) -> None:
        super().__init__()
        self.start = MarkerSearch(self.text, TOOL_CALLS, 0)
        self.body: int | None = None  # just past the first [TOOL_CALLS]
        self.lead = 0  # the body's leading whitespace before it is read
        self.reader: CallArray | _NamedCalls | None = None

    def advance(self, final: bool) -> None:
        text = self.text
        if self.body is None:
            start = self.start.find()
            if start is None:  # a marker being written is never shown in part
                self.content_end = len(text) - (0 if final else self.start.held)
                return
            self.content_end = start
            self.body = self.lead = start + len(TOOL_CALLS)
        if self.reader is None:
            self.lead, c = next_char(text, self.lead)
            if not c:
                self.valid = not final
                return
            self.reader = (CallArray(self, self.lead + 1) if c == "["
                           else _NamedCalls(self, self.body))
        reader = self.reader
        reader.advance()
        if isinstance(reader, CallArray):
            valid = reader.valid and (reader.space_after or not reader.closed)
        else:
            valid = reader.valid
        self.valid = valid and (not final or self.last_call_complete())


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def new_state(self) -> ToolParseState:
        return _MistralState()
