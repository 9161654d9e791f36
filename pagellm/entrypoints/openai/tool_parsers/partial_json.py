"""Reading JSON that a model is still writing, as it arrives: which top-level fields of an object
are complete and where each value's text starts and ends. Tool-call parsers stream a call's
arguments as the raw text of its ``arguments`` value, so that the fragments a client joins are
exactly the final arguments string.

Every scanner keeps its state between pieces of text and goes on from where it stopped, reading
each character about once: a stream's parse costs time linear in its length, not a re-read of
the whole text per token."""

from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right

WHITESPACE = re.compile(r"[ \t\n\r]*")
# Regexes jump over string bodies and plain characters at C speed instead of a Python loop per
# character.
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
_STRUCTURAL = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r"[ \t\n\r,}\]]")


class GrowingText:
    """A stream's text, kept as its pieces: appending costs the piece (a str would be copied
    whole on every append) and a slice near the end costs the slice. ``chars_read`` counts the
    characters handed out (sliced, or given to scan with ``window``): all that the parsers
    read, the measure of their work."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._ends: list[int] = []  # each piece's end offset in the text
        self._last_start = 0  # the last piece's offset
        self.length = 0
        self.chars_read = 0

    def __len__(self) -> int:
        return self.length

    def append(self, piece: str) -> None:
        if piece:
            self._last_start = self.length
            self.length += len(piece)
            self._pieces.append(piece)
            self._ends.append(self.length)

    def __getitem__(self, key: slice) -> str:
        start, stop, _ = key.indices(self.length)
        chunk, offset = self.window(start, stop)
        return chunk[start - offset:stop - offset]

    def window(self, start: int, stop: int | None = None) -> tuple[str, int]:
        """``(s, offset)``: ``s[start - offset:stop - offset]`` is ``text[start:stop]``,
        without a copy when that lies in one piece (a regex or find reads it in place)."""
        stop = self.length if stop is None else stop
        if start >= stop:
            return "", start
        self.chars_read += stop - start
        if start >= self._last_start:  # the usual case: the newest piece
            return self._pieces[-1], self._last_start
        first = bisect_right(self._ends, start)
        last = bisect_left(self._ends, stop)
        offset = self._ends[first] - len(self._pieces[first])
        if first == last:
            return self._pieces[first], offset
        return "".join(self._pieces[first:last + 1]), offset


# Look-ahead reads go in chunks that double from this size: what they read is about the
# distance to what they look for, not the rest of the text (a whole answer is read at once).
FIRST_CHUNK = 16


def next_char(text: GrowingText, pos: int) -> tuple[int, str]:
    """The first character from ``pos`` on that is not whitespace: ``(index, character)``, or
    ``(len(text), "")`` while there is none."""
    step = FIRST_CHUNK
    while pos < len(text):
        stop = min(len(text), pos + step)
        chunk, base = text.window(pos, stop)
        i = WHITESPACE.match(chunk, pos - base, stop - base).end()
        if base + i < stop:
            return base + i, chunk[i]
        pos, step = stop, step * 2
    return len(text), ""


def partial_marker_length(text: str, marker: str, start: int = 0, end: int | None = None
                          ) -> int:
    """How many trailing characters of ``text[start:end]`` could be the start of ``marker``
    (held back while streaming, so a marker is never shown in part)."""
    end = len(text) if end is None else end
    if end <= start or text[end - 1] not in marker:  # the usual case, decided at once
        return 0
    for k in range(min(len(marker) - 1, end - start), 0, -1):
        if text.endswith(marker[:k], start, end):
            return k
    return 0


class MarkerSearch:
    """The first ``marker`` at or after ``start`` in a growing text. Each ``find`` reads only the
    text that came since, plus the tail that may be the marker's beginning (``held``)."""

    def __init__(self, text: GrowingText, marker: str, start: int) -> None:
        self.text = text
        self.marker = marker
        self.pos = start  # no marker starts in [start, pos)
        self.found: int | None = None
        self.held = 0  # trailing characters that may begin the marker

    def find(self) -> int | None:
        text, marker = self.text, self.marker
        step = FIRST_CHUNK + len(marker)
        while self.found is None:
            stop = min(len(text), self.pos + step)
            s, base = text.window(self.pos, stop)
            i, n = self.pos - base, stop - base
            k = s.find(marker, i, n)
            if k >= 0:
                self.found, self.held = base + k, 0
            elif stop == len(text):
                # A marker that is still to come starts within the longest tail that begins it.
                self.held = partial_marker_length(s, marker, i, n)
                self.pos = stop - self.held
                return None
            else:  # a marker may straddle the chunk's end
                self.pos = max(self.pos, stop - len(marker) + 1)
                step *= 2
        return self.found


class ValueScanner:
    """Where a JSON value ends: leading whitespace is skipped, then only the nesting is followed
    (json.loads judges the finished text). A number, true, false or null ends at a delimiter,
    so at the end of the text it may go on."""

    __slots__ = ("start", "first", "end", "_depth", "_in_string", "_escape", "_scalar")

    def __init__(self) -> None:
        self.start: int | None = None  # where the value's first character is
        self.first = ""
        self.end: int | None = None  # just past the value, once complete
        self._depth = 0
        self._in_string = False
        self._escape = False  # the string's last character so far is an escaping backslash
        self._scalar = False

    def copy(self) -> ValueScanner:
        other = ValueScanner()
        for slot in ValueScanner.__slots__:
            setattr(other, slot, getattr(self, slot))
        return other

    def advance(self, text: GrowingText, pos: int, to: int) -> int:
        """Reads ``text[pos:to]``; returns where it stopped."""
        if pos >= to or self.end is not None:
            return pos
        chunk, base = text.window(pos, to)
        return base + self.scan(chunk, base, pos - base, to - base)

    def scan(self, chunk: str, base: int, i: int, n: int) -> int:
        """Reads ``chunk[i:n]`` (``chunk`` is the text from offset ``base``); returns where it
        stopped: just past the value, or ``n``."""
        if self.start is None:
            i = WHITESPACE.match(chunk, i, n).end()
            if i == n:
                return n
            self.start, self.first = base + i, chunk[i]
            if self.first == '"':
                self._in_string = True
                i += 1
            elif self.first in "{[":
                self._depth = 1
                i += 1
            else:
                self._scalar = True
        if self._scalar:
            match = _SCALAR_END.search(chunk, i, n)
            if match is None:
                return n
            self.end = base + match.start()
            return match.start()
        while i < n:
            if self._in_string:
                if self._escape:
                    self._escape = False
                    i += 1
                    continue
                i = _STRING_BODY.match(chunk, i, n).end()
                if i == n:
                    break
                i += 1
                if chunk[i - 1] == "\\":  # the chunk's last character: the escaped one follows
                    self._escape = True
                    continue
                self._in_string = False
                if self._depth == 0:
                    self.end = base + i
                    return i
                continue
            match = _STRUCTURAL.search(chunk, i, n)
            if match is None:
                return n
            i, c = match.end(), match.group()
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self.end = base + i
                    return i
        return n


class Field:
    """A top-level field's value: ``text[start:end]``; ``end`` is None while it is being
    written. Never changed once made (scanner copies share them), except for the cached
    decoding of a complete value."""

    __slots__ = ("start", "end", "first", "decoded", "is_decoded")

    def __init__(self, start: int, end: int | None, first: str) -> None:
        self.start, self.end, self.first = start, end, first
        self.decoded: str | None = None
        self.is_decoded = False


_START, _MEMBER, _KEY, _COLON, _VALUE, _DONE, _INVALID = range(7)


class ObjectScanner:
    """The top-level fields of a JSON object as its text arrives: leading whitespace, then the
    object, which must open with ``{``. ``advance(to)`` reads the text up to ``to``; ``copy``
    gives a scanner to read ahead with, leaving this one where it was."""

    def __init__(self, text: GrowingText, pos: int) -> None:
        self.text = text
        self.pos = pos  # the text before it is read
        self._phase = _START
        self._expect_key = True
        self._key = ""
        self._scanner = ValueScanner()  # the key's string, then the value
        self.fields: dict[str, Field] = {}
        self.end: int | None = None  # just past the closing brace, once complete

    @property
    def empty(self) -> bool:
        """Only whitespace so far."""
        return self._phase == _START

    @property
    def valid(self) -> bool:
        """False: the text cannot become a JSON object."""
        return self._phase != _INVALID

    @property
    def complete(self) -> bool:
        return self._phase == _DONE

    def copy(self) -> ObjectScanner:
        other = ObjectScanner(self.text, self.pos)
        other._phase, other._expect_key, other._key = self._phase, self._expect_key, self._key
        other._scanner = self._scanner.copy()
        other.fields = dict(self.fields)
        other.end = self.end
        return other

    def advance(self, to: int) -> None:
        if self.pos >= to or self._phase in (_DONE, _INVALID):
            return
        chunk, base = self.text.window(self.pos, to)
        self.pos = base + self._scan(chunk, base, self.pos - base, to - base)

    def _scan(self, chunk: str, base: int, i: int, n: int) -> int:
        while i < n:
            phase = self._phase
            if phase in (_KEY, _VALUE):
                scanner = self._scanner
                started = scanner.start is not None
                i = scanner.scan(chunk, base, i, n)
                if phase == _KEY:
                    if scanner.end is None:
                        return i
                    try:
                        self._key = json.loads(self.text[scanner.start:scanner.end])
                    except ValueError:
                        self._phase = _INVALID
                        return i
                    self._phase = _COLON
                    continue
                if scanner.start is None:
                    return i
                if scanner.end is not None or not started:
                    self.fields[self._key] = Field(scanner.start, scanner.end, scanner.first)
                if scanner.end is None:
                    return i
                self._expect_key, self._phase = False, _MEMBER
                continue
            if phase in (_DONE, _INVALID):
                return i
            i = WHITESPACE.match(chunk, i, n).end()
            if i == n:
                return i
            c = chunk[i]
            i += 1
            if phase == _START:
                self._phase = _MEMBER if c == "{" else _INVALID
            elif phase == _COLON:
                if c == ":":
                    self._phase, self._scanner = _VALUE, ValueScanner()
                else:
                    self._phase = _INVALID
            elif c == "}":
                self._phase, self.end = _DONE, base + i
            elif c == "," and not self._expect_key:
                self._expect_key = True
            elif c == '"' and self._expect_key:
                self._phase, self._scanner = _KEY, ValueScanner()
                self._scanner.scan(c, base + i - 1, 0, 1)
            else:
                self._phase = _INVALID
        return i

    def raw(self, f: Field) -> str:
        """A complete field's text."""
        return self.text[f.start:f.end]

    def string_field(self, name: str) -> str | None:
        """The decoded value of a complete string field, else None."""
        f = self.fields.get(name)
        if f is None or f.end is None or f.first != '"':
            return None
        if not f.is_decoded:
            try:
                value = json.loads(self.raw(f))
            except ValueError:
                value = None
            f.decoded, f.is_decoded = value if isinstance(value, str) else None, True
        return f.decoded
