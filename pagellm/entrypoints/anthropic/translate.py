"""A Messages request -> the chat request that OpenAIServingChat renders and starts, and a chat
answer -> Anthropic's content blocks and stop_reason.

History: a user message's ``tool_result`` blocks become ``tool`` messages (an ``is_error``
result's text is prefixed with "Error: ", the only way a chat template can tell), ``tool_use``
blocks the assistant's tool_calls; ``thinking`` / ``redacted_thinking`` blocks of earlier turns
are left out of the prompt, as Anthropic leaves them out of the context. A last assistant
message is a prefill: the answer continues it."""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, ValidationError

from pagellm.entrypoints.anthropic.errors import validation_message
from pagellm.entrypoints.anthropic.protocol import (
    BLOCK_MODELS,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
)
from pagellm.entrypoints.openai.chat_output import TOOL_CALLS_FINISH
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatResponseMessage
from pagellm.entrypoints.openai.serving_errors import bad_request

THINKING_SIGNATURE = ""  # pagellm does not sign thinking (and checks no signature sent back)
TOOL_ERROR_PREFIX = "Error: "


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex}"


def _check(model: type[BaseModel], value: Any, where: str) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise bad_request(validation_message(list(e.errors()), where)) from None


def _block(value: Any, where: str) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    model = BLOCK_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise bad_request(f"{where}.type: content blocks of type {kind!r} are not supported by "
                          f"this server; it takes {', '.join(BLOCK_MODELS)}.")
    return _check(model, value, where)


def _texts(blocks: str | list[Any] | None, where: str) -> str:
    """System prompts and tool results: a string or text blocks, joined by newlines."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    texts = []
    for j, value in enumerate(blocks):
        kind = value.get("type") if isinstance(value, dict) else None
        if kind != "text":
            raise bad_request(f"{where}.{j}.type: only text blocks are supported here, got "
                              f"{kind!r}.")
        texts.append(_check(TextBlock, value, f"{where}.{j}").text)
    return "\n".join(texts)


def _user_messages(content: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks in order: runs of text -> user messages, results -> tool ones."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, value in enumerate(content):
        block = _block(value, f"{where}.{j}")
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            text = _texts(block.content, f"{where}.{j}.content")
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": TOOL_ERROR_PREFIX + text if block.is_error else text})
        else:
            raise bad_request(f"{where}.{j}.type: {block.type} blocks belong to assistant "
                              "messages.")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_message(content: list[Any], where: str) -> dict[str, Any]:
    texts, calls = [], []
    for j, value in enumerate(content):
        block = _block(value, f"{where}.{j}")
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
        elif isinstance(block, ToolResultBlock):
            raise bad_request(f"{where}.{j}.type: tool_result blocks belong to user messages.")
        # thinking / redacted_thinking: not part of the context (see the module docstring)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, value in enumerate(tools):
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise bad_request(f"tools.{i}.type: server tools ({kind!r}) are not supported by "
                              "this server; only client tools (name, description, "
                              "input_schema).")
        tool = _check(Tool, value, f"tools.{i}")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request of ``req`` (a MessagesRequest, or count_tokens' request), validated
    by ChatCompletionRequest itself."""
    messages: list[dict[str, Any]] = []
    system = _texts(req.system, "system")
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages.extend(_user_messages(m.content, where))
        else:
            messages.append(_assistant_message(m.content, where))
    prefill = req.messages[-1].role == "assistant"
    body: dict[str, Any] = {"model": req.model, "messages": messages,
                            "add_generation_prompt": not prefill,
                            "continue_final_message": prefill}
    tools = _tools(req.tools)
    if tools is not None:
        body["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if choice.type == "tool"
                               else {"auto": "auto", "any": "required", "none": "none"}[
                                   choice.type])
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        body["stream"] = req.stream
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        # Only what was sent: an absent field takes the model's generation_config default.
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise bad_request(validation_message(list(e.errors()))) from None


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    # A call cut short (max_tokens) has no complete arguments: Anthropic's input is an object.
    return value if isinstance(value, dict) else {}


def content_blocks(message: ChatResponseMessage) -> list[dict[str, Any]]:
    """The answer's blocks: thinking, then text, then tool_use (the order the model wrote
    them in: the reasoning parser reads a leading block, the tool parser trailing calls)."""
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content,
                       "signature": THINKING_SIGNATURE})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        blocks.append({"type": "tool_use", "id": tool_use_id(), "name": call.function.name,
                       "input": _tool_input(call.function.arguments)})
    return blocks


def stop_reason(finish_reason: str | None, matched: int | str | None,
                stop_sequences: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish_reason and the engine's stop_reason (the
    stop string matched, a stop token id, or None for EOS)."""
    if finish_reason == TOOL_CALLS_FINISH:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason is None:
        return None, None
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


def usage(num_prompt: int, num_output: int, num_cached: int | None) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the cache.
    ``num_cached``: None unless the server reports cached tokens
    (--enable-prompt-tokens-details): otherwise every prompt token counts as input."""
    cached = num_cached or 0
    return {"input_tokens": num_prompt - cached, "output_tokens": num_output,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
