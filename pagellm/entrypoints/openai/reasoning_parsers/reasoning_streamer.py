"""Streaming reasoning: each new piece of text is split into the reasoning and the content it
adds. The streamer keeps only what is still undecided (the text before its first character
that is not whitespace, which may be ``<think>``'s start, and a tail that may be
``</think>``'s), so a piece costs its own length, not a re-read of the text so far. A
non-streaming answer is the same split, fed the whole text at once."""

from __future__ import annotations

from pagellm.entrypoints.openai.reasoning_parsers.think_reasoning_parser import (
    THINK_END,
    THINK_START,
    ThinkReasoningParser,
)
from pagellm.entrypoints.openai.tool_parsers.partial_json import partial_marker_length

_UNDECIDED, _REASONING, _CONTENT = range(3)


class ReasoningStreamer:
    def __init__(self, parser: ThinkReasoningParser) -> None:
        self.implicit_start = parser.implicit_start
        self.has_reasoning = False  # the text has a reasoning block (decided)
        self._phase = _UNDECIDED
        self._undecided: list[str] = []  # the text while it may still become <think>
        self._stripped = ""  # that text without its leading whitespace: a prefix of <think>
        self._held = ""  # reasoning held back: it may be the start of </think>
        self.scanned_chars = 0  # the characters read so far: the stream's work

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) that ``delta`` (and, when ``final``, the end of the text)
        adds."""
        self.scanned_chars += len(delta)
        if self._phase == _REASONING:
            return self._reason(delta, final)
        if self._phase == _CONTENT:
            return "", delta
        self._undecided.append(delta)
        stripped = self._stripped + delta if self._stripped else delta.lstrip()
        if not final and len(stripped) < len(THINK_START) and THINK_START.startswith(stripped):
            self._stripped = stripped
            return "", ""  # may still become <think>
        text = "".join(self._undecided)
        self._undecided.clear()
        if stripped.startswith(THINK_START):
            self._phase, self.has_reasoning = _REASONING, True
            return self._reason(stripped[len(THINK_START):], final)
        if self.implicit_start:
            self._phase, self.has_reasoning = _REASONING, True
            return self._reason(text, final)
        self._phase = _CONTENT
        return "", text

    def _reason(self, piece: str, final: bool) -> tuple[str, str]:
        window = self._held + piece
        self.scanned_chars += len(self._held)
        end = window.find(THINK_END)
        if end >= 0:
            self._phase, self._held = _CONTENT, ""
            return window[:end], window[end + len(THINK_END):]
        held = 0 if final else partial_marker_length(window, THINK_END)
        self._held = window[len(window) - held:]
        return window[:len(window) - held], ""


def extract_reasoning(parser: ThinkReasoningParser, text: str) -> tuple[str | None, str | None]:
    """The non-streaming answer: (reasoning_content, content); None where absent or empty."""
    streamer = ReasoningStreamer(parser)
    reasoning, content = streamer.feed(text, final=True)
    if not streamer.has_reasoning:
        return None, content
    return reasoning, content or None
