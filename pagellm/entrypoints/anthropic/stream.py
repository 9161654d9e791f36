"""A streamed chat answer's deltas -> Anthropic's content-block events: one block open at a
time (thinking, text, or one tool_use per call), each opened by content_block_start, fed by
content_block_delta and closed by content_block_stop, with consecutive indexes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagellm.entrypoints.anthropic.errors import event
from pagellm.entrypoints.anthropic.translate import THINKING_SIGNATURE, tool_use_id
from pagellm.entrypoints.openai.protocol import DeltaMessage


@dataclass
class BlockEvents:
    index: int = -1  # the open (or last) block's
    kind: str | None = None  # the open block's type; None: none is open
    call: int | None = None  # the open tool_use block's call index (the chat delta's)
    events: list[str] = field(default_factory=list)

    def feed(self, delta: DeltaMessage) -> list[str]:
        """The events one chat delta adds (reasoning, then content, then calls: the order
        the parsers read them in)."""
        if delta.reasoning_content:
            self._open("thinking", {"type": "thinking", "thinking": "",
                                    "signature": THINKING_SIGNATURE})
            self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content})
        if delta.content:
            self._open("text", {"type": "text", "text": ""})
            self._delta({"type": "text_delta", "text": delta.content})
        for call in delta.tool_calls or ():
            function = call.function
            if call.index != self.call or self.kind != "tool_use":
                # A call's first delta carries its name (ToolCallStreamer's header).
                name = function.name if function is not None else None
                self._open("tool_use", {"type": "tool_use", "id": tool_use_id(),
                                        "name": name or "", "input": {}}, force=True)
                self.call = call.index
            if function is not None and function.arguments:
                self._delta({"type": "input_json_delta", "partial_json": function.arguments})
        return self._take()

    def close(self) -> list[str]:
        """The events that close the last block (when one is open)."""
        self._close()
        return self._take()

    def _take(self) -> list[str]:
        out, self.events = self.events, []
        return out

    def _open(self, kind: str, block: dict[str, Any], force: bool = False) -> None:
        if self.kind == kind and not force:
            return
        self._close()
        self.index += 1
        self.kind = kind
        self.events.append(event("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block}))

    def _delta(self, delta: dict[str, Any]) -> None:
        self.events.append(event("content_block_delta", {
            "type": "content_block_delta", "index": self.index, "delta": delta}))

    def _close(self) -> None:
        if self.kind is None:
            return
        if self.kind == "thinking":  # Anthropic ends a thinking block with its signature
            self._delta({"type": "signature_delta", "signature": THINKING_SIGNATURE})
        self.events.append(event("content_block_stop", {"type": "content_block_stop",
                                                        "index": self.index}))
        self.kind = self.call = None
