"""POST /v1/completions: text or token-id prompts (one or many), streaming or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, StreamingResponse

from pagellm.engine.async_llm import RequestStream
from pagellm.engine.input_processor import PromptType
from pagellm.entrypoints.openai.prompt_logprobs import MIN_LOGPROB as _MIN_LOGPROB
from pagellm.entrypoints.openai.prompt_logprobs import (
    plain_prompt_logprobs,
    resolve_prompt_logprobs,
    shaped_prompt_logprobs,
    without_generation,
)
from pagellm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from pagellm.entrypoints.openai.serving_engine import OpenAIServing
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
from pagellm.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.tracing import RequestTrace


@dataclass
class RenderedCompletion:
    """A checked request, before anything starts: what /v1/completions starts and
    /v1/completions/render answers with."""

    model: str  # the served name to answer with
    params: SamplingParams
    prompts: list[PromptType]  # each with its prompt_token_ids
    constraint: Constraint | None  # the structured-output field, for its compile errors
    echo_only: bool  # echo with max_tokens 0: score the prompt, generate nothing


class OpenAIServingCompletion(OpenAIServing):
    request_id_prefix = "cmpl"

    async def prompts(self, req: CompletionRequest) -> list[PromptType]:
        """The request's prompts as token ids (text tokenized off the event loop), checked:
        a bad one is a 400 before any of them starts."""
        p = req.prompt
        items: list[str | list[int]]
        if isinstance(p, str):
            items = [p]
        elif not p:
            raise bad_request("prompt must not be empty.", "prompt")
        elif isinstance(p[0], int):
            items = [p]  # type: ignore[list-item]
        else:
            items = list(p)  # type: ignore[arg-type]
        if len(items) > self.limits.max_prompts:
            raise bad_request(f"prompt has {len(items)} prompts, more than "
                              f"{self.limits.max_prompts} (--max-prompts).", "prompt")
        if any(item == "" for item in items):
            raise bad_request("The prompt is empty: it must have at least one token.", "prompt")
        texts = [item for item in items if isinstance(item, str)]
        encoded = iter(await self.tokenizer_pool.encode(texts, req.add_special_tokens)
                       if texts else [])
        prompts: list[PromptType] = []
        for item in items:
            # The text stays with its ids: echo and --enable-log-requests show it.
            prompt: dict = ({"prompt": item, "prompt_token_ids": next(encoded)}
                            if isinstance(item, str) else {"prompt_token_ids": list(item)})
            if req.truncate_prompt_tokens is not None:
                ids = self.truncated(prompt["prompt_token_ids"], req.truncate_prompt_tokens)
                # The ids it runs on, not the text any more (echo shows those).
                prompt = {"prompt_token_ids": ids}
            # An omitted max_tokens (OpenAI's default 16) is cut to the room left, as it
            # always was; only a number the client sent is refused when it does not fit.
            asked = req.max_tokens if "max_tokens" in req.model_fields_set else None
            self.check_prompt(prompt["prompt_token_ids"], asked)
            if req.cache_salt is not None:
                prompt["cache_salt"] = req.cache_salt
            prompts.append(prompt)
        return prompts

    async def render(self, req: CompletionRequest) -> RenderedCompletion:
        """Every check and the tokenization of a request, starting nothing (one path for the
        real endpoint and /v1/completions/render)."""
        model = self.models.check(req.model)
        if req.prompt_logprobs is not None and req.stream:  # as vLLM
            raise bad_request("prompt_logprobs is not available when stream is true.",
                              "prompt_logprobs")
        # echo with max_tokens 0 scores the prompt without generating (lm-eval, as vLLM): the
        # engine samples one token to finish the request, and the answer leaves it out.
        echo_only = req.echo and req.max_tokens == 0
        structured, constraint = resolve_structured_outputs(req, limits=self.limits)
        params = self.sampling_params(
            req, 1 if echo_only else req.max_tokens, req.logprobs,
            resolve_prompt_logprobs(req.prompt_logprobs, req.echo, req.logprobs), structured)
        prompts = await self.prompts(req)
        self.check_prompt_logprobs(prompts, params, "prompt_logprobs"
                                   if req.prompt_logprobs is not None else "logprobs")
        self.check_start(params, req.priority)
        return RenderedCompletion(model, params, prompts, constraint, echo_only)

    async def handle(self, req: CompletionRequest, request_id: str,
                     trace: RequestTrace | None = None) -> JSONResponse | StreamingResponse:
        rendered = await self.render(req)
        model, params, echo_only = rendered.model, rendered.params, rendered.echo_only
        with constraint_errors(rendered.constraint):
            streams = await self.start(request_id, rendered.prompts, params, req.stream,
                                       req.priority, req.cache_salt)
        if req.stream:
            return StreamingResponse(self._stream(req, request_id, model, streams, params,
                                                  trace),
                                     media_type="text/event-stream")
        outs = await final_outputs(streams)
        # Each prompt's completion tokens, as usage counts them.
        generated = [sum(len((without_generation(c) if echo_only else c).token_ids)
                         for c in out.outputs) for out in outs]
        for out, num in zip(outs, generated, strict=True):
            self.finished(trace, out, params, model, num)
        # --enable-per-request-metrics: vLLM's "metrics" object (null for n > 1, or prompts).
        extra = ({"metrics": self.metrics_field(outs, req.n, sum(generated))}
                 if self.enable_per_request_metrics else {})

        def build() -> dict:
            choices, fields, num_prompt, num_completion, num_cached = [], [], 0, 0, 0
            for pi, out in enumerate(outs):
                num_prompt += len(out.prompt_token_ids)
                num_cached += out.num_cached_tokens
                prompt_text = self._prompt_text(streams[pi]) if req.echo else ""
                scores = shaped_prompt_logprobs(out.prompt_logprobs, self.tokenizer)
                field = plain_prompt_logprobs(scores) if req.prompt_logprobs is not None \
                    else None
                for c in out.outputs:
                    if echo_only:
                        c = without_generation(c)
                    num_completion += len(c.token_ids)
                    choice = self._choice(req, pi * req.n + c.index, c, streams[pi],
                                          prompt_text, 0, scores)
                    if req.return_token_ids:
                        choice.prompt_token_ids = list(out.prompt_token_ids)
                    choices.append(choice)
                    fields.append(field)
            usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                              total_tokens=num_prompt + num_completion,
                              prompt_tokens_details=self.prompt_details(num_cached))
            body = CompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=usage).model_dump()
            for choice, field in zip(body["choices"], fields, strict=True):
                choice["prompt_logprobs"] = field
            body.update(extra)
            return body

        if req.echo or params.prompt_logprobs is not None:  # decoding the prompt: off the loop
            return await self.respond(build)
        return JSONResponse(build())

    def _prompt_text(self, stream: RequestStream) -> str:
        if stream.prompt is not None:
            return stream.prompt
        return self.tokenizer.decode(stream.prompt_token_ids)

    def _choice(self, req: CompletionRequest, index: int, c: CompletionOutput,
                stream: RequestStream, echo_text: str, offset: int,
                prompt_logprobs: PromptLogprobs | None = None) -> CompletionChoice:
        """``echo_text`` is prepended (the prompt, in the first chunk of an echoed choice);
        ``offset`` is the text offset where this piece starts; ``prompt_logprobs`` are the
        prompt's scores (the echoed tokens' logprobs; vLLM's prompt_logprobs field is added to
        the dumped body, see handle)."""
        logprobs = None
        if req.logprobs is not None:
            echo_ids = stream.prompt_token_ids if echo_text else []
            logprobs = self.completion_logprobs(c.token_ids, c.logprobs or [], echo_ids, offset,
                                                prompt_logprobs, req.logprobs)
        return CompletionChoice(index=index, text=echo_text + c.text, logprobs=logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                token_ids=list(c.token_ids) if req.return_token_ids else None)

    def completion_logprobs(self, token_ids: list[int], logprobs: SampleLogprobs,
                            echo_ids: list[int], offset: int,
                            echo_logprobs: PromptLogprobs | None = None,
                            num_top: int = 0) -> CompletionLogprobs:
        """OpenAI's legacy shape. Echoed prompt tokens carry their scores from
        ``echo_logprobs`` (the first one's is null: nothing precedes it); each token's
        ``top_logprobs`` holds the top-``num_top`` tokens plus the token itself."""
        out = CompletionLogprobs()
        for i, tid in enumerate(echo_ids):
            entry = echo_logprobs[i] if echo_logprobs is not None else None
            tok = self.token_str(tid, entry[tid].decoded_token if entry else None)
            out.tokens.append(tok)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(max(entry[tid].logprob, _MIN_LOGPROB))
                out.top_logprobs.append(self._top_logprobs(
                    {t: lp for t, lp in entry.items()
                     if t == tid or (lp.rank is not None and lp.rank <= num_top)}))
            out.text_offset.append(offset)
            offset += len(tok)
        for tid, entries in zip(token_ids, logprobs, strict=False):
            sampled = entries[tid]
            tok = self.token_str(tid, sampled.decoded_token)
            out.tokens.append(tok)
            out.token_logprobs.append(max(sampled.logprob, _MIN_LOGPROB))
            out.top_logprobs.append(self._top_logprobs(entries))
            out.text_offset.append(offset)
            offset += len(tok)
        return out

    def _top_logprobs(self, entries: dict[int, Logprob]) -> dict[str, float]:
        """Token string -> logprob. Tokens that decode alike (byte pieces all read "\ufffd")
        share a key, which keeps the likeliest: the top entry stays the top entry."""
        top: dict[str, float] = {}
        for t, lp in entries.items():
            key = self.token_str(t, lp.decoded_token)
            top[key] = max(top.get(key, _MIN_LOGPROB), lp.logprob, _MIN_LOGPROB)
        return top

    async def _stream(self, req: CompletionRequest, request_id: str, model: str,
                      streams: list[RequestStream], params: SamplingParams | None = None,
                      trace: RequestTrace | None = None) -> AsyncIterator[str]:
        """``params``: the request's (for the spans, with ``trace``)."""
        created = int(time.time())
        num_prompt = sum(len(s.prompt_token_ids) for s in streams)
        num_completion = 0
        generated: dict[int, int] = {}  # prompt index -> its completion tokens so far
        final_outs: list[RequestOutput] = []  # the prompts' last outputs, as they come
        offsets: dict[int, int] = {}  # choice index -> text offset so far
        cached: dict[int, int] = {}  # prompt index -> its prefix-cache hit
        prompt_scores: dict[int, PromptLogprobs] = {}  # prompt index -> its prompt logprobs
        echo_only = req.echo and req.max_tokens == 0
        usage_each_chunk, usage_at_end = stream_usage_modes(req.stream_options)
        try:
            async for pi, out in merge_streams(streams):
                cached[pi] = out.num_cached_tokens
                if out.prompt_logprobs is not None:  # sent once, before any choice's echo
                    prompt_scores[pi] = await self.tokenizer_pool.run_decode(
                        shaped_prompt_logprobs, out.prompt_logprobs, self.tokenizer)
                for c in out.outputs:
                    if echo_only:
                        c = without_generation(c)
                    index = pi * req.n + c.index
                    first = index not in offsets
                    echo_text = self._prompt_text(streams[pi]) if req.echo and first else ""
                    num_completion += len(c.token_ids)
                    generated[pi] = generated.get(pi, 0) + len(c.token_ids)
                    if not (c.text or echo_text or c.token_ids or c.finish_reason):
                        continue
                    choice = self._choice(req, index, c, streams[pi], echo_text,
                                          offsets.get(index, 0), prompt_scores.get(pi))
                    if req.return_token_ids and first:
                        choice.prompt_token_ids = list(streams[pi].prompt_token_ids)
                    offsets[index] = offsets.get(index, 0) + len(choice.text)
                    usage = (self.usage(num_prompt, num_completion, sum(cached.values()))
                             if usage_each_chunk else None)
                    chunk = CompletionResponse(id=request_id, created=created, model=model,
                                               choices=[choice], usage=usage)
                    yield sse(chunk)
                if out.finished:
                    final_outs.append(out)
                    if params is not None:
                        self.finished(trace, out, params, model, generated.get(pi, 0))
            if usage_at_end:
                usage = self.usage(num_prompt, num_completion, sum(cached.values()))
                last = CompletionResponse(id=request_id, created=created, model=model,
                                          choices=[], usage=usage)
                # --enable-per-request-metrics: in the usage chunk, as vLLM.
                yield sse({**last.model_dump(), "metrics": self.metrics_field(
                    final_outs, req.n, num_completion)} if self.enable_per_request_metrics
                    else last)
        except Exception as e:  # headers are sent: report in the stream, as OpenAI does
            yield sse_error(e, request_id)
        yield SSE_DONE
