"""The Responses API's output items and response object (the openai SDK's
types/responses/ are the wire schema), built from what the chat reading made of the text."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.openai.protocol import ChatResponseMessage
from pagellm.entrypoints.openai.protocol_responses import ResponsesRequest


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_id() -> str:
    return item_id("resp")


def message_item(text: str, status: str, id_: str | None = None) -> dict[str, Any]:
    return {"id": id_ or item_id("msg"), "type": "message", "role": "assistant",
            "status": status, "content": [output_text_part(text)]}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


# include reasoning.encrypted_content: the text -> the item's encrypted_content (a tenant's
# ReasoningSealer.seal); None: the item has none.
Seal = Callable[[str], str] | None


def reasoning_item(text: str, status: str, id_: str | None = None, seal: Seal = None
                   ) -> dict[str, Any]:
    item = {"id": id_ or item_id("rs"), "type": "reasoning", "summary": [],
            "content": [reasoning_text_part(text)], "status": status}
    if seal is not None:
        item["encrypted_content"] = seal(text)
    return item


def reasoning_text_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def function_call_item(call_id: str, name: str, arguments: str, status: str,
                       id_: str | None = None) -> dict[str, Any]:
    return {"id": id_ or item_id("fc"), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def output_items(message: ChatResponseMessage, status: str, seal: Seal = None
                 ) -> list[dict[str, Any]]:
    """Reasoning, then the text, then the calls, each when there is some; an answer with
    nothing in it is an empty message (as a stream ends). ``status`` is the last item's (the
    one a cut answer cut); the ones before it were complete."""
    items = []
    if message.reasoning_content:
        items.append(reasoning_item(message.reasoning_content, "completed", seal=seal))
    if message.content or not (items or message.tool_calls):
        items.append(message_item(message.content or "", "completed"))
    items.extend(function_call_item(c.id, c.function.name, c.function.arguments, "completed")
                 for c in message.tool_calls)
    items[-1]["status"] = status
    return items


def item_status(finish_reason: str | None, cancelled: bool) -> str:
    return "completed" if finish_reason in ("stop", "tool_calls") and not cancelled \
        else "incomplete"


@dataclass
class Outcome:
    """How a response ended: its status and incomplete_details."""

    status: str
    incomplete_reason: str | None = None

    @classmethod
    def of(cls, finish_reason: str | None, cancelled: bool) -> Outcome:
        if cancelled:
            return cls("cancelled")
        if finish_reason == "length":
            return cls("incomplete", "max_output_tokens")
        return cls("completed")


def usage(num_input: int, num_output: int, num_cached: int, num_reasoning: int
          ) -> dict[str, Any]:
    return {"input_tokens": num_input, "output_tokens": num_output,
            "total_tokens": num_input + num_output,
            "input_tokens_details": {"cached_tokens": num_cached},
            "output_tokens_details": {"reasoning_tokens": num_reasoning}}


@dataclass
class ResponseShell:
    """The fields of a response that its request and sampling parameters fix (echoed, as
    OpenAI does); ``body`` adds what the generation made."""

    id: str
    created_at: int
    model: str
    req: ResponsesRequest
    temperature: float
    top_p: float
    store: bool

    @classmethod
    def create(cls, req: ResponsesRequest, model: str, temperature: float, top_p: float,
               store: bool) -> ResponseShell:
        return cls(response_id(), int(time.time()), model, req, temperature, top_p, store)

    def body(self, status: str, output: list[dict[str, Any]] | None = None,
             usage_: dict[str, Any] | None = None, incomplete_reason: str | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        tools = [{"type": "function", "name": t["name"], "description": t.get("description"),
                  "parameters": t.get("parameters"), "strict": t.get("strict")}
                 for t in req.tools or []]
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": error,
            "incomplete_details": ({"reason": incomplete_reason} if incomplete_reason
                                   else None),
            "instructions": req.instructions, "model": self.model,
            "output": output or [], "usage": usage_,
            "tools": tools, "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": self.temperature, "top_p": self.top_p,
            "max_output_tokens": req.max_output_tokens,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "previous_response_id": req.previous_response_id,
            "metadata": req.metadata or {}, "store": self.store, "user": req.user,
            "truncation": "disabled", "prompt_cache_key": req.prompt_cache_key,
        }
