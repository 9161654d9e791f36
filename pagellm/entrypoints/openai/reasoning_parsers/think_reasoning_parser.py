"""``<think>...</think>`` reasoning: the text inside the block is ``reasoning_content``, the
text after it ``content``. Like the tool parsers, ``parse`` reads the whole text so far and
answers with prefixes that will not change, so streaming and non-streaming agree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pagellm.entrypoints.openai.tool_parsers.partial_json import partial_marker_length

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass
class ParsedReasoning:
    reasoning: str | None  # None: the text has no reasoning block
    content: str


class ThinkReasoningParser:
    """``name``: the --reasoning-parser value. ``implicit_start``: the model thinks from its
    first token (the chat template opened the block, or the model never writes ``<think>``):
    everything before ``</think>`` is reasoning. Otherwise reasoning needs the text to open
    with ``<think>``, and text that does not is all content."""

    name: ClassVar[str]
    implicit_start: ClassVar[bool]

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        stripped = text.lstrip()
        if not final and len(stripped) < len(THINK_START) \
                and THINK_START.startswith(stripped):
            return ParsedReasoning(None, "")  # may still become <think>
        if stripped.startswith(THINK_START):
            body = stripped[len(THINK_START):]
        elif self.implicit_start:
            body = text
        else:
            return ParsedReasoning(None, text)
        end = body.find(THINK_END)
        if end < 0:
            held = 0 if final else partial_marker_length(body, THINK_END)
            return ParsedReasoning(body[:len(body) - held], "")
        return ParsedReasoning(body[:end], body[end + len(THINK_END):])


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3 (hybrid thinking): reasoning only when the answer opens with ``<think>``."""

    name = "qwen3"
    implicit_start = False


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1 (and thinking-only models whose template opens the block): everything up
    to ``</think>`` is reasoning; an answer that never closes the block is all reasoning."""

    name = "deepseek_r1"
    implicit_start = True
