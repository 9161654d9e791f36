"""The answers of requests whose tool_choice forces a call. Their output is constrained JSON, so
it is read as such: a named function's answer is its arguments object; ``required``'s is an
array of ``{"name": ..., "parameters": {...}}`` objects (vLLM's format)."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    CallArray,
    ParsedCall,
    ToolParser,
    ToolParseState,
)
from pagellm.entrypoints.openai.tool_parsers.partial_json import next_char


class _NamedFunctionState(ToolParseState):
    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name
        self.lead = 0  # the leading whitespace before it is read
        self.start: int | None = None  # where the arguments start

    def advance(self, final: bool) -> None:
        text = self.text
        if self.start is None:
            self.lead, c = next_char(text, self.lead)
            if c:
                self.start = self.lead
        start = len(text) if self.start is None else self.start
        self.calls.append(ParsedCall(self.function_name, final, text, start, len(text)))


class NamedFunctionParser(ToolParser):
    """tool_choice ``{"type": "function", "function": {"name": ...}}``."""

    name = "named_function"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def new_state(self) -> ToolParseState:
        return _NamedFunctionState(self.function_name)


class _RequiredState(ToolParseState):
    def __init__(self) -> None:
        super().__init__()
        self.lead = 0  # the leading whitespace before it is read
        self.array: CallArray | None = None

    def advance(self, final: bool) -> None:
        if self.array is None:
            if not self.valid:  # the answer is not an array
                return
            self.lead, c = next_char(self.text, self.lead)
            if c == "[":
                self.array = CallArray(self, self.lead + 1)
            else:
                self.valid = bool(not c and not final)
                return
        array = self.array
        array.advance()
        self.valid = array.valid and (bool(self.calls) if array.closed else not final)


class RequiredToolsParser(ToolParser):
    """tool_choice ``required``."""

    name = "required"

    def new_state(self) -> ToolParseState:
        return _RequiredState()
