"""``kimi_k2``: Kimi K2's tool calls, between its special tokens:
``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
{...}<|tool_call_end|>...<|tool_calls_section_end|>`` (the section tokens also in vLLM's
accepted singular spelling ``<|tool_call_section_begin|>``). The call's id is the
``functions.NAME:IDX`` the model wrote, as vLLM returns it (Kimi's template writes it back in
the history). Text outside the section is content; requests with tools keep special tokens."""

from __future__ import annotations

import re

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParseState,
)
from pagellm.entrypoints.openai.tool_parsers.token_sections import (
    TokenFormat,
    TokenSectionsState,
)

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_CALL_ID = re.compile(r"\s*((?:functions\.)?([^<\s:][^<\n]*?)):\d+\s*", re.DOTALL)


def _header(text: str) -> tuple[str, str] | None:
    """``functions.NAME:IDX`` -> (NAME, the whole id)."""
    match = _CALL_ID.fullmatch(text)
    if match is None:
        return None
    return match.group(2), text.strip()


KIMI_K2 = TokenFormat(SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, _header)


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    needs_special_tokens = True

    def new_state(self) -> ToolParseState:
        return TokenSectionsState(KIMI_K2)
