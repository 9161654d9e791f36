"""Streaming reasoning: each new piece of text is parsed with what came before and split into
the reasoning and the content it adds."""

from __future__ import annotations

from pagellm.entrypoints.openai.reasoning_parsers.think_reasoning_parser import (
    ThinkReasoningParser,
)


class ReasoningStreamer:
    def __init__(self, parser: ThinkReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.num_reasoning_chars = 0
        self.num_content_chars = 0

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) that ``delta`` adds."""
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        reasoning = (parsed.reasoning or "")[self.num_reasoning_chars:]
        content = parsed.content[self.num_content_chars:]
        self.num_reasoning_chars += len(reasoning)
        self.num_content_chars += len(content)
        return reasoning, content


def extract_reasoning(parser: ThinkReasoningParser, text: str) -> tuple[str | None, str | None]:
    """The non-streaming answer: (reasoning_content, content); None where absent or empty."""
    parsed = parser.parse(text, final=True)
    return parsed.reasoning, (parsed.content or None) if parsed.reasoning is not None \
        else parsed.content
