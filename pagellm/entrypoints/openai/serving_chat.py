"""POST /v1/chat/completions: messages through the chat template, streaming or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, StreamingResponse

from pagellm.engine.async_llm import AsyncLLM, RequestStream
from pagellm.entrypoints.openai.chat_output import ChatReading, stream_reader
from pagellm.entrypoints.openai.chat_template_args import (
    TemplateArgsError,
    check_documents,
    check_template_kwargs,
)
from pagellm.entrypoints.openai.chat_tools import (
    ChatToolOptions,
    plan_tools,
    template_tool_fields,
)
from pagellm.entrypoints.openai.limits import ServerLimits
from pagellm.entrypoints.openai.prompt_logprobs import (
    plain_prompt_logprobs,
    shaped_prompt_logprobs,
)
from pagellm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from pagellm.entrypoints.openai.serving_engine import OpenAIServing, ServedModels, TokenizerPool
from pagellm.entrypoints.openai.serving_errors import bad_request
from pagellm.entrypoints.openai.streams import (
    SSE_DONE,
    final_outputs,
    merge_streams,
    sse,
    sse_error,
    stream_usage_modes,
)
from pagellm.entrypoints.openai.structured_request import (
    Constraint,
    constraint_errors,
    resolve_structured_outputs,
)
from pagellm.entrypoints.openai.templates import shipped_template, shipped_template_names
from pagellm.outputs import RequestOutput, SampleLogprobs
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.tracing import RequestTrace

_MIN_LOGPROB = -9999.0


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file path, the name of a template shipped with pagellm
    (``chatml_tools``), or the template text itself."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError:
        shipped = shipped_template(value)
        if shipped is not None:
            return shipped
        if any(c in value for c in "{}\n"):
            return value  # inline Jinja
        raise ValueError(f"--chat-template: cannot read the file {value!r} (nor is it one of "
                         f"the shipped templates: {', '.join(shipped_template_names())})."
                         ) from None


class ChatRenderer:
    """Messages -> prompt token ids with the tokenizer's (or --chat-template's) template."""

    def __init__(self, tokenizer: Any, chat_template: str | None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def template(self) -> str | None:
        """The template ``render`` applies: --chat-template, else the tokenizer's (its default
        one when it has several); None when there is none."""
        try:
            return self.tokenizer.get_chat_template(self.chat_template)
        except (AttributeError, ValueError):  # not a transformers tokenizer, or no template
            fallback = self.chat_template or getattr(self.tokenizer, "chat_template", None)
            return fallback if isinstance(fallback, str) else None

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False,
               tools: list[dict[str, Any]] | None = None,
               add_special_tokens: bool = False,
               template_kwargs: dict[str, Any] | None = None,
               documents: list[dict[str, Any]] | None = None) -> list[int]:
        """``template_kwargs`` and ``documents``: checked by chat_template_args.py first."""
        conversation = []
        for index, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise bad_request(f"Content parts of type {part.type!r} are not "
                                          "supported; only text.", "messages")
                    texts.append(part.text)
                content = "\n".join(texts)
            entry = {"role": m.role, "content": content or ""}
            if m.name:
                entry["name"] = m.name
            # An assistant turn's thinking (vLLM's field): the template decides whether to show
            # it (Qwen3's do after the last user turn, others drop it).
            reasoning = (m.model_extra or {}).get("reasoning_content")
            if isinstance(reasoning, str) and reasoning and m.role == "assistant":
                entry["reasoning_content"] = reasoning
            entry.update(template_tool_fields(m, index))
            conversation.append(entry)
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("This model has no chat template; start the server with "
                              "--chat-template FILE.", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, chat_template=self.chat_template, tokenize=False, tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, documents=documents,
                **(template_kwargs or {}))
        except Exception as e:  # Jinja errors (e.g. "roles must alternate") are the user's
            raise bad_request(f"Could not apply the chat template: {e}", "messages") from None
        # The template writes the special tokens (BOS...) itself, unless /tokenize asks for
        # the tokenizer's too (add_special_tokens, as vLLM).
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))


@dataclass
class RenderedChat:
    """A checked chat request, before anything starts: what /v1/chat/completions starts and
    /v1/chat/completions/render answers with."""

    model: str  # the served name to answer with
    params: SamplingParams
    prompt: dict[str, Any]  # prompt_token_ids (the rendered template), cache_salt
    constraint: Constraint | None  # the structured-output field, for its compile errors
    reading: ChatReading | None  # how the answer is parsed (tools, reasoning)


class OpenAIServingChat(OpenAIServing):
    request_id_prefix = "chatcmpl"

    def __init__(self, engine: AsyncLLM, models: ServedModels, renderer: ChatRenderer,
                 limits: ServerLimits | None = None,
                 tokenizer_pool: TokenizerPool | None = None,
                 tool_options: ChatToolOptions | None = None) -> None:
        super().__init__(engine, models, limits, tokenizer_pool)
        self.renderer = renderer
        self.tool_options = tool_options or ChatToolOptions()

    async def render(self, req: ChatCompletionRequest) -> RenderedChat:
        """Every check and the chat template of a request, starting nothing (one path for the
        real endpoint and /v1/chat/completions/render)."""
        model = self.models.check(req.model)
        max_tokens = req.max_completion_tokens or req.max_tokens
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_options,
                          self.limits)
        structured, constraint = resolve_structured_outputs(req, plan.constraint, self.limits)
        if req.prompt_logprobs is not None and req.stream:  # as vLLM
            raise bad_request("prompt_logprobs is not available when stream is true.",
                              "prompt_logprobs")
        params = self.sampling_params(req, max_tokens, num_logprobs, req.prompt_logprobs,
                                      structured_outputs=structured)
        # A strict auto plan's constraint allows free text (a reasoning block) before a call.
        free_text = plan.free_text and constraint is plan.constraint
        reading = ChatReading.for_request(plan, self.tool_options,
                                          structured is not None and not free_text)
        if plan.parser is not None and plan.parser.needs_special_tokens:
            params = params.clone(skip_special_tokens=False)  # the call marker is one
        try:
            template_kwargs = check_template_kwargs(req.chat_template_kwargs,
                                                    self.limits.max_chat_template_kwargs_bytes)
            documents = check_documents(req.documents, self.limits.max_documents)
        except TemplateArgsError as e:
            raise bad_request(str(e), e.param) from None
        # Rendering a long conversation is template work plus tokenization: off the loop.
        ids = await self.tokenizer_pool.run(self.renderer.render, req.messages,
                                            req.add_generation_prompt,
                                            req.continue_final_message, plan.template_tools,
                                            add_special_tokens=req.add_special_tokens,
                                            template_kwargs=template_kwargs,
                                            documents=documents)
        ids = self.truncated(ids, req.truncate_prompt_tokens)
        self.check_prompt(ids, max_tokens, "max_completion_tokens"
                          if req.max_completion_tokens else "max_tokens")
        prompt: dict = {"prompt_token_ids": ids}
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        self.check_prompt_logprobs([prompt], params, "prompt_logprobs")
        self.check_start(params, req.priority)
        return RenderedChat(model, params, prompt, constraint, reading)

    async def handle(self, req: ChatCompletionRequest, request_id: str,
                     trace: RequestTrace | None = None) -> JSONResponse | StreamingResponse:
        rendered = await self.render(req)
        model, reading = rendered.model, rendered.reading
        with constraint_errors(rendered.constraint):
            streams = await self.start(request_id, [rendered.prompt], rendered.params,
                                       req.stream, req.priority, req.cache_salt)
        if req.stream:
            return StreamingResponse(self._stream(req, request_id, model, streams[0], reading,
                                                  rendered.params, trace),
                                     media_type="text/event-stream")
        (out,) = await final_outputs(streams)
        choices, num_completion = [], 0
        echo = echoed_content(req)
        for c in out.outputs:
            num_completion += len(c.token_ids)
            logprobs = (self.chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0)
                        if req.logprobs else None)
            message, finish_reason = (reading.message(c.text, c.finish_reason) if reading
                                      else (ChatResponseMessage(content=c.text), c.finish_reason))
            if echo:
                message.content = echo + (message.content or "")
            choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                      finish_reason=finish_reason, stop_reason=c.stop_reason,
                                      token_ids=list(c.token_ids) if req.return_token_ids
                                      else None))
        self.finished(trace, out, rendered.params, model, num_completion)
        # --enable-per-request-metrics: vLLM's "metrics" object (null for n > 1).
        extra = ({"metrics": self.metrics_field([out], req.n, num_completion)}
                 if self.enable_per_request_metrics else {})
        num_prompt = len(out.prompt_token_ids)
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                          total_tokens=num_prompt + num_completion,
                          prompt_tokens_details=self.prompt_details(out.num_cached_tokens))

        body = ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage,
            prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None)
        if req.prompt_logprobs is None:
            return JSONResponse({**body.model_dump(), **extra})

        def build() -> dict:
            dumped = body.model_dump()
            dumped["prompt_logprobs"] = plain_prompt_logprobs(
                shaped_prompt_logprobs(out.prompt_logprobs, self.tokenizer))
            dumped.update(extra)
            return dumped

        return await self.respond(build)  # decoding the scored prompt: off the loop

    def chat_logprobs(self, token_ids: list[int], logprobs: SampleLogprobs,
                      top_n: int) -> ChatLogprobs:
        content = []
        for tid, entries in zip(token_ids, logprobs, strict=False):
            sampled = entries[tid]
            ranked = sorted(((lp.rank, t, lp) for t, lp in entries.items()
                             if lp.rank is not None and lp.rank <= top_n), key=lambda x: x[0])
            tops = []
            for _, t, lp in ranked[:top_n]:
                tok = self.token_str(t, lp.decoded_token)
                tops.append(TopLogprob(token=tok, logprob=max(lp.logprob, _MIN_LOGPROB),
                                       bytes=list(tok.encode("utf-8", errors="replace"))))
            tok = self.token_str(tid, sampled.decoded_token)
            content.append(ChatTokenLogprob(
                token=tok, logprob=max(sampled.logprob, _MIN_LOGPROB),
                bytes=list(tok.encode("utf-8", errors="replace")), top_logprobs=tops))
        return ChatLogprobs(content=content)

    def _chunk(self, request_id: str, created: int, model: str,
               choices: list[ChatStreamChoice], usage: UsageInfo | None = None,
               prompt_token_ids: list[int] | None = None,
               extra: dict[str, Any] | None = None) -> str:
        """``extra``: top-level fields to add (the last chunk's ``metrics``)."""
        data = ChatCompletionChunk(id=request_id, created=created, model=model,
                                   choices=choices, usage=usage,
                                   prompt_token_ids=prompt_token_ids).model_dump()
        data.update(extra or {})
        for choice in data["choices"]:  # OpenAI omits unset delta fields
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            for call in choice["delta"].get("tool_calls", ()):
                _drop_nones(call)
        return sse(data)

    async def _stream(self, req: ChatCompletionRequest, request_id: str, model: str,
                      stream: RequestStream, reading: ChatReading | None = None,
                      params: SamplingParams | None = None, trace: RequestTrace | None = None
                      ) -> AsyncIterator[str]:
        """``params``: the request's (for its span, with ``trace``)."""
        created = int(time.time())
        final_outs: list[RequestOutput] = []  # the last output, once it came
        # One parser state per choice (a reasoning block, a half-written call).
        readers = [stream_reader(reading) for _ in range(req.n)]
        num_completion = num_cached = 0
        num_prompt = len(stream.prompt_token_ids)
        usage_each_chunk, usage_at_end = stream_usage_modes(req.stream_options)

        def running_usage() -> UsageInfo | None:  # continuous_usage_stats: the counts so far
            return (self.usage(num_prompt, num_completion, num_cached) if usage_each_chunk
                    else None)

        try:
            # The first delta of every choice carries the role.
            for i in range(req.n):
                # return_token_ids: the prompt's ids come once, in the very first chunk.
                prompt_ids = (list(stream.prompt_token_ids)
                              if req.return_token_ids and i == 0 else None)
                yield self._chunk(request_id, created, model, [ChatStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=""))],
                    running_usage(), prompt_ids)
            echo = echoed_content(req)
            for i in range(req.n if echo else 0):  # as vLLM: one chunk per choice, up front
                yield self._chunk(request_id, created, model, [ChatStreamChoice(
                    index=i, delta=DeltaMessage(content=echo))], running_usage())
            async for _, out in merge_streams([stream]):
                num_cached = out.num_cached_tokens
                for c in out.outputs:
                    num_completion += len(c.token_ids)
                    delta, finish_reason = readers[c.index].feed(c.text, c.finish_reason)
                    has_delta = delta is not None and bool(
                        delta.content or delta.reasoning_content or delta.tool_calls)
                    # Tokens the parsers hold back still carry their ids (and logprobs).
                    if not (has_delta or finish_reason
                            or ((req.logprobs or req.return_token_ids) and c.token_ids)):
                        continue
                    logprobs = (self.chat_logprobs(c.token_ids, c.logprobs or [],
                                                   req.top_logprobs or 0)
                                if req.logprobs else None)
                    yield self._chunk(request_id, created, model, [ChatStreamChoice(
                        index=c.index, delta=delta or DeltaMessage(), logprobs=logprobs,
                        finish_reason=finish_reason, stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if req.return_token_ids else None)],
                        running_usage())
                if out.finished:
                    final_outs.append(out)
                    if params is not None:
                        self.finished(trace, out, params, model, num_completion)
            if usage_at_end:
                # --enable-per-request-metrics: in the usage chunk, as vLLM.
                extra = ({"metrics": self.metrics_field(final_outs, req.n, num_completion)}
                         if self.enable_per_request_metrics else None)
                yield self._chunk(request_id, created, model, [],
                                  self.usage(num_prompt, num_completion, num_cached),
                                  extra=extra)
        except Exception as e:
            yield sse_error(e, request_id)
        yield SSE_DONE


def echoed_content(req: ChatCompletionRequest) -> str:
    """echo (vLLM's): the last message's text when it has the answer's role (the assistant's
    with add_generation_prompt, else the last message's own), which starts every choice's
    content; "" otherwise."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    if last.role != role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(p.text for p in last.content if p.text is not None)


def _drop_nones(value: dict[str, Any]) -> None:
    """A streamed tool call's unset fields are left out, as OpenAI sends them."""
    for key in [k for k, v in value.items() if v is None]:
        del value[key]
    for v in value.values():
        if isinstance(v, dict):
            _drop_nones(v)
