"""What every tool-call parser gives: the plain content and the calls found in a model's text.

A parser reads the whole text so far (``final``: the text is complete) and answers with a
content prefix that will not change and the calls as far as they are written; streaming and
non-streaming responses both come from that one ``parse``, so they agree."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from pagellm.entrypoints.openai.tool_parsers.partial_json import ObjectScan

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ParsedCall:
    name: str | None  # None until its JSON string is complete
    arguments: str  # the raw JSON text of the arguments so far
    complete: bool
    # True when ``arguments`` is already a prefix of the final text (an object being written);
    # a string or other value is sent only once complete.
    streamable: bool = True

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


def call_from_object(scan: ObjectScan) -> ParsedCall:
    """A call from a ``{"name": ..., "arguments"|"parameters": {...}}`` object scan."""
    args_field = next((scan.fields[k] for k in ARGUMENT_KEYS if k in scan.fields), None)
    name = scan.string_field("name")
    complete = scan.complete
    if args_field is None:
        return ParsedCall(name, "{}" if complete else "", complete)
    if args_field.raw.startswith("{"):
        return ParsedCall(name, args_field.raw, complete)
    if not args_field.complete:
        return ParsedCall(name, "", complete, streamable=False)
    raw = args_field.raw
    if raw.startswith('"'):  # arguments written as a JSON string holding JSON
        try:
            raw = json.loads(raw)
        except ValueError:
            pass
    return ParsedCall(name, raw, complete, streamable=False)


class ToolParser(ABC):
    """``parse(text, final)``: the content before the calls and the calls. Subclasses set
    ``name`` (the --tool-call-parser value)."""

    name: ClassVar[str]
    # The call marker is a special token the detokenizer would drop (Mistral's [TOOL_CALLS]):
    # requests with tools keep special tokens in the text.
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        ...

    def parse_final(self, text: str) -> ParsedToolOutput:
        """The complete text's calls; a text whose calls are not well formed is content."""
        parsed = self.parse(text, final=True)
        if not parsed.valid or not all(c.valid() for c in parsed.calls):
            return ParsedToolOutput(text)
        return parsed
