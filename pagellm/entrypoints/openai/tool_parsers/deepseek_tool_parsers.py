"""``deepseek_v3`` and ``deepseek_v31``: DeepSeek's tool calls, between its special tokens (with
fullwidth bars ``｜`` and the ``▁`` word mark, as in its tokenizer). V3 (and R1):
``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
<｜tool▁call▁end｜>`` per call, then ``<｜tool▁calls▁end｜>``; V3.1 (and later):
``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``. Text outside the section is
content. Requests with tools keep special tokens in the text, so the markers stay."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParseState,
)
from pagellm.entrypoints.openai.tool_parsers.token_sections import (
    TokenFormat,
    TokenSectionsState,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"


def _plain_name(text: str) -> str | None:
    name = text.strip()
    return name if name and "\n" not in name and "<" not in name else None


def _v3_header(text: str) -> tuple[str, None] | None:
    """``function<｜tool▁sep｜>NAME`` (the text before the ```json fence)."""
    kind, sep, rest = text.partition(SEP)
    name = _plain_name(rest) if sep and kind.strip() else None
    return (name, None) if name else None


def _v31_header(text: str) -> tuple[str, None] | None:
    name = _plain_name(text)
    return (name, None) if name else None


V3 = TokenFormat((CALLS_BEGIN,), (CALLS_END,), CALL_BEGIN, FENCE + "json", CALL_END, _v3_header,
                 args_suffix=FENCE)
V31 = TokenFormat((CALLS_BEGIN,), (CALLS_END,), CALL_BEGIN, SEP, CALL_END, _v31_header)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    needs_special_tokens = True

    def new_state(self) -> ToolParseState:
        return TokenSectionsState(V3)


class DeepSeekV31ToolParser(ToolParser):
    name = "deepseek_v31"
    needs_special_tokens = True

    def new_state(self) -> ToolParseState:
        return TokenSectionsState(V31)
