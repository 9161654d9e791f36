"""A streamed response's server-sent events, OpenAI's sequence: response.created,
response.in_progress, then per output item output_item.added, its content part's added /
delta... / done events (output_text, reasoning_text) or its function_call_arguments delta /
done, output_item.done; last response.completed (or .incomplete, .failed). Every event
carries the next sequence_number. Items open as the chat deltas arrive and close when another
kind of delta (or the end) comes, so every .added has its .done."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagellm.entrypoints.openai.protocol import DeltaMessage
from pagellm.entrypoints.openai.responses_output import (
    Seal,
    function_call_item,
    item_id,
    message_item,
    output_text_part,
    reasoning_item,
    reasoning_text_part,
)


class EventWriter:
    """SSE frames (``event:`` + ``data:``, as OpenAI sends them) numbered in order."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, type_: str, **fields: Any) -> str:
        data = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type_}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class _OpenItem:
    kind: str  # "message" | "reasoning" | "function_call"
    index: int  # output_index
    id: str
    text: str = ""  # the text, or the call's arguments
    call_index: int | None = None  # the chat delta's tool call index
    call_id: str = ""
    name: str = ""


@dataclass
class StreamedItems:
    """The output items of one streamed answer, as events (``feed``), and as items once
    ``close`` has run (``items``, the response's output)."""

    write: EventWriter
    seal: Seal = None  # reasoning items' encrypted_content (in their output_item.done)
    items: list[dict[str, Any]] = field(default_factory=list)
    _open: _OpenItem | None = None

    def feed(self, delta: DeltaMessage) -> list[str]:
        events: list[str] = []
        if delta.reasoning_content:
            events += self._text("reasoning", delta.reasoning_content)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls or []:
            fn = call.function
            current = self._open
            if current is None or current.kind != "function_call" \
                    or current.call_index != call.index:
                events += self._close("completed")
                current = self._start(_OpenItem(
                    "function_call", len(self.items), item_id("fc"), call_index=call.index,
                    call_id=call.id or item_id("call"), name=(fn.name if fn else None) or ""),
                    events)
            if fn is not None and fn.arguments:
                current.text += fn.arguments
                events.append(self.write("response.function_call_arguments.delta",
                                         item_id=current.id, output_index=current.index,
                                         delta=fn.arguments))
        return events

    def close(self, status: str) -> list[str]:
        """The end of the answer: the open item's .done events (an answer that made no item
        at all gets an empty message, as the non-streamed response has)."""
        events = self._close(status)
        if not self.items:
            self._start(_OpenItem("message", 0, item_id("msg")), events)
            events += self._close(status)
        return events

    def _text(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        current = self._open
        if current is None or current.kind != kind:
            events += self._close("completed")
            current = self._start(_OpenItem(kind, len(self.items), item_id(
                "msg" if kind == "message" else "rs")), events)
        current.text += text
        event = "response.output_text.delta" if kind == "message" \
            else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self.write(event, item_id=current.id, output_index=current.index,
                                 content_index=0, delta=text, **extra))
        return events

    def _start(self, item: _OpenItem, events: list[str]) -> _OpenItem:
        self._open = item
        events.append(self.write("response.output_item.added", output_index=item.index,
                                 item=self._item(item, "in_progress")))
        part = self._part(item, "")
        if part is not None:
            events.append(self.write("response.content_part.added", item_id=item.id,
                                     output_index=item.index, content_index=0, part=part))
        return item

    def _close(self, status: str) -> list[str]:
        item = self._open
        if item is None:
            return []
        self._open = None
        common = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            events = [self.write("response.output_text.done", **common, content_index=0,
                                 text=item.text, logprobs=[])]
        elif item.kind == "reasoning":
            events = [self.write("response.reasoning_text.done", **common, content_index=0,
                                 text=item.text)]
        else:
            events = [self.write("response.function_call_arguments.done", **common,
                                 arguments=item.text)]
        part = self._part(item, item.text)
        if part is not None:
            events.append(self.write("response.content_part.done", **common, content_index=0,
                                     part=part))
        done = self._item(item, status)
        self.items.append(done)
        events.append(self.write("response.output_item.done", output_index=item.index,
                                 item=done))
        return events

    @staticmethod
    def _part(item: _OpenItem, text: str) -> dict[str, Any] | None:
        if item.kind == "message":
            return output_text_part(text)
        if item.kind == "reasoning":
            return reasoning_text_part(text)
        return None

    def _item(self, item: _OpenItem, status: str) -> dict[str, Any]:
        if item.kind == "message":
            full = message_item(item.text, status, item.id)
            if status == "in_progress":
                full["content"] = []  # the part comes with content_part.added
            return full
        if item.kind == "reasoning":
            if status == "in_progress":
                return {**reasoning_item("", status, item.id), "content": []}
            return reasoning_item(item.text, status, item.id, self.seal)
        return function_call_item(item.call_id, item.name, item.text, status, item.id)
