"""What a chat request's tools and tool_choice mean for the prompt, the constraint and the
reading of the answer (vLLM's rules):

- ``none``: no call is read from the answer (the tools still reach the chat template unless
  --exclude-tools-when-tool-choice-none).
- ``auto`` (the default when tools are given): the model decides; the answer is read with
  --tool-call-parser, which needs --enable-auto-tool-choice (else a 400). With a ``strict``
  tool and a parser whose format has a trigger, it is constrained to free text or well-formed
  calls (tool_parsers/call_tags.py).
- ``required``: the answer is constrained to one or more calls, of the tools (at most one with
  parallel_tool_calls false): in the parser's own format where it has a CallTagFormat, else a
  JSON array of ``{"name", "parameters"}`` objects.
- ``{"type": "function", "function": {"name": N}}``: the answer is constrained to one call of N,
  its arguments to N's parameters schema: in the parser's format where it has a CallTagFormat,
  else the bare arguments object."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagellm.entrypoints.openai.limits import ServerLimits
from pagellm.entrypoints.openai.protocol_tools import ChatTool, NamedToolChoice
from pagellm.entrypoints.openai.serving_errors import bad_request
from pagellm.entrypoints.openai.structured_request import Constraint, check_spec_caps
from pagellm.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.call_tags import call_tag_format
from pagellm.entrypoints.openai.tool_parsers.forced_tool_parsers import (
    NamedFunctionParser,
    RequiredToolsParser,
)

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.protocol import ChatMessage

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ChatToolOptions:
    """The server's tool-calling and reasoning flags."""

    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    tool_call_parser: str | None = None  # --tool-call-parser
    reasoning_parser: str | None = None  # --reasoning-parser
    exclude_tools_when_tool_choice_none: bool = False  # --exclude-tools-when-tool-choice-none

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser.")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up
        if self.reasoning_parser is not None:
            from pagellm.entrypoints.openai.reasoning_parsers import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)


@dataclass
class ToolPlan:
    template_tools: list[dict[str, Any]] | None  # the chat template's ``tools``
    constraint: Constraint | None  # required / named (strict auto): what the answer must match
    parser: ToolParser | None  # how the answer is read; None: plain content
    max_calls: int | None  # 1 with parallel_tool_calls false
    # The constraint lets free text come before a call (auto's), a reasoning block included.
    free_text: bool = False


def plan_tools(tools: list[ChatTool] | None, tool_choice: str | NamedToolChoice | None,
               parallel_tool_calls: bool | None, options: ChatToolOptions,
               limits: ServerLimits | None = None) -> ToolPlan:
    """``limits``: --max-tools, and the structured-output caps on the tools' parameters that a
    forced tool_choice compiles (counted together, before the schema is built)."""
    tools = tools or []
    limits = limits or ServerLimits()
    if len(tools) > limits.max_tools:
        raise bad_request(f"tools has {len(tools)} tools, more than {limits.max_tools} "
                          "(--max-tools).", "tools")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    max_calls = 1 if parallel_tool_calls is False else None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: two tools have the same function name.", "tools")
    template_tools = [t.model_dump(exclude_none=True) for t in tools] or None
    if tool_choice == "none":
        if options.exclude_tools_when_tool_choice_none:
            template_tools = None
        return ToolPlan(template_tools, None, None, max_calls)
    if not tools:
        if tool_choice == "auto":
            return ToolPlan(None, None, None, max_calls)  # nothing to call
        raise bad_request("tool_choice needs tools: the request has none.", "tool_choice")
    if tool_choice == "auto":
        if not options.enable_auto_tool_choice or options.tool_call_parser is None:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set.", "tool_choice")
        parser = get_tool_parser(options.tool_call_parser).for_tools(tools)
        tags = call_tag_format(options.tool_call_parser)
        auto = tags.auto(tools, max_calls) if tags is not None else None
        if auto is None:
            return ToolPlan(template_tools, None, parser, max_calls)
        check_spec_caps("json", [t.function.parameters for t in tools], "tools", limits)
        # optional: a response_format the request has wins (the calls are then read as before).
        return ToolPlan(template_tools, Constraint("tools", "structural_tag", auto, optional=True),
                        parser, max_calls, free_text=True)
    # A forced call in the parser's own format, where it has one; else bare JSON.
    tags = call_tag_format(options.tool_call_parser)
    if tool_choice == "required":
        check_spec_caps("json", [t.function.parameters for t in tools], "tools", limits)
        if tags is not None:
            assert options.tool_call_parser is not None
            return ToolPlan(template_tools, Constraint("tool_choice", "structural_tag",
                                                       tags.required(tools, max_calls)),
                            get_tool_parser(options.tool_call_parser).for_tools(tools),
                            max_calls)
        schema = required_tools_schema(tools, max_calls)
        return ToolPlan(template_tools, Constraint("tool_choice", "json", schema),
                        RequiredToolsParser(), max_calls)
    assert isinstance(tool_choice, NamedToolChoice)
    name = tool_choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the "
                          "tools.", "tool_choice")
    schema = tool.function.parameters or _ANY_OBJECT
    check_spec_caps("json", [schema], "tools", limits)
    if tags is not None:
        assert options.tool_call_parser is not None
        return ToolPlan(template_tools, Constraint("tool_choice", "structural_tag",
                                                   tags.named(tool)),
                        get_tool_parser(options.tool_call_parser).for_tools(tools), max_calls)
    return ToolPlan(template_tools, Constraint("tool_choice", "json", schema),
                    NamedFunctionParser(name), max_calls)


def required_tools_schema(tools: list[ChatTool], max_calls: int | None) -> dict[str, Any]:
    """An array of calls, each ``{"name": <one tool's name>, "parameters": <its schema>}``.
    The tools' ``$defs`` move to the top, where their ``#/$defs/...`` references point."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = copy.deepcopy(tool.function.parameters) if tool.function.parameters \
            else dict(_ANY_OBJECT)
        if not isinstance(params.get("$defs", {}), dict):
            raise bad_request(f"tools: {tool.function.name}'s $defs must be an object.", "tools")
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise bad_request(f"tools: two tools define $defs/{key} differently.", "tools")
            defs[key] = value
        variants.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": params},
            "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def template_tool_fields(message: ChatMessage, index: int) -> dict[str, Any]:
    """A history message's tool_calls and tool_call_id as the chat template gets them: the
    calls' arguments as dicts (OpenAI sends JSON text; templates write them with tojson)."""
    fields: dict[str, Any] = {}
    if message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            arguments = call.function.arguments
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except ValueError:
                    raise bad_request(f"messages[{index}].tool_calls[{j}].function.arguments "
                                      "is not valid JSON.", "messages") from None
            entry: dict[str, Any] = {"type": "function", "function": {
                "name": call.function.name, "arguments": arguments}}
            if call.id is not None:
                entry["id"] = call.id
            calls.append(entry)
        fields["tool_calls"] = calls
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    return fields
