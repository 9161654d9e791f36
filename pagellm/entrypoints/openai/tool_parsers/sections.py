"""Formats whose calls sit in sections of the answer (Qwen3-Coder's ``<tool_call>`` blocks,
DeepSeek's and Kimi's special-token sections, a pythonic call list): the text outside the
sections is content, before, between and after them, and a reader per section turns its body
into calls. A stretch of text outside the sections that is only whitespace (the newline between
two blocks) is dropped, unless the answer has no section at all."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParseState
from pagellm.entrypoints.openai.tool_parsers.partial_json import (
    FIRST_CHUNK,
    WHITESPACE,
    GrowingText,
    MarkerSearch,
    ValueScanner,
)

PARTIAL = -1  # literal_at: the text so far is the start of one of the literals
NO_MATCH = -2


def literal_at(text: GrowingText, pos: int, literals: tuple[str, ...]) -> int:
    """Which of ``literals`` the text starts with at ``pos`` (its index), PARTIAL while the text
    so far could still begin one, else NO_MATCH. Reads at most the longest literal."""
    longest = max(len(s) for s in literals)
    head = text[pos:pos + longest]
    partial = False
    for i, literal in enumerate(literals):
        if head.startswith(literal):
            return i
        partial = partial or literal.startswith(head)
    return PARTIAL if partial else NO_MATCH


def whitespace_end(text: GrowingText, pos: int, to: int) -> int:
    """The end of the run of whitespace at ``pos``, reading no further than ``to``."""
    step = FIRST_CHUNK
    while pos < to:
        stop = min(to, pos + step)
        chunk, base = text.window(pos, stop)
        pos = base + WHITESPACE.match(chunk, pos - base, stop - base).end()
        if pos < stop:
            break
        step *= 2
    return pos


def scan_value(value: ValueScanner, text: GrowingText, pos: int) -> int:
    """Advances ``value`` over the text from ``pos``, a chunk at a time, until it ends or the
    text does; returns where it stopped."""
    step = FIRST_CHUNK
    while value.end is None and pos < len(text):
        pos = value.advance(text, pos, min(len(text), pos + step))
        step *= 2
    return pos


class FirstMarker:
    """The first of several markers (a token's spellings) at or after ``start``."""

    def __init__(self, text: GrowingText, markers: tuple[str, ...], start: int) -> None:
        self.searches = [MarkerSearch(text, m, start) for m in markers]

    def find(self) -> tuple[int, str] | None:
        """(where, which marker), once no other marker can start before it."""
        found = [(p, s.marker) for s in self.searches if (p := s.find()) is not None]
        if not found:
            return None
        at, marker = min(found)
        if any(s.found is None and s.pos < at for s in self.searches):
            return None  # a longer marker being written may start earlier
        return at, marker

    @property
    def held(self) -> int:
        return max((s.held for s in self.searches if s.found is None), default=0)


class Section(ABC):
    """A section's body, read as it arrives into the state's calls: the calls it has closed are
    settled, the one being written is appended anew at each ``advance``."""

    valid = True  # False: the body cannot become well formed; nothing more is read

    @abstractmethod
    def advance(self) -> int | None:
        """Reads the new text; just past the section's end, once that is read."""

    def may_end_here(self) -> bool:
        """The answer may end inside the section as it stands (its calls are all closed)."""
        return False


class SectionedState(ToolParseState):
    """The text outside the sections is content; ``find_section`` says where the next one
    starts. ``one_section``: after the first section the rest is content."""

    one_section = False

    def __init__(self) -> None:
        super().__init__()
        self.section: Section | None = None
        self.num_sections = 0
        self.stopped = False  # a section went wrong: the rest is not read
        self._gap(0)

    @abstractmethod
    def find_section(self, pos: int) -> tuple[int, Section] | None:
        """The next section at or after ``pos``: (its start, its reader), once that is clear.
        Called again with the same ``pos`` as the text grows."""

    @abstractmethod
    def held(self) -> int:
        """After a ``find_section`` that found none: the trailing characters that may still
        begin a section (never shown as content yet)."""

    def _gap(self, start: int) -> None:
        self.gap_start = start  # the text outside the sections from here on
        self.gap_scanned = start  # only whitespace in [gap_start, gap_scanned)
        self.gap_shown = start  # the gap's text before it is content
        self.gap_visible = False  # the gap holds more than whitespace: it is content

    def _show_gap(self, upto: int, closed: bool, final: bool) -> None:
        """The gap's text up to ``upto`` (``closed``: a section starts there) goes to the
        content once the gap holds more than whitespace."""
        if not self.gap_visible:
            self.gap_scanned = whitespace_end(self.text, self.gap_scanned, upto)
            self.gap_visible = (self.gap_scanned < upto
                                or (final and not closed and self.num_sections == 0))
        if not self.gap_visible or upto <= self.gap_shown:
            return
        if self.num_sections == 0:
            self.content_end = upto
        else:
            self.later_content.append(self.text[self.gap_shown:upto])
        self.gap_shown = upto

    def advance(self, final: bool) -> None:
        text = self.text
        while not self.stopped:
            if self.section is None:
                found = None if self.one_section and self.num_sections else \
                    self.find_section(self.gap_start)
                if found is None:
                    held = 0 if final or (self.one_section and self.num_sections) \
                        else self.held()
                    self._show_gap(len(text) - held, False, final)
                    break
                start, self.section = found
                self._show_gap(start, True, final)
                self.num_sections += 1
            section = self.section
            end = section.advance()
            if not section.valid:
                self.stopped = True
                break
            if end is None:
                break
            self.section = None
            self._gap(end)
        self.valid = not self.stopped and (
            not final or self.section is None or self.section.may_end_here())


class MarkedSections(SectionedState):
    """Sections that open with a marker (one of its spellings)."""

    def __init__(self, begin: tuple[str, ...]) -> None:
        self.begin = begin
        self.search: FirstMarker | None = None
        self.search_from = -1
        super().__init__()

    @abstractmethod
    def new_section(self, body: int) -> Section:
        """The reader of a section whose body starts at ``body``."""

    def find_section(self, pos: int) -> tuple[int, Section] | None:
        if self.search is None or self.search_from != pos:
            self.search, self.search_from = FirstMarker(self.text, self.begin, pos), pos
        found = self.search.find()
        if found is None:
            return None
        at, marker = found
        return at, self.new_section(at + len(marker))

    def held(self) -> int:
        return self.search.held if self.search is not None else 0
