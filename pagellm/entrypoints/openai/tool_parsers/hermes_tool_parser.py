"""``hermes``: Hermes 2 Pro, Qwen2.5, Qwen3 and other ChatML tool formats, one call per
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block; text before the first block
is the message content (text between or after blocks is dropped, as vLLM does)."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParseState,
    call_from_object,
)
from pagellm.entrypoints.openai.tool_parsers.partial_json import (
    GrowingText,
    MarkerSearch,
    ObjectScanner,
)

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


class _Block:
    """A ``<tool_call>`` block whose end marker has not come yet."""

    def __init__(self, text: GrowingText, body_start: int) -> None:
        self.end = MarkerSearch(text, CALL_END, body_start)
        self.scan = ObjectScanner(text, body_start)


class _HermesState(ToolParseState):
    def __init__(self) -> None:
        super().__init__()
        self.start = MarkerSearch(self.text, CALL_START, 0)  # the next block's
        self.in_calls = False  # the first block has started: the content is settled
        self.block: _Block | None = None
        self.stopped = False  # a closed block was not a call: the rest is not read (as vLLM)
        self.closed_valid = True  # every closed block held a complete call

    def advance(self, final: bool) -> None:
        open_valid = True
        while not self.stopped:
            if self.block is None:
                start = self.start.find()
                if start is None:
                    if not self.in_calls:  # a marker being written is never shown in part
                        self.content_end = len(self.text) - (0 if final else self.start.held)
                    break
                if not self.in_calls:
                    self.in_calls, self.content_end = True, start
                self.block = _Block(self.text, start + len(CALL_START))
            block = self.block
            end = block.end.find()
            if end is not None:
                self._close(block, end)
                continue
            # The scan stops short of what may be the end marker's start: a closed body ends
            # before it. It reads ahead on a copy.
            held = block.end.held
            block.scan.advance(len(self.text) - held)
            scan = block.scan
            if held:
                scan = scan.copy()
                scan.advance(len(self.text))
            if scan.empty:  # nothing written yet
                open_valid = not final
            elif not scan.valid:
                open_valid = False
            else:
                self.calls.append(call_from_object(scan, len(self.text)))
            break
        if not self.in_calls:
            return
        self.valid = self.closed_valid and open_valid and (not final or self.last_call_complete())

    def _close(self, block: _Block, end: int) -> None:
        block.scan.advance(end)
        scan = block.scan
        if scan.empty or not scan.valid:
            self.closed_valid, self.stopped = False, True
            return
        call = call_from_object(scan, end)
        self.closed_valid = self.closed_valid and call.complete
        self.settle(call)
        self.block = None
        self.start = MarkerSearch(self.text, CALL_START, end + len(CALL_END))


class HermesToolParser(ToolParser):
    name = "hermes"

    def new_state(self) -> ToolParseState:
        return _HermesState()
