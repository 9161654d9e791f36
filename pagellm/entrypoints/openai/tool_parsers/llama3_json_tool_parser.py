"""``llama3_json``: Llama 3.1/3.2/3.3 JSON tool calls. The answer is one or more
``{"name": ..., "parameters": {...}}`` objects separated by ``;``, optionally after
``<|python_tag|>``; text before the tag is content. An answer that neither starts with ``{`` nor
holds the tag is plain content, as in vLLM."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParseState,
    call_from_object,
)
from pagellm.entrypoints.openai.tool_parsers.partial_json import (
    MarkerSearch,
    ObjectScanner,
    next_char,
)

PYTHON_TAG = "<|python_tag|>"


class _Calls:
    """``{...}`` objects separated by ``;`` from ``start`` on."""

    def __init__(self, state: ToolParseState, start: int) -> None:
        self.state = state
        self.scan: ObjectScanner | None = ObjectScanner(state.text, start)
        self.pos = start  # between objects: the text before it is read
        self.valid = True  # once False, nothing more is read

    def advance(self) -> None:
        state = self.state
        while self.valid:
            if self.scan is not None:
                scan = self.scan
                scan.advance(len(state.text))
                if scan.empty:
                    return
                if not scan.valid:
                    self.valid = False
                    return
                if scan.end is None:
                    state.calls.append(call_from_object(scan, len(state.text)))
                    return
                state.settle(call_from_object(scan, scan.end))
                self.scan, self.pos = None, scan.end
            self.pos, c = next_char(state.text, self.pos)
            if not c:
                return
            if c != ";":
                self.valid = False
                return
            self.scan = ObjectScanner(state.text, self.pos + 1)


class _Llama3State(ToolParseState):
    def __init__(self) -> None:
        super().__init__()
        self.tag = MarkerSearch(self.text, PYTHON_TAG, 0)
        self.lead = 0  # the leading whitespace before it is read
        self.first = ""  # the first character that is not whitespace, once read
        self.body: _Calls | None = None

    def advance(self, final: bool) -> None:
        text = self.text
        tag_before = self.tag.found
        tag = self.tag.find()
        if tag is not None:
            if tag_before is None:
                # Content up to the tag, calls after it: any calls read so far were content.
                self.reset_calls()
                self.content_end = tag
                self.body = _Calls(self, tag + len(PYTHON_TAG))
        elif not self.first:
            self.lead, self.first = next_char(text, self.lead)
            if self.first == "{":
                self.body = _Calls(self, self.lead)
        if self.body is None:
            if final:
                self.content_end = len(text)
            elif self.first:  # plain content, but for what may be the tag's start
                self.content_end = len(text) - self.tag.held
            # else only whitespace yet: a call may follow, nothing is shown
            return
        self.body.advance()
        self.valid = self.body.valid and (not final or self.last_call_complete())


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def new_state(self) -> ToolParseState:
        return _Llama3State()
