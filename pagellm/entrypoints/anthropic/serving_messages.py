"""POST /v1/messages and /v1/messages/count_tokens: a Messages request is translated into a chat
request and run through OpenAIServingChat's render and start (the same template, checks,
tools and parsers as /v1/chat/completions); the answer is translated back.

``thinking``: {type: enabled} needs --reasoning-parser (its reasoning becomes thinking blocks);
enabled / disabled set the template's ``enable_thinking`` when the template reads it; absent or
adaptive leaves the template's default. budget_tokens is checked as Anthropic checks it, and
the thinking is bounded by max_tokens only (the engine has no separate thinking budget)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagellm.engine.async_llm import RequestStream
from pagellm.entrypoints.anthropic.errors import event, sse_error_event
from pagellm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagellm.entrypoints.anthropic.stream import BlockEvents
from pagellm.entrypoints.anthropic.translate import (
    chat_request,
    content_blocks,
    message_id,
    stop_reason,
    usage,
)
from pagellm.entrypoints.openai.chat_output import stream_reader
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatResponseMessage
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat, RenderedChat
from pagellm.entrypoints.openai.serving_errors import bad_request
from pagellm.entrypoints.openai.streams import final_outputs, merge_streams
from pagellm.entrypoints.openai.structured_request import constraint_errors

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.tracing import RequestTrace

THINKING_TEMPLATE_VARIABLE = "enable_thinking"  # Qwen3's (and others') template switch
# The cache namespace of a request (api_server's scope_salt: the tenant's, plus any salt).
ScopeSalt = Callable[[ChatCompletionRequest, Request], None]


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat, scope_salt: ScopeSalt) -> None:
        self.chat = chat
        self.scope_salt = scope_salt

    def chat_request(self, req: CountTokensRequest, raw_request: Request
                     ) -> ChatCompletionRequest:
        chat_req = chat_request(req)
        thinking = req.thinking
        if thinking is not None and thinking.type == "enabled" \
                and self.chat.tool_options.reasoning_parser is None:
            raise bad_request("thinking needs a server started with --reasoning-parser (it "
                              "reads the model's thinking into thinking blocks).")
        if thinking is not None and thinking.type in ("enabled", "disabled") \
                and THINKING_TEMPLATE_VARIABLE in (self.chat.renderer.template() or ""):
            chat_req.chat_template_kwargs = {THINKING_TEMPLATE_VARIABLE:
                                             thinking.type == "enabled"}
        self.scope_salt(chat_req, raw_request)
        return chat_req

    async def count_tokens(self, req: CountTokensRequest, raw_request: Request
                           ) -> dict[str, Any]:
        rendered = await self.chat.render(self.chat_request(req, raw_request))
        return {"input_tokens": len(rendered.prompt["prompt_token_ids"])}

    async def create(self, req: MessagesRequest, raw_request: Request
                     ) -> JSONResponse | StreamingResponse:
        request_id, trace = self.chat.begin(raw_request)
        return await self.chat.guarded(self._create(req, raw_request, request_id, trace),
                                       request_id)

    async def _create(self, req: MessagesRequest, raw_request: Request, request_id: str,
                      trace: RequestTrace | None) -> JSONResponse | StreamingResponse:
        chat_req = self.chat_request(req, raw_request)
        rendered = await self.chat.render(chat_req)
        with constraint_errors(rendered.constraint):
            (stream,) = await self.chat.start(request_id, [rendered.prompt], rendered.params,
                                              req.stream, 0, chat_req.cache_salt)
        if req.stream:
            return StreamingResponse(self._stream(req, request_id, rendered, stream, trace),
                                     media_type="text/event-stream")
        (out,) = await final_outputs([stream])
        c = out.outputs[0]
        reading = rendered.reading
        message, finish = (reading.message(c.text, c.finish_reason) if reading
                           else (ChatResponseMessage(content=c.text), c.finish_reason))
        self.chat.finished(trace, out, rendered.params, rendered.model, len(c.token_ids))
        reason, sequence = stop_reason(finish, c.stop_reason, req.stop_sequences)
        return JSONResponse({
            "id": message_id(), "type": "message", "role": "assistant",
            "model": rendered.model, "content": content_blocks(message),
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(len(out.prompt_token_ids), len(c.token_ids),
                           self._cached(out.num_cached_tokens))})

    def _cached(self, num_cached: int) -> int | None:
        # Cached counts tell a tenant about others' prompts: only with the flag, as /v1/chat.
        return num_cached if self.chat.enable_prompt_tokens_details else None

    async def _stream(self, req: MessagesRequest, request_id: str, rendered: RenderedChat,
                      stream: RequestStream, trace: RequestTrace | None
                      ) -> AsyncIterator[str]:
        num_prompt = len(stream.prompt_token_ids)
        deltas = stream_reader(rendered.reading)
        blocks = BlockEvents()
        num_output, num_cached = 0, 0
        finish: str | None = None
        matched: int | str | None = None
        yield event("message_start", {"type": "message_start", "message": {
            "id": message_id(), "type": "message", "role": "assistant",
            "model": rendered.model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": usage(num_prompt, 0, None)}})
        yield event("ping", {"type": "ping"})
        try:
            async for _, out in merge_streams([stream]):
                c = out.outputs[0]
                num_output += len(c.token_ids)
                num_cached = out.num_cached_tokens
                delta, c_finish = deltas.feed(c.text, c.finish_reason)
                if delta is not None:
                    for e in blocks.feed(delta):
                        yield e
                if c_finish is not None:
                    finish, matched = c_finish, c.stop_reason
                if out.finished:
                    self.chat.finished(trace, out, rendered.params, rendered.model,
                                       num_output)
            for e in blocks.close():
                yield e
            reason, sequence = stop_reason(finish, matched, req.stop_sequences)
            yield event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage(num_prompt, num_output, self._cached(num_cached))})
            yield event("message_stop", {"type": "message_stop"})
        except Exception as e:
            yield sse_error_event(e, request_id)
