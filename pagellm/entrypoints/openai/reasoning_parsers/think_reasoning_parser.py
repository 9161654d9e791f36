"""``<think>...</think>`` reasoning: the text inside the block is ``reasoning_content``, the
text after it ``content``. A parser says how its models open the block; ReasoningStreamer
splits the text, streamed or whole, so streaming and non-streaming agree."""

from __future__ import annotations

from typing import ClassVar

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkReasoningParser:
    """``name``: the --reasoning-parser value. ``implicit_start``: the model thinks from its
    first token (the chat template opened the block, or the model never writes ``<think>``):
    everything before ``</think>`` is reasoning. Otherwise reasoning needs the text to open
    with ``<think>`` (after any whitespace), and text that does not is all content."""

    name: ClassVar[str]
    implicit_start: ClassVar[bool]


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3 (hybrid thinking): reasoning only when the answer opens with ``<think>``."""

    name = "qwen3"
    implicit_start = False


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1 (and thinking-only models whose template opens the block): everything up
    to ``</think>`` is reasoning; an answer that never closes the block is all reasoning."""

    name = "deepseek_r1"
    implicit_start = True
