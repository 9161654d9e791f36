"""``qwen3_coder``: Qwen3-Coder's (and Qwen3.5's) XML calls, one per block:
``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...</function>\\n
</tool_call>``. A value is text (one newline either side is the format's, not the value's),
typed by the parameter's schema in the request's tools: a string stays a string, numbers,
booleans, objects and arrays are parsed (typed_values.py). Text outside the blocks is content.
A call's arguments stream as ``{``, then one ``"ARG": value`` fragment per closed parameter,
then ``}``."""

from __future__ import annotations

import json
from typing import Any

from pagellm.entrypoints.openai.protocol_tools import ChatTool
from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ToolParser,
    ToolParseState,
)
from pagellm.entrypoints.openai.tool_parsers.partial_json import (
    GrowingText,
    MarkerSearch,
    next_char,
)
from pagellm.entrypoints.openai.tool_parsers.sections import (
    NO_MATCH,
    PARTIAL,
    MarkedSections,
    Section,
    literal_at,
)
from pagellm.entrypoints.openai.tool_parsers.typed_values import typed_value

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

# Each tool's parameter schemas by name: {function name: {parameter: schema}}.
Schemas = dict[str, dict[str, Any]]

_FUNCTION, _NAME, _BETWEEN, _PARAM_NAME, _VALUE, _AFTER = range(6)


def _tag_name(text: str) -> str | None:
    name = text.strip()
    return name if name and "<" not in name and "\n" not in name else None


class _Block(Section):
    """One ``<tool_call>`` block's body: a function and its parameters."""

    def __init__(self, state: ToolParseState, schemas: Schemas, body: int) -> None:
        self.state = state
        self.schemas = schemas
        self.pos = body  # the text before it is read
        self.phase = _FUNCTION
        self.tag: MarkerSearch | None = None  # the end of a name, or of a value
        self.tag_start = 0
        self.params: dict[str, Any] = {}
        self.key = ""
        self.args = GrowingText()
        self.call: ParsedCall | None = None

    def may_end_here(self) -> bool:
        return self.phase == _AFTER  # the function is closed; </tool_call> may be cut off

    def _expect(self, literals: tuple[str, ...]) -> int:
        """Which of ``literals`` comes next, after whitespace (PARTIAL, NO_MATCH)."""
        self.pos, c = next_char(self.state.text, self.pos)
        if not c:
            return PARTIAL
        which = literal_at(self.state.text, self.pos, literals)
        if which == NO_MATCH:
            self.valid = False
        return which

    def _tag(self, after: int, end: str) -> None:
        self.tag_start = after
        self.tag = MarkerSearch(self.state.text, end, after)

    def _add(self, fragment: str) -> None:
        assert self.call is not None
        self.args.append(fragment)
        self.call.end = len(self.args)

    def advance(self) -> int | None:
        text = self.state.text
        while self.valid:
            if self.phase == _FUNCTION:
                if self._expect((FUNCTION,)) < 0:
                    return None
                self._tag(self.pos + len(FUNCTION), ">")
                self.phase = _NAME
                continue
            if self.phase == _NAME:
                assert self.tag is not None
                at = self.tag.find()
                if at is None:
                    return None
                name = _tag_name(text[self.tag_start:at])
                if name is None:
                    self.valid = False
                    return None
                self.params = self.schemas.get(name, {})
                self.call = ParsedCall(name, False, self.args, 0, 0)
                self._add("{")
                self.pos, self.phase = at + 1, _BETWEEN
                continue
            call = self.call
            assert call is not None
            if self.phase == _BETWEEN:
                which = self._expect((PARAMETER, FUNCTION_END))
                if which == 0:
                    self._tag(self.pos + len(PARAMETER), ">")
                    self.phase = _PARAM_NAME
                elif which == 1:
                    self._add("}")
                    call.complete = True
                    self.pos += len(FUNCTION_END)
                    self.phase = _AFTER
                elif which == PARTIAL:
                    break
            elif self.phase == _PARAM_NAME:
                assert self.tag is not None
                at = self.tag.find()
                if at is None:
                    break
                key = _tag_name(text[self.tag_start:at])
                if key is None:
                    self.valid = False
                    return None
                self.key = key
                self._tag(at + 1, PARAMETER_END)
                self.phase = _VALUE
            elif self.phase == _VALUE:
                assert self.tag is not None
                at = self.tag.find()
                if at is None:
                    break
                raw = text[self.tag_start:at]
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
                value = typed_value(raw, self.params.get(self.key))
                self._add((", " if call.end > 1 else "") + json.dumps(self.key, ensure_ascii=False)
                          + ": " + json.dumps(value, ensure_ascii=False))
                self.pos, self.phase = at + len(PARAMETER_END), _BETWEEN
            else:
                which = self._expect((CALL_END,))
                if which == 0:
                    self.state.settle(call)
                    return self.pos + len(CALL_END)
                break
        if self.valid and self.call is not None:
            self.state.calls.append(self.call)
        return None


class _Qwen3CoderState(MarkedSections):
    def __init__(self, schemas: Schemas) -> None:
        self.schemas = schemas
        super().__init__((CALL_START,))

    def new_section(self, body: int) -> Section:
        return _Block(self, self.schemas, body)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, schemas: Schemas | None = None) -> None:
        self.schemas: Schemas = schemas or {}

    def for_tools(self, tools: list[ChatTool]) -> ToolParser:
        schemas: Schemas = {}
        for tool in tools:
            params = tool.function.parameters or {}
            properties = params.get("properties", params)  # as vLLM: bare properties too
            schemas[tool.function.name] = properties if isinstance(properties, dict) else {}
        return Qwen3CoderToolParser(schemas)

    def new_state(self) -> ToolParseState:
        return _Qwen3CoderState(self.schemas)
