"""A Responses API request -> the chat completion request it means: input items -> messages,
flat function tools -> chat tools, tool_choice, text.format -> response_format. The chat
endpoint's render then makes every check and the prompt (one path for both endpoints)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagellm.entrypoints.openai.serving_errors import OpenAIError, bad_request

_ROLES = {"user": "user", "system": "system", "assistant": "assistant",
          # Chat templates know no "developer" role; OpenAI treats it as the system's.
          "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# The chat request's fields that have other names here (for the errors the chat path raises).
CHAT_TO_RESPONSES_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                            "response_format": "text"}


def responses_error(error: OpenAIError) -> OpenAIError:
    """An error of the chat path, naming this request's field instead of the chat one."""
    name = CHAT_TO_RESPONSES_FIELDS.get(error.param or "")
    if name is None:
        return error
    message = error.message.replace(error.param or "", name)
    return OpenAIError(error.status, message, name, error.code, error.headers)


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts.", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            texts.append(str(part.get("refusal", "")))
            continue
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}] has type {kind!r}; only text parts "
                              f"({', '.join(_TEXT_PARTS)}) are supported.", "input")
        texts.append(part["text"])
    return "\n".join(texts)


# An encrypted_content -> the reasoning it carries, None when this server did not seal it for
# the caller (responses_sealing.py).
Unseal = Callable[[str], str | None]


def reasoning_text(item: dict[str, Any], where: str, unseal: Unseal | None) -> str:
    """A reasoning item's text: its encrypted_content's (checked), else its content's, else its
    summary's."""
    sealed = item.get("encrypted_content")
    if sealed is not None:
        text = unseal(sealed) if unseal is not None and isinstance(sealed, str) else None
        if text is None:
            raise bad_request(f"{where}.encrypted_content was not made by this server for this "
                              "API key: it is altered, another key's, or from before the "
                              "server restarted.", f"{where}.encrypted_content")
        return text
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and p.get("type") == part_type
                and isinstance(p.get("text"), str) for p in parts):
            raise bad_request(f"{where}.{key} must be a list of {part_type} parts.", "input")
        if parts:
            return "\n".join(p["text"] for p in parts)
    return ""


def input_messages(input_: str | list[dict[str, Any]], unseal: Unseal | None = None
                   ) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive function_call items become one assistant message
    (joined to the assistant text before them), function_call_output items tool messages.
    A reasoning item becomes the reasoning_content of the assistant message that follows it
    (the chat template decides whether a turn's thinking is shown)."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    messages: list[dict[str, Any]] = []
    thinking: list[str] = []  # reasoning items not yet given to an assistant message

    def think(message: dict[str, Any]) -> None:
        if thinking:
            message["reasoning_content"] = "\n".join(
                [*filter(None, [message.get("reasoning_content")]), *thinking])
            thinking.clear()

    for i, item in enumerate(input_):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind != "reasoning" and thinking and not (
                kind == "function_call" or item.get("role") == "assistant"):
            messages.append({"role": "assistant", "content": ""})  # a turn of thinking only
            think(messages[-1])
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}.", "input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
            if role == "assistant":
                think(messages[-1])
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where} (function_call) needs {key} as a string.",
                                      "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            think(messages[-1])
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where} (function_call_output) needs call_id.", "input")
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            thinking.append(reasoning_text(item, where, unseal))
        else:
            raise bad_request(f"{where} has type {kind!r}; supported item types are message, "
                              "function_call, function_call_output and reasoning.", "input")
    if thinking:
        messages.append({"role": "assistant", "content": ""})
        think(messages[-1])
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat function tools -> chat tools; other tool types (built-in tools) are refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}] has type {tool.get('type')!r}; only function tools "
                              "are supported.", "tools")
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}] needs a name.", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", "
                      "\"name\": ...}.", "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` -> the chat request's response_format (None: plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format of type json_schema needs schema (an object).",
                              "text")
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict")
                if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request("text.format.type must be text, json_schema or json_object.", "text")


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]],
                 unseal: Unseal | None = None
                 ) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """(the chat request, this turn's conversation without the instructions: ``history`` (the
    previous response's conversation) plus this input, what the store keeps). ``unseal``: the
    caller's reader of reasoning items' encrypted_content."""
    conversation = [*history, *input_messages(req.input, unseal)]
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions
                else []) + conversation
    if not messages:
        raise bad_request("input must not be empty.", "input")
    tool_choice = chat_tool_choice(req.tool_choice)
    # A forced call (required, or a named function) answers with calls only: text.format,
    # which shapes a text answer, has nothing to shape (the call's constraint rules).
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": bool(req.stream),
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "tools": chat_tools(req.tools),
        "tool_choice": tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": None if forced else response_format(req.text),
        "cache_salt": req.cache_salt}
    try:
        chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        param = CHAT_TO_RESPONSES_FIELDS.get(loc[0], loc[0]) if loc else None
        raise bad_request(f"{param or 'request'}: {err.get('msg', 'invalid value')}",
                          param) from None
    return chat, conversation


def output_message(output: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A response's output items as the assistant message the next turn's prompt shows (None:
    nothing to show)."""
    texts, calls, thinking = [], [], []
    for item in output:
        if item["type"] == "reasoning":
            thinking.extend(part["text"] for part in item["content"])
        elif item["type"] == "message":
            texts.extend(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    if not texts and not calls:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def dumps_size(value: Any) -> int:
    """Bytes of ``value`` as JSON (what the store counts)."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
