"""Calls written between special tokens, with JSON arguments (DeepSeek V3/V3.1, Kimi K2):
a section of calls, each ``CALL_BEGIN header ARGS_BEGIN {json} [suffix] CALL_END``, then the
section's end. The arguments are a span of the answer, streamed as they are written; the JSON
is followed by its nesting (a marker inside a JSON string does not end the call)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ToolParseState,
)
from pagellm.entrypoints.openai.tool_parsers.partial_json import (
    MarkerSearch,
    ValueScanner,
    next_char,
)
from pagellm.entrypoints.openai.tool_parsers.sections import (
    NO_MATCH,
    PARTIAL,
    MarkedSections,
    Section,
    literal_at,
    scan_value,
)

# A call's header text -> (name, id or None), or None when it is not a header.
HeaderReader = Callable[[str], "tuple[str, str | None] | None"]


@dataclass(frozen=True)
class TokenFormat:
    section_begin: tuple[str, ...]  # the section's opening token, in each spelling
    section_end: tuple[str, ...]
    call_begin: str
    args_begin: str  # between a call's header and its arguments
    call_end: str
    read_header: HeaderReader
    args_suffix: str = ""  # may follow the JSON before CALL_END (V3's closing code fence)


_BETWEEN, _HEADER, _ARGS, _AFTER = range(4)


class TokenSection(Section):
    def __init__(self, state: ToolParseState, fmt: TokenFormat, body: int) -> None:
        self.state = state
        self.fmt = fmt
        self.pos = body  # the text before it is read
        self.phase = _BETWEEN
        self.header_start = 0
        self.header: MarkerSearch | None = None
        self.name = ""
        self.id: str | None = None
        self.value = ValueScanner()
        self.call: ParsedCall | None = None  # complete arguments, before CALL_END
        self.suffix_read = False

    def may_end_here(self) -> bool:
        return self.phase == _BETWEEN

    def _fail(self) -> None:
        self.valid = False

    def advance(self) -> int | None:
        state, fmt, text = self.state, self.fmt, self.state.text
        while self.valid:
            if self.phase == _BETWEEN:
                self.pos, c = next_char(text, self.pos)
                if not c:
                    return None
                which = literal_at(text, self.pos, (fmt.call_begin, *fmt.section_end))
                if which == PARTIAL:
                    return None
                if which == NO_MATCH:
                    self._fail()
                    return None
                if which > 0:  # the section's end
                    return self.pos + len(fmt.section_end[which - 1])
                self.header_start = self.pos + len(fmt.call_begin)
                self.header = MarkerSearch(text, fmt.args_begin, self.header_start)
                self.phase = _HEADER
            elif self.phase == _HEADER:
                assert self.header is not None
                at = self.header.find()
                if at is None:
                    return None
                read = fmt.read_header(text[self.header_start:at])
                if read is None:
                    self._fail()
                    return None
                self.name, self.id = read
                self.value, self.pos = ValueScanner(), at + len(fmt.args_begin)
                self.phase = _ARGS
            elif self.phase == _ARGS:
                value = self.value
                self.pos = scan_value(value, text, self.pos)
                if value.start is None:
                    state.calls.append(ParsedCall(self.name, False, "", 0, 0, id=self.id))
                    return None
                if value.first != "{":
                    self._fail()
                    return None
                if value.end is None:
                    state.calls.append(ParsedCall(self.name, False, text, value.start,
                                                  len(text), id=self.id))
                    return None
                self.call = ParsedCall(self.name, True, text, value.start, value.end,
                                       id=self.id)
                self.suffix_read = not fmt.args_suffix
                self.phase = _AFTER
            else:
                assert self.call is not None
                self.pos, c = next_char(text, self.pos)
                options = (fmt.call_end,) if self.suffix_read else (fmt.call_end,
                                                                    fmt.args_suffix)
                which = literal_at(text, self.pos, options) if c else PARTIAL
                if which == PARTIAL:
                    state.calls.append(self.call)
                    return None
                if which == NO_MATCH:
                    self._fail()
                    return None
                self.pos += len(options[which])
                if which == 1:
                    self.suffix_read = True
                    continue
                state.settle(self.call)
                self.call, self.phase = None, _BETWEEN
        return None


class TokenSectionsState(MarkedSections):
    def __init__(self, fmt: TokenFormat) -> None:
        self.fmt = fmt
        super().__init__(fmt.section_begin)

    def new_section(self, body: int) -> Section:
        return TokenSection(self, self.fmt, body)
