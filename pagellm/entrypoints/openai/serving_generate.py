"""vLLM's token-in/token-out endpoint ``POST /inference/v1/generate``: a GenerateRequest (what
the render endpoints answer with) runs as a /v1/completions request on a token-id prompt, through
the same checks, limits and engine call (OpenAIServingCompletion.render and start), and answers
with token ids only (vLLM's GenerateResponse, or GenerateStreamResponse chunks then [DONE])."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.engine.async_llm import RequestStream
from pagellm.engine.output_processor import logprob_entry
from pagellm.entrypoints.openai.prompt_logprobs import (
    MIN_LOGPROB,
    PlainPromptLogprobs,
    plain_prompt_logprobs,
    shaped_prompt_logprobs,
)
from pagellm.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionRequest,
    TopLogprob,
    UsageInfo,
)
from pagellm.entrypoints.openai.protocol_generate import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    GenerateSamplingParams,
    GenerateStreamResponse,
)
from pagellm.entrypoints.openai.request_ids import REQUEST_ID_HEADER, REQUEST_ID_SCOPE_KEY
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_errors import OpenAIError, bad_request
from pagellm.entrypoints.openai.streams import (
    SSE_DONE,
    final_outputs,
    merge_streams,
    sse,
    sse_error,
    stream_usage_modes,
)
from pagellm.entrypoints.openai.structured_request import constraint_errors
from pagellm.outputs import CompletionOutput, RawPromptLogprobs
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.tracing import RequestTrace

# The SamplingParams fields a /v1/completions request takes under the same names.
_COMPLETION_FIELDS = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                      "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
                      "prompt_logprobs", "skip_special_tokens", "include_stop_str_in_output",
                      "structured_outputs", "logit_bias", "bad_words", "allowed_token_ids",
                      "truncate_prompt_tokens")


def completion_request(req: GenerateRequest) -> CompletionRequest:
    """The /v1/completions request that runs ``req``: every sampling field set explicitly (an
    absent one is vLLM's SamplingParams default, not the model's generation config: a render
    already resolved those), ``max_tokens`` null when absent (the rest of the context, as
    vLLM's endpoint). Built without CompletionRequest's validators: the GenerateRequest model
    checked the types, and render checks every value (SamplingParams), naming the field."""
    sp = req.sampling_params
    fields: dict[str, Any] = {name: getattr(sp, name) for name in _COMPLETION_FIELDS}
    fields.update(prompt=list(req.token_ids), model=req.model, stream=bool(req.stream),
                  stream_options=req.stream_options, cache_salt=req.cache_salt,
                  priority=req.priority, echo=False, add_special_tokens=False,
                  vllm_xargs=sp.extra_args)
    return CompletionRequest.model_construct(**fields)


def generate_param(param: str | None, id_from_header: bool) -> str | None:
    """A completions error's ``param`` as this endpoint's field."""
    if param is None:
        return None
    if param == "prompt":
        return "token_ids"
    if param == "X-Request-Id" and not id_from_header:
        return "request_id"
    if param.split(".", 1)[0] in GenerateSamplingParams.model_fields:
        return f"sampling_params.{param}"
    return param


def generate_error(e: OpenAIError, id_from_header: bool) -> OpenAIError:
    param = generate_param(e.param, id_from_header)
    if param == e.param:
        return e
    message = e.message.replace("X-Request-Id", "request_id") if param == "request_id" \
        else e.message
    return OpenAIError(e.status, message, param, e.code, e.headers)


def with_detokenize(params: SamplingParams, detokenize: bool) -> SamplingParams:
    """``sampling_params.detokenize``: false runs without any decoding (ids only)."""
    if detokenize:
        return params
    try:
        return params.clone(detokenize=False)
    except ValueError as e:  # stop strings need the text
        message = str(e).removeprefix("SamplingParams.")
        raise bad_request(message, f"sampling_params.{message.split(' ', 1)[0]}") from None


def token_logprobs(c: CompletionOutput, num_top: int) -> ChatLogprobs:
    """The chat-completions logprobs shape with vLLM's token strings for an ids-only answer
    (``token_id:<id>``, ``bytes`` null); ``top_logprobs``: the ``num_top`` likeliest tokens."""
    content = []
    for tid, entries in zip(c.token_ids, c.logprobs or [], strict=False):
        ranked = sorted((lp.rank, t) for t, lp in entries.items()
                        if lp.rank is not None and lp.rank <= num_top)[:num_top]
        tops = [TopLogprob(token=f"token_id:{t}", logprob=max(entries[t].logprob, MIN_LOGPROB))
                for _, t in ranked]
        content.append(ChatTokenLogprob(token=f"token_id:{tid}",
                                        logprob=max(entries[tid].logprob, MIN_LOGPROB),
                                        top_logprobs=tops))
    return ChatLogprobs(content=content)


def prompt_logprobs_field(raw: RawPromptLogprobs | None, tokenizer: Any, detokenize: bool
                          ) -> PlainPromptLogprobs | None:
    """vLLM's ``prompt_logprobs``; ``decoded_token`` null with ``detokenize`` false."""
    if detokenize:
        return plain_prompt_logprobs(shaped_prompt_logprobs(raw, tokenizer))
    if raw is None:
        return None
    return plain_prompt_logprobs([None if rec is None else logprob_entry(rec, lambda t: None)
                                  for rec in raw])


class OpenAIServingTokens(OpenAIServingCompletion):
    """Token-in/token-out generation on the completions path."""

    request_id_prefix = "generate-tokens"

    async def create(self, req: GenerateRequest, raw_request: Request | None = None) -> Any:
        """The engine's request id is vLLM's ``generate-tokens-<id>``: the X-Request-Id header's
        when sent, else the body's ``request_id``; the answer carries the body's."""
        request_id, trace = self.begin(raw_request)
        from_header = raw_request is not None and REQUEST_ID_HEADER in raw_request.headers
        if not from_header:
            request_id = f"{self.request_id_prefix}-{req.request_id}"
            if raw_request is not None:
                raw_request.scope[REQUEST_ID_SCOPE_KEY] = request_id
        try:
            return await self.guarded(self.handle(req, request_id, trace), request_id)
        except OpenAIError as e:
            raise generate_error(e, from_header) from None

    async def handle(self, req: GenerateRequest, request_id: str,
                     trace: RequestTrace | None = None) -> Response:
        completion = completion_request(req)
        rendered = await self.render(completion)
        params = with_detokenize(rendered.params, req.sampling_params.detokenize)
        with constraint_errors(rendered.constraint):
            streams = await self.start(request_id, rendered.prompts, params,
                                       completion.stream, req.priority, req.cache_salt)
        if completion.stream:
            return StreamingResponse(self._stream_tokens(req, rendered.model, streams, params,
                                                         trace),
                                     media_type="text/event-stream")
        (out,) = await final_outputs(streams)
        choices = [self._token_choice(c, params, "stop") for c in out.outputs]
        self.finished(trace, out, params, rendered.model,
                      sum(len(c.token_ids) for c in choices))
        body = GenerateResponse(request_id=req.request_id, choices=choices)
        if params.prompt_logprobs is None:
            return JSONResponse(body.model_dump())

        def build() -> dict:
            dumped = body.model_dump()
            dumped["prompt_logprobs"] = prompt_logprobs_field(out.prompt_logprobs,
                                                              self.tokenizer, params.detokenize)
            return dumped

        return await self.respond(build)  # decoding the scored prompt: off the loop

    def _token_choice(self, c: CompletionOutput, params: SamplingParams,
                      unfinished: str | None) -> GenerateChoice:
        """``unfinished``: the finish_reason while there is none (vLLM's: "stop" in a whole
        answer, null in a chunk)."""
        logprobs = token_logprobs(c, params.logprobs) if params.logprobs is not None else None
        return GenerateChoice(index=c.index, logprobs=logprobs,
                              finish_reason=c.finish_reason or unfinished,
                              token_ids=list(c.token_ids))

    async def _stream_tokens(self, req: GenerateRequest, model: str,
                             streams: Sequence[RequestStream], params: SamplingParams,
                             trace: RequestTrace | None) -> AsyncIterator[str]:
        """A chunk per choice per engine step with its new ids; with
        stream_options.continuous_usage_stats each carries that choice's usage so far (as
        vLLM), with include_usage a last chunk has no choices and the request's usage."""
        usage_each_chunk, usage_at_end = stream_usage_modes(req.stream_options)
        num_prompt = len(streams[0].prompt_token_ids)
        generated: dict[int, int] = {}  # choice index -> its tokens so far
        num_cached = 0
        try:
            async for _, out in merge_streams(streams):
                num_cached = out.num_cached_tokens
                for c in out.outputs:
                    generated[c.index] = generated.get(c.index, 0) + len(c.token_ids)
                    if not (c.token_ids or c.finish_reason):
                        continue
                    usage = (UsageInfo(prompt_tokens=num_prompt,
                                       completion_tokens=generated[c.index],
                                       total_tokens=num_prompt + generated[c.index])
                             if usage_each_chunk else None)
                    yield sse(GenerateStreamResponse(
                        request_id=req.request_id,
                        choices=[self._token_choice(c, params, None)], usage=usage))
                if out.finished:
                    self.finished(trace, out, params, model, sum(generated.values()))
            if usage_at_end:
                last = GenerateStreamResponse(request_id=req.request_id, choices=[],
                                              usage=self.usage(num_prompt,
                                                               sum(generated.values()),
                                                               num_cached))
                yield sse(last.model_dump(exclude_none=True))
        except Exception as e:  # headers are sent: report in the stream
            yield sse_error(e, req.request_id)
        yield SSE_DONE

