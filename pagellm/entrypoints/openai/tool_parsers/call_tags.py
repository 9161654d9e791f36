"""Tool calls as xgrammar structural tags, in the model's own call format.

A --tool-call-parser whose calls are ``begin(name) arguments-JSON end`` has a CallTagFormat: a
forced ``tool_choice`` (``required`` or a named function) is then constrained to calls written
exactly as the model and its chat template write them (so the parser reads them and the
history the template renders matches what the model said), each call's arguments to its tool's
schema (as JSON, or as qwen3_coder's XML parameters, which xgrammar's ``qwen_xml`` style
writes). Parsers whose markers are special tokens (mistral, deepseek_*, kimi_k2) or whose calls
are Python (pythonic) have none: their forced calls stay bare JSON (forced_tool_parsers.py).

``tool_choice: auto`` is constrained only when the format has a plain-text ``trigger`` and a
tool asks for it with ``strict: true`` (OpenAI's field): free text until the trigger, then a
well-formed call of one of the tools (strict tools' arguments to their schema, the others' to
any object), then free text again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.openai.protocol_tools import ChatTool

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class CallTagFormat:
    """``head + name + middle`` (the name as a JSON string where ``json_name``), the
    arguments in ``style`` (xgrammar's json_schema style), ``end``; calls in a row are joined by
    ``separator``."""

    head: str
    middle: str
    end: str
    separator: str
    trigger: str | None = None  # the plain text every call starts with (auto); None: not auto
    json_name: bool = True
    style: str = "json"

    def begin(self, name: str) -> str:
        written = json.dumps(name, ensure_ascii=False) if self.json_name else name
        return self.head + written + self.middle

    def call_tag(self, tool: ChatTool, schema: dict[str, Any] | None = None) -> dict[str, Any]:
        params = schema if schema is not None else (tool.function.parameters or _ANY_OBJECT)
        content = {"type": "json_schema", "json_schema": params}
        if self.style != "json":
            content["style"] = self.style
        return {"type": "tag", "begin": self.begin(tool.function.name), "content": content,
                "end": self.end}

    def named(self, tool: ChatTool) -> dict[str, Any]:
        """Exactly one call of ``tool``."""
        return _structural_tag(self.call_tag(tool))

    def required(self, tools: list[ChatTool], max_calls: int | None) -> dict[str, Any]:
        """One or more calls (at most one when ``max_calls`` is 1), nothing else."""
        return _structural_tag({"type": "tags_with_separator",
                                "tags": [self.call_tag(t) for t in tools],
                                "separator": self.separator, "at_least_one": True,
                                "stop_after_first": max_calls == 1})

    def auto(self, tools: list[ChatTool], max_calls: int | None) -> dict[str, Any] | None:
        """Free text or well-formed calls, when a tool is strict and the format has a trigger;
        else None (the answer is not constrained)."""
        if self.trigger is None or not any(t.function.strict for t in tools):
            return None
        tags = [self.call_tag(t, None if t.function.strict else _ANY_OBJECT) for t in tools]
        return _structural_tag({"type": "triggered_tags", "triggers": [self.trigger],
                                "tags": tags, "stop_after_first": max_calls == 1})


def _structural_tag(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}


# By --tool-call-parser name. hermes: as chatml_tools and Qwen2.5/Qwen3's templates write calls
# (one block per call, a newline between blocks); llama3_json: as Llama 3.1's template writes
# one ("; " between calls, as vLLM's parser splits them), from the first character;
# qwen3_coder: as Qwen3-Coder's template writes calls (each parameter a <parameter=ARG> block).
CALL_TAG_FORMATS: dict[str, CallTagFormat] = {
    "hermes": CallTagFormat('<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>",
                            "\n", trigger="<tool_call>"),
    "llama3_json": CallTagFormat('{"name": ', ', "parameters": ', "}", "; "),
    "qwen3_coder": CallTagFormat("<tool_call>\n<function=", ">\n", "</function>\n</tool_call>",
                                 "\n", trigger="<tool_call>", json_name=False,
                                 style="qwen_xml"),
}


def call_tag_format(tool_call_parser: str | None) -> CallTagFormat | None:
    return CALL_TAG_FORMATS.get(tool_call_parser) if tool_call_parser else None
