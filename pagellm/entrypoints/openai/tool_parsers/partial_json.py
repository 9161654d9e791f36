"""Scanning JSON that a model is still writing: which top-level fields of an object are complete,
and the raw text of each value so far. Tool-call parsers stream a call's arguments as the raw
text of its ``arguments`` value, so that the fragments a client joins are exactly the final
arguments string."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WHITESPACE = " \t\n\r"
# The scans run over the whole text at every streamed token: regexes jump over string bodies
# and plain characters at C speed instead of a Python loop per character.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_STRUCTURAL = re.compile(r'["{}\[\]]')


@dataclass
class FieldScan:
    raw: str  # the value's text as written so far
    complete: bool


@dataclass
class ObjectScan:
    fields: dict[str, FieldScan] = field(default_factory=dict)
    end: int | None = None  # index just past the closing brace, once complete
    valid: bool = True  # False: the text cannot become a JSON object

    @property
    def complete(self) -> bool:
        return self.valid and self.end is not None

    def string_field(self, name: str) -> str | None:
        """The decoded value of a complete string field, else None."""
        f = self.fields.get(name)
        if f is None or not f.complete or not f.raw.startswith('"'):
            return None
        try:
            value = json.loads(f.raw)
        except ValueError:
            return None
        return value if isinstance(value, str) else None


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index just past the string opening at ``text[i]`` (a quote), or None if unfinished."""
    match = _STRING.match(text, i)
    return match.end() if match else None


def value_end(text: str, i: int) -> int | None:
    """Index just past the JSON value starting at ``text[i]``, or None if it is unfinished.
    Only the nesting is checked here; json.loads judges the finished text."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while True:
            match = _STRUCTURAL.search(text, j)
            if match is None:
                return None
            k = match.start()
            c = text[k]
            if c == '"':
                end = string_end(text, k)
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if c in "{[" else -1
            if depth == 0:
                return k + 1
            j = k + 1
    # A number, true, false or null ends at a delimiter; at the end of the text it may go on.
    j = i
    while j < len(text) and text[j] not in _WHITESPACE + ",}]":
        j += 1
    return j if j < len(text) else None


def scan_object(text: str, start: int) -> ObjectScan:
    """The top-level fields of the object opening at ``text[start]`` (which must be ``{``)."""
    scan = ObjectScan()
    if start >= len(text) or text[start] != "{":
        scan.valid = False
        return scan
    i = start + 1
    expect_key = True
    while True:
        i = skip_whitespace(text, i)
        if i >= len(text):
            return scan
        c = text[i]
        if c == "}":
            scan.end = i + 1
            return scan
        if c == ",":
            if expect_key:
                scan.valid = False
                return scan
            expect_key = True
            i += 1
            continue
        if c != '"' or not expect_key:
            scan.valid = False
            return scan
        key_end = string_end(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            scan.valid = False
            return scan
        i = skip_whitespace(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            scan.valid = False
            return scan
        i = skip_whitespace(text, i + 1)
        if i >= len(text):
            return scan
        end = value_end(text, i)
        if end is None:
            scan.fields[key] = FieldScan(text[i:], complete=False)
            return scan
        scan.fields[key] = FieldScan(text[i:end], complete=True)
        expect_key = False
        i = end


def partial_marker_length(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker`` (held back
    while streaming, so a marker is never shown in part)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
