"""POST /v1/responses (OpenAI's Responses API) on the chat path: the request becomes a chat
request (responses_input.py) that OpenAIServingChat renders and starts, the chat reading (tool
and reasoning parsers) reads the answer, and the answer becomes output items, whole or as
events (responses_stream.py). GET / DELETE /v1/responses/{id} and POST .../cancel serve the
response store (response_store.py), per tenant."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.engine.async_llm import RequestStream
from pagellm.entrypoints.openai.chat_output import ChatReading, stream_reader
from pagellm.entrypoints.openai.protocol import ChatResponseMessage
from pagellm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagellm.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagellm.entrypoints.openai.responses_input import (
    chat_request,
    output_message,
    responses_error,
)
from pagellm.entrypoints.openai.responses_output import (
    Outcome,
    ResponseShell,
    Seal,
    item_status,
    output_items,
    usage,
)
from pagellm.entrypoints.openai.responses_sealing import ReasoningSealer
from pagellm.entrypoints.openai.responses_stream import EventWriter, StreamedItems
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat, RenderedChat
from pagellm.entrypoints.openai.serving_errors import (
    OpenAIError,
    bad_request,
    describe_error,
    internal_error,
)
from pagellm.entrypoints.openai.streams import merge_streams
from pagellm.entrypoints.openai.structured_request import constraint_errors
from pagellm.entrypoints.openai.tenancy import TENANT_SCOPE_KEY
from pagellm.outputs import RequestOutput

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.tracing import RequestTrace

RESPONSES_PATH = "/v1/responses"
PROMPT_CACHE_KEY_ATTRIBUTE = "pagellm.responses.prompt_cache_key"
CLIENT_METADATA_ATTRIBUTE = "pagellm.responses.client_metadata"
_END = object()
# How a stream ends, by the response's status (OpenAI has no cancelled event).
_FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                 "cancelled": "response.incomplete"}


def tenant_of(raw_request: Request) -> str:
    """The caller's tenant identity (API keys), "" without keys."""
    return raw_request.scope.get(TENANT_SCOPE_KEY) or ""


def not_found(response_id: str, param: str | None = None, hint: str = "") -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.{hint}", param,
                       "not_found")


def request_attributes(req: ResponsesRequest) -> dict[str, str]:
    """The trace span's attributes of prompt_cache_key and client_metadata (the client's
    attribution: Codex sends its session, thread and turn ids)."""
    attributes = {f"{CLIENT_METADATA_ATTRIBUTE}.{k}": v
                  for k, v in (req.client_metadata or {}).items()}
    if req.prompt_cache_key is not None:
        attributes[PROMPT_CACHE_KEY_ATTRIBUTE] = req.prompt_cache_key
    return attributes


class Generation:
    """The engine's outputs of one response, pumped by a task of its own so that
    POST /v1/responses/{id}/cancel can stop it from another request."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = False
        self.task = asyncio.ensure_future(self._pump(streams))

    async def _pump(self, streams: list[RequestStream]) -> None:
        try:
            async for _, out in merge_streams(streams):  # leaving it aborts the request
                self.queue.put_nowait(out)
        except asyncio.CancelledError:
            pass  # cancelled (self.cancelled) or the response's reader left
        except Exception as e:
            self.queue.put_nowait(e)
        self.queue.put_nowait(_END)

    def cancel(self) -> None:
        self.cancelled = True
        self.task.cancel()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            while (item := await self.queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.task.cancel()  # the reader left (client gone): abort


@dataclass
class ResponseRun:
    """One response being made: the shell of its object, its generation, where it is stored."""

    serving: OpenAIServingResponses
    shell: ResponseShell
    rendered: RenderedChat
    conversation: list[dict[str, Any]]  # the store's: earlier turns and this input
    tenant: str
    generation: Generation
    num_input: int
    trace: RequestTrace | None
    seal: Seal = None  # include reasoning.encrypted_content
    done: bool = False
    # The in-progress record in the store (GET and cancel see it while this runs).
    pending: StoredResponse | None = None

    def read(self, text: str, finish_reason: str | None
             ) -> tuple[ChatResponseMessage, str | None]:
        reading: ChatReading | None = self.rendered.reading
        if reading is None:
            return ChatResponseMessage(content=text), finish_reason
        return reading.message(text, finish_reason)

    async def final(self) -> dict[str, Any]:
        """The non-streamed response object."""
        try:
            last = None
            async for out in self.generation.outputs():
                last = out
            cancelled = self.generation.cancelled
            if last is None:  # cancelled before the only (final) output
                return self.finish([], Outcome.of(None, True), 0, 0, 0)
            c = last.outputs[0]
            message, finish = self.read(c.text, c.finish_reason)
            self.serving.chat.finished(self.trace, last, self.rendered.params,
                                       self.rendered.model, len(c.token_ids))
            return self.finish(output_items(message, item_status(finish, cancelled), self.seal),
                               Outcome.of(finish, cancelled), len(c.token_ids),
                               last.num_cached_tokens,
                               await self.serving.count_tokens(message.reasoning_content))
        finally:
            self.abandon()

    async def events(self) -> AsyncIterator[str]:
        """The streamed response's events."""
        write = EventWriter()
        items = StreamedItems(write, self.seal)
        deltas = stream_reader(self.rendered.reading)
        num_output = num_cached = 0
        finish: str | None = None
        reasoning = ""
        try:
            yield write("response.created", response=self.shell.body("in_progress"))
            yield write("response.in_progress", response=self.shell.body("in_progress"))
            async for out in self.generation.outputs():
                c = out.outputs[0]
                num_output += len(c.token_ids)
                num_cached = out.num_cached_tokens
                delta, finish = deltas.feed(c.text, c.finish_reason)
                if delta is not None:
                    reasoning += delta.reasoning_content or ""
                    for event in items.feed(delta):
                        yield event
                if out.finished:
                    self.serving.chat.finished(self.trace, out, self.rendered.params,
                                               self.rendered.model, num_output)
            cancelled = self.generation.cancelled
            for event in items.close(item_status(finish, cancelled)):
                yield event
            outcome = Outcome.of(finish, cancelled)
            body = self.finish(items.items, outcome, num_output, num_cached,
                               await self.serving.count_tokens(reasoning))
            yield write(_FINAL_EVENTS[outcome.status], response=body)
        except Exception as e:
            if not isinstance(e, OpenAIError):
                e = internal_error(e, self.shell.id, "a streamed response")
            _, message, _ = describe_error(e)
            for event in items.close("incomplete"):
                yield event
            body = self.finish(items.items, Outcome("failed"), num_output, num_cached, 0,
                               error={"code": "server_error", "message": message})
            yield write("response.failed", response=body)
        finally:
            self.abandon()

    def finish(self, output: list[dict[str, Any]], outcome: Outcome, num_output: int,
               num_cached: int, num_reasoning: int,
               error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The finished response object, stored when the request asks."""
        self.done = True
        cached = num_cached if self.serving.chat.enable_prompt_tokens_details else 0
        # The reasoning text tokenized again may count more than were generated (a cut-off
        # answer's text, a tokenizer that merges differently): it is part of the output.
        num_reasoning = min(num_reasoning, num_output)
        body = self.shell.body(outcome.status, output,
                               usage(self.num_input, num_output, cached, num_reasoning),
                               outcome.incomplete_reason, error)
        # A response DELETEd while it ran stays deleted.
        if self.shell.store and not (self.pending is not None and self.pending.deleted):
            said = output_message(output)
            conversation = [*self.conversation, *([said] if said else [])]
            if not self.serving.store.put(self.tenant, StoredResponse(body, conversation)):
                body = {**body, "store": False}  # over the store's bounds alone
        return body

    def abandon(self) -> None:
        """The reader left before the end (client gone): the stored record says cancelled."""
        if not self.done:
            self.generation.cancel()
            self.finish([], Outcome("cancelled"), 0, 0, 0)


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore,
                 sealer: ReasoningSealer | None = None) -> None:
        self.chat = chat
        self.store = store
        self.sealer = sealer or ReasoningSealer()  # a key of its own per server start

    async def create(self, req: ResponsesRequest, raw_request: Request) -> Response:
        request_id, trace = self.chat.begin(raw_request)
        return await self.chat.guarded(
            self.handle(req, tenant_of(raw_request), request_id, trace), request_id)

    async def handle(self, req: ResponsesRequest, tenant: str, request_id: str,
                     trace: RequestTrace | None) -> Response:
        chat_req, conversation = chat_request(
            req, self.history(req, tenant), lambda value: self.sealer.open(tenant, value))
        if trace is not None:
            trace.attributes.update(request_attributes(req))
        try:
            rendered = await self.chat.render(chat_req)
            params = rendered.params
            with constraint_errors(rendered.constraint):
                streams = await self.chat.start(request_id, [rendered.prompt], params,
                                                bool(req.stream), 0, chat_req.cache_salt)
        except OpenAIError as e:
            raise responses_error(e) from None
        shell = ResponseShell.create(req, rendered.model, params.temperature, params.top_p,
                                     req.stored and self.store.max_entries > 0)
        generation = Generation(streams)
        seal = (lambda text: self.sealer.seal(tenant, text)) if req.seals_reasoning else None
        run = ResponseRun(self, shell, rendered, conversation, tenant, generation,
                          len(streams[0].prompt_token_ids), trace, seal)
        if shell.store:  # GET and cancel see it while it runs
            run.pending = StoredResponse(shell.body("in_progress"), conversation,
                                         cancel=generation.cancel)
            self.store.put(tenant, run.pending)
        if req.stream:
            return StreamingResponse(run.events(), media_type="text/event-stream")
        return JSONResponse(await run.final())

    def history(self, req: ResponsesRequest, tenant: str) -> list[dict[str, Any]]:
        """previous_response_id's conversation (its input and output), or nothing."""
        if req.previous_response_id is None:
            return []
        record = self.store.get(tenant, req.previous_response_id)
        if record is None:
            raise not_found(req.previous_response_id, "previous_response_id",
                            " It was never stored (store false), was deleted, or has left "
                            f"the store: {self.store.describe_bounds()}.")
        if record.in_progress:
            raise bad_request(f"previous_response_id '{req.previous_response_id}' is still in "
                              "progress.", "previous_response_id")
        return record.conversation

    async def count_tokens(self, text: str | None) -> int:
        """output_tokens_details.reasoning_tokens: the reasoning text's tokens."""
        if not text:
            return 0
        ids = await self.chat.tokenizer_pool.encode([text], add_special_tokens=False)
        return len(ids[0])

    def get(self, tenant: str, response_id: str) -> dict[str, Any]:
        record = self.store.get(tenant, response_id)
        if record is None:
            raise not_found(response_id)
        return record.response

    def delete(self, tenant: str, response_id: str) -> dict[str, Any]:
        record = self.store.get(tenant, response_id)
        if record is None:
            raise not_found(response_id)
        if record.cancel is not None and record.in_progress:
            record.cancel()
        self.store.delete(tenant, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def cancel(self, tenant: str, response_id: str) -> dict[str, Any]:
        """Stops an in-progress response (its request ends with what it has, status
        cancelled); a finished one is a 400, as OpenAI answers."""
        record = self.store.get(tenant, response_id)
        if record is None:
            raise not_found(response_id)
        status = record.response.get("status")
        if not record.in_progress or record.cancel is None:
            raise bad_request(f"Cannot cancel response '{response_id}': it is {status}; only "
                              "an in-progress response can be cancelled.", "response_id")
        record.cancel()
        return {**record.response, "status": "cancelled"}


def add_responses_routes(app: FastAPI, responses: OpenAIServingResponses) -> None:
    """GET / DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel (POST /v1/responses is
    api_server's, next to the other generation routes)."""

    @app.get(RESPONSES_PATH + "/{response_id}")
    async def retrieve_response(response_id: str, raw_request: Request) -> JSONResponse:
        return JSONResponse(responses.get(tenant_of(raw_request), response_id))

    @app.delete(RESPONSES_PATH + "/{response_id}")
    async def delete_response(response_id: str, raw_request: Request) -> JSONResponse:
        return JSONResponse(responses.delete(tenant_of(raw_request), response_id))

    @app.post(RESPONSES_PATH + "/{response_id}/cancel")
    async def cancel_response(response_id: str, raw_request: Request) -> JSONResponse:
        return JSONResponse(responses.cancel(tenant_of(raw_request), response_id))
