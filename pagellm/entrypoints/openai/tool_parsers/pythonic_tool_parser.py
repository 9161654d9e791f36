"""``pythonic``: Llama 3.2 / Llama 4 (and other) calls written as a Python list of calls,
``[get_weather(city="Paris", days=3), other(x=[1, 2])]``. Arguments are keyword arguments whose
values are Python literals (strings, numbers, True/False/None, lists, tuples, dicts), read with
``ast`` (never evaluated) and given as JSON. The list starts at a ``[`` followed by a name and
``(``; text before and after it is content. Anything else in the list (a positional argument,
an expression that is not a literal) makes the answer content.

While streaming, a call's name goes out at its ``(``, and its arguments as ``{``, one
``"key": value`` fragment per argument once its ``,`` or ``)`` is read, then ``}``."""

from __future__ import annotations

import ast
import json
import re

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ToolParser,
    ToolParseState,
)
from pagellm.entrypoints.openai.tool_parsers.partial_json import (
    FIRST_CHUNK,
    GrowingText,
    MarkerSearch,
    next_char,
)
from pagellm.entrypoints.openai.tool_parsers.sections import Section, SectionedState
from pagellm.entrypoints.openai.tool_parsers.typed_values import literal_value

_NAME = re.compile(r"([^\W\d]\w*)\s*")
_LIST_START = re.compile(r"\s*([^\W\d]\w*)?\s*")
_LOOKAHEAD = 256  # a "[" not known to open a call list this far on does not
_STRUCTURAL = re.compile(r"[\"'()\[\]{},]")
_QUOTE_END = {q: re.compile(r"\\|" + re.escape(q)) for q in ("'", '"', "'''", '"""')}


def _match_ahead(pattern: re.Pattern[str], text: GrowingText, pos: int
                 ) -> tuple[str, int, str] | None:
    """``pattern`` (a name, then whitespace) matched at ``pos``, reading no more than it needs
    nor past the look-ahead: (the name or "", where the match ends, the character after it:
    "" at the end of the text so far, "!" at the look-ahead's end); None: no match."""
    cap, step = min(len(text), pos + _LOOKAHEAD), FIRST_CHUNK
    while True:
        end = min(cap, pos + step)
        chunk, base = text.window(pos, end)
        match = pattern.match(chunk, pos - base, end - base)
        if match is None:
            return None
        at = base + match.end()
        if at < end:
            return match.group(1) or "", at, chunk[match.end()]
        if end == len(text) or end == cap:
            return match.group(1) or "", at, "" if end == len(text) else "!"
        step *= 2


class _ArgumentScanner:
    """Where a call's argument ends: a ``,`` or ``)`` outside brackets and strings."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote = ""  # the open string's quote

    def scan(self, chunk: str, i: int, n: int) -> tuple[int, str]:
        """Reads ``chunk[i:n]``: (where it stopped, what ended the argument: "," or ")",
        "!" for a bracket closed that was not open, "" when more text is needed)."""
        while i < n:
            if self.quote:
                match = _QUOTE_END[self.quote].search(chunk, i, n)
                if match is None:  # a closing triple quote may be starting at the end
                    return (max(i, n - 2) if len(self.quote) == 3 else n), ""
                if match.group() == "\\":
                    if match.end() == n:
                        return match.start(), ""  # the escaped character is still to come
                    i = match.end() + 1
                    continue
                self.quote, i = "", match.end()
                continue
            match = _STRUCTURAL.search(chunk, i, n)
            if match is None:
                return n, ""
            j, c = match.start(), match.group()
            if c in "'\"":
                if j + 1 == n or (chunk[j + 1] == c and j + 2 == n):
                    return j, ""  # '' or ''' cannot be told apart yet
                if chunk[j + 1] != c:
                    self.quote, i = c, j + 1
                elif chunk[j + 2] == c:
                    self.quote, i = c * 3, j + 3
                else:
                    i = j + 2  # an empty string
                continue
            if c in "([{":
                self.depth += 1
            elif c in ")]}":
                if self.depth == 0:
                    return j, ")" if c == ")" else "!"
                self.depth -= 1
            elif self.depth == 0:
                return j, ","
            i = j + 1
        return n, ""


def _keyword(text: str) -> tuple[str, object]:
    """``key=literal`` -> (key, its JSON value); ValueError when it is not that."""
    try:
        tree = ast.parse(f"f({text}\n)", mode="eval")
    except (SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(str(e)) from None
    call = tree.body
    if not isinstance(call, ast.Call) or call.args or len(call.keywords) != 1 \
            or call.keywords[0].arg is None:
        raise ValueError("not a keyword argument")
    return call.keywords[0].arg, literal_value(call.keywords[0].value)


_CALL, _ARGS, _AFTER_CALL, _AFTER_COMMA = range(4)


class _CallList(Section):
    """The list's body, from just past its ``[``."""

    def __init__(self, state: ToolParseState, body: int) -> None:
        self.state = state
        self.pos = body  # the text before it is read
        self.phase = _CALL
        self.call: ParsedCall | None = None
        self.args = GrowingText()
        self.keys: set[str] = set()
        self.arg_start = 0
        self.comma = False  # the last argument ended with a comma
        self.scanner = _ArgumentScanner()

    def _fail(self) -> None:
        self.valid = False

    def _add(self, fragment: str) -> None:
        assert self.call is not None
        self.args.append(fragment)
        self.call.end = len(self.args)

    def _argument(self, end: int, closer: str) -> None:
        """The argument ``text[arg_start:end]``, ended by ``closer``."""
        call = self.call
        assert call is not None
        raw = self.state.text[self.arg_start:end]
        if raw.strip():
            try:
                key, value = _keyword(raw)
            except ValueError:
                self._fail()
                return
            if key in self.keys:
                self._fail()
                return
            self.keys.add(key)
            self._add((", " if len(self.keys) > 1 else "") + json.dumps(key, ensure_ascii=False)
                      + ": " + json.dumps(value, ensure_ascii=False))
        elif closer == "," or (self.comma is False and self.keys):
            self._fail()  # an empty argument: "f(,)", "f(a=1,,b=2)"
            return
        self.comma = closer == ","
        self.arg_start = end + 1
        if closer == ")":
            self._add("}")
            call.complete = True
            self.state.settle(call)
            self.call, self.phase = None, _AFTER_CALL

    def advance(self) -> int | None:
        text = self.state.text
        while self.valid:
            if self.phase == _ARGS:
                closer, step = "", FIRST_CHUNK
                while not closer and self.pos < len(text):  # chunks: read up to the closer
                    end = min(len(text), self.pos + step)
                    chunk, base = text.window(self.pos, end)
                    stop, closer = self.scanner.scan(chunk, self.pos - base, end - base)
                    if base + stop == self.pos and not closer:
                        break  # held back (a quote or escape at the end): more text is needed
                    self.pos, step = base + stop, step * 2
                if not closer:
                    break
                if closer == "!":
                    self._fail()
                    return None
                self._argument(self.pos, closer)
                self.pos += 1
                continue
            self.pos, c = next_char(text, self.pos)
            if not c:
                break
            if self.phase == _CALL:
                ahead = _match_ahead(_NAME, text, self.pos)
                if ahead is None or ahead[2] not in ("", "("):
                    self._fail()
                    return None
                name, at, after = ahead
                if not after:
                    break  # the name, or the space after it, is still being written
                self.args, self.keys, self.comma = GrowingText(), set(), False
                self.call = ParsedCall(name, False, self.args, 0, 0)
                self._add("{")
                self.scanner = _ArgumentScanner()
                self.pos = self.arg_start = at + 1
                self.phase = _ARGS
            elif c == "]" and self.phase in (_AFTER_CALL, _AFTER_COMMA):
                return self.pos + 1
            elif c == "," and self.phase == _AFTER_CALL:
                self.pos, self.phase = self.pos + 1, _AFTER_COMMA
            elif self.phase == _AFTER_COMMA:
                self.phase = _CALL
            else:
                self._fail()
                return None
        if self.valid and self.call is not None:
            self.state.calls.append(self.call)
        return None


class _PythonicState(SectionedState):
    one_section = True

    def __init__(self) -> None:
        super().__init__()
        self.search = MarkerSearch(self.text, "[", 0)
        self.waiting = 0  # the characters from a "[" that may open a call list

    def find_section(self, pos: int) -> tuple[int, Section] | None:
        text = self.text
        while True:
            at = self.search.find()
            self.waiting = 0
            if at is None:
                return None
            ahead = _match_ahead(_LIST_START, text, at + 1)
            assert ahead is not None  # the pattern matches the empty string
            name, _, after = ahead
            if not after:
                self.waiting = len(text) - at  # "[", "[ get_wea": a call may follow
                return None
            if name and after == "(":
                return at, _CallList(self, at + 1)
            self.search = MarkerSearch(text, "[", at + 1)

    def held(self) -> int:
        return self.waiting


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def new_state(self) -> ToolParseState:
        return _PythonicState()
