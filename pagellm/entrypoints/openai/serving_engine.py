"""What the completion and chat endpoints share: model names, tokenization off the event loop,
sampling parameters, starting requests and logprob formatting (merging their streams and SSE
framing: streams.py)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from pagellm.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    OutputKind,
    RequestFailedError,
    RequestStream,
)
from pagellm.engine.input_processor import PromptType, truncate_prompt
from pagellm.entrypoints.openai.limits import ServerLimits
from pagellm.entrypoints.openai.prompt_logprobs import prompt_logprob_entries
from pagellm.entrypoints.openai.protocol import (
    PromptTokensDetails,
    SamplingFields,
    UsageInfo,
    random_id,
)
from pagellm.entrypoints.openai.request_ids import REQUEST_ID_SCOPE_KEY, client_request_id
from pagellm.entrypoints.openai.request_metrics import metrics_field
from pagellm.entrypoints.openai.sampling_lists import check_sampling_lists
from pagellm.entrypoints.openai.serving_errors import (
    OpenAIError,
    bad_request,
    internal_error,
    model_not_found,
)
from pagellm.entrypoints.openai.streams import close_all
from pagellm.errors import EngineSleepingError, RequestIdInUseError
from pagellm.outputs import RequestOutput
from pagellm.sample.bad_words import bad_words_token_ids
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.structured_output.compile_pool import CompilePoolFullError

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.tracing import RequestTrace, RequestTracer

logger = logging.getLogger("pagellm")


@dataclass
class ServedModels:
    names: list[str]  # the first is the one we report
    root: str
    max_model_len: int

    def check(self, name: str | None) -> str:
        """The name to echo back; unknown names are 404 (no name means the first one)."""
        if name is None or name == "":
            return self.names[0]
        if name not in self.names:
            raise model_not_found(name)
        return name


# Starlette's JSONResponse settings: compact, UTF-8, no NaN.
_JSON_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_JOIN_BATCH = 8192
RETRY_AFTER_S = 1  # what a 503 for a full waiting queue tells clients to wait
# What an absent field means, unless the model's generation_config.json says otherwise.
_OPENAI_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                    "repetition_penalty": 1.0}
# One thread, as vLLM's async tokenizer: a Hugging Face fast tokenizer raises "Already
# borrowed" when one thread encodes while another changes its truncation or padding.
DEFAULT_TOKENIZER_THREADS = 1
# Decoding (which only reads the tokenizer) and building large answers: threads of their own, so
# a scored prompt's megabytes never queue a new request's tokenization behind them.
DEFAULT_DECODE_THREADS = 2
_T = TypeVar("_T")


class TokenizerPool:
    """Runs tokenization and chat-template rendering on a small thread pool, so a prompt near
    the body limit does not stall every other request and stream (the event loop goes on; a
    fast tokenizer encodes without the GIL). Work of a request whose client left is dropped
    before it starts (awaiting a cancelled task cancels its queued job)."""

    def __init__(self, tokenizer: Any, threads: int = DEFAULT_TOKENIZER_THREADS,
                 decode_threads: int = DEFAULT_DECODE_THREADS) -> None:
        self.tokenizer = tokenizer
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="pagellm-tokenizer")
        self.decode_executor = ThreadPoolExecutor(decode_threads,
                                                  thread_name_prefix="pagellm-decode")

    async def run(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Tokenization or chat-template rendering (anything that encodes)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def run_decode(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Work that at most decodes: detokenizing, shaping logprobs, building answers."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.decode_executor,
                                          functools.partial(fn, *args, **kwargs))

    async def encode(self, texts: list[str], add_special_tokens: bool = True
                     ) -> list[list[int]]:
        """Token ids of each text, as the engine's own tokenization gives them."""
        def encode_all() -> list[list[int]]:
            return [list(self.tokenizer.encode(t, add_special_tokens=add_special_tokens))
                    for t in texts]

        return await self.run(encode_all)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.decode_executor.shutdown(wait=False, cancel_futures=True)


class OpenAIServing:
    request_id_prefix = "req"
    # --otlp-traces-endpoint: a span per finished engine request (None: no tracing code runs).
    tracer: RequestTracer | None = None
    # --enable-per-request-metrics: the response's ``metrics`` object (vLLM's).
    enable_per_request_metrics = False
    # --enable-prompt-tokens-details: cached-token counts tell a client whether anyone in its
    # cache namespace sent the same prefix, so they are reported only when asked for.
    enable_prompt_tokens_details = False

    def __init__(self, engine: AsyncLLM, models: ServedModels,
                 limits: ServerLimits | None = None,
                 tokenizer_pool: TokenizerPool | None = None) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = engine.tokenizer
        self.limits = limits or ServerLimits()
        self.tokenizer_pool = tokenizer_pool or TokenizerPool(engine.tokenizer)

    async def create(self, req: Any, raw_request: Request | None = None) -> Any:
        """Serve one request (``handle`` does the work). An unexpected exception is a 500 with
        a fixed message and this request's id; the traceback goes to the log."""
        request_id, trace = self.begin(raw_request)
        return await self.guarded(self.handle(req, request_id, trace), request_id)

    def begin(self, raw_request: Request | None) -> tuple[str, RequestTrace | None]:
        """The request's id (``<prefix>-<X-Request-Id>`` when the client sent one, as vLLM;
        left in the scope for --enable-request-id-headers) and, with --otlp-traces-endpoint,
        its trace (the caller's traceparent/tracestate)."""
        headers: Mapping[str, str] = raw_request.headers if raw_request is not None else {}
        client_id = client_request_id(headers)
        request_id = (f"{self.request_id_prefix}-{client_id}" if client_id is not None
                      else random_id(self.request_id_prefix))
        if raw_request is not None:
            raw_request.scope[REQUEST_ID_SCOPE_KEY] = request_id
        trace = self.tracer.begin(headers) if self.tracer is not None else None
        return request_id, trace

    def finished(self, trace: RequestTrace | None, out: RequestOutput, params: SamplingParams,
                 model: str, num_completion: int) -> None:
        """One engine request (``out``: its last output) has finished: its span, when traced.
        ``num_completion``: the completion tokens the response reports for it."""
        if trace is not None:
            trace.finished(out, params, model, len(out.prompt_token_ids), num_completion)

    def metrics_field(self, finished: list[RequestOutput], n: int, num_completion: int
                      ) -> dict[str, Any] | None:
        """--enable-per-request-metrics: the response's ``metrics`` (see request_metrics)."""
        return metrics_field([out.metrics for out in finished], n, num_completion)

    async def guarded(self, work: Awaitable[_T], request_id: str) -> _T:
        """``work``'s result; an unexpected exception becomes the 500 of ``create``."""
        try:
            return await work
        except (OpenAIError, EngineDeadError, EngineSleepingError, RequestFailedError):
            raise
        except Exception as e:
            raise internal_error(e, request_id, type(self).__name__) from None

    async def handle(self, req: Any, request_id: str, trace: RequestTrace | None = None
                     ) -> Any:
        raise NotImplementedError

    def check_limits(self, req: SamplingFields) -> None:
        """The configurable caps on n and stop strings (see limits.py)."""
        lim = self.limits
        if req.n > lim.max_n:
            raise bad_request(f"n must be <= {lim.max_n} (--max-n), got {req.n}.", "n")
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > lim.max_stop:
            raise bad_request(f"stop has {len(stops)} strings, more than {lim.max_stop} "
                              "(--max-stop).", "stop")
        if any(len(s) > lim.max_stop_length for s in stops):
            raise bad_request(f"Each stop string must be at most {lim.max_stop_length} "
                              "characters (--max-stop-length).", "stop")
        if req.stop_token_ids is not None and len(req.stop_token_ids) > lim.max_stop:
            raise bad_request(f"stop_token_ids has more than {lim.max_stop} ids (--max-stop).",
                              "stop_token_ids")
        if req.logit_bias and len(req.logit_bias) > lim.max_logit_bias:
            raise bad_request(f"logit_bias has {len(req.logit_bias)} entries, more than "
                              f"{lim.max_logit_bias} (--max-logit-bias).", "logit_bias")
        check_sampling_lists(req, lim, self.engine.config)

    def check_capacity(self, num_seqs: int) -> None:
        """503 + Retry-After when admitting ``num_seqs`` more sequences would let more than
        --max-waiting-requests wait beyond the --max-num-seqs that can run, or while the
        prompts without a first token hold --max-num-queued-tokens or more; 400 past
        --max-seqs-per-request."""
        per_request = self.limits.max_seqs_per_request
        if num_seqs > per_request:
            raise bad_request(f"The request asks for {num_seqs} sequences (prompts x n), more "
                              f"than {per_request} (--max-seqs-per-request).", "n")
        # --max-num-seqs is per engine (as vLLM's, per data-parallel rank).
        running_cap = self.engine.config.scheduler.max_num_seqs * len(self.engine.engine_indexes)
        cap = self.limits.waiting_cap(running_cap)
        if num_seqs > running_cap + cap:  # retrying would never help
            raise bad_request(f"The request asks for {num_seqs} sequences (prompts x n), more "
                              f"than this server ever admits at once ({running_cap + cap}).",
                              "n")
        waiting = self.engine.num_unfinished_requests + num_seqs - running_cap
        if waiting > cap:
            raise retry_later(f"The server is overloaded: the waiting queue is full "
                              f"(--max-waiting-requests {cap}).")
        token_cap = self.limits.max_num_queued_tokens
        queued = self.engine.num_prefill_tokens
        if token_cap is not None and queued >= token_cap:
            # vLLM's TTFT bound: a new prompt would wait behind this much prefill.
            raise retry_later(f"The server is overloaded: the prefill queue is full "
                              f"({queued} prompt tokens wait for their first token; "
                              f"--max-num-queued-tokens {token_cap}).")

    def sampling_params(self, req: SamplingFields, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        self.check_limits(req)
        logit_bias = None
        if req.logit_bias:
            try:
                logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
            except ValueError:
                raise bad_request("logit_bias keys must be token ids.", "logit_bias") from None
            vocab = self.engine.config.model.vocab_size
            if any(not 0 <= k < vocab for k in logit_bias):
                raise bad_request(f"logit_bias has a token id outside the vocabulary "
                                  f"(size {vocab}).", "logit_bias")
            # As OpenAI; NaN fails the comparison too.
            if any(not -100.0 <= v <= 100.0 for v in logit_bias.values()):
                raise bad_request("logit_bias values must be in [-100, 100].", "logit_bias")
        defaults = self.sampling_defaults(req)
        try:
            params = SamplingParams(
                n=req.n, seed=req.seed, **defaults,
                max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
                stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                logit_bias=logit_bias, structured_outputs=structured_outputs,
                bad_words=req.bad_words, allowed_token_ids=req.allowed_token_ids,
                truncate_prompt_tokens=req.truncate_prompt_tokens, extra_args=req.vllm_xargs)
            if params.bad_words:
                params._bad_words_token_ids = bad_words_token_ids(
                    params.bad_words, self.tokenizer, self.engine.config.model.vocab_size)
            return params
        except ValueError as e:
            # "SamplingParams.top_p must be ..." -> name the request field, in the message and
            # in param (null when the name is not one of the request's fields).
            message = str(e).removeprefix("SamplingParams.")
            name = message.split(" ", 1)[0]
            raise bad_request(message, name if name in type(req).model_fields else None
                              ) from None

    def sampling_defaults(self, req: SamplingFields) -> dict[str, Any]:
        """temperature, top_p, top_k, min_p, repetition_penalty: the request's value; where it
        is absent (or null), the model's generation_config.json default, else OpenAI's (as
        vLLM; --generation-config vllm leaves only OpenAI's)."""
        generation = getattr(self.engine.config.model, "generation_config", None)
        model = generation.defaults if generation is not None else {}
        values: dict[str, Any] = {}
        for name, openai_default in _OPENAI_DEFAULTS.items():
            value = getattr(req, name) if name in req.model_fields_set else None
            values[name] = value if value is not None else model.get(name, openai_default)
        return values

    def truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """truncate_prompt_tokens applied (before check_prompt), as the engine would."""
        try:
            return truncate_prompt(ids, keep, self.models.max_model_len)
        except ValueError as e:
            raise bad_request(str(e), "truncate_prompt_tokens") from None

    def check_prompt(self, ids: list[int], max_tokens: int | None,
                     max_tokens_param: str = "max_tokens") -> None:
        """400 for a prompt the engine would refuse (empty, out of vocabulary, no room left for
        output) or a max_tokens it does not leave room for, as vLLM and OpenAI answer: null
        max_tokens means the rest of the context, a number is never cut silently."""
        try:
            self.engine.input_processor.validate(ids)
        except ValueError as e:
            raise bad_request(str(e), "prompt") from None
        max_len = self.models.max_model_len
        if max_tokens is not None and len(ids) + max_tokens > max_len:
            raise bad_request(
                f"'{max_tokens_param}' is too large: {max_tokens}. This model's maximum "
                f"context length is {max_len} tokens and your request has {len(ids)} input "
                f"tokens ({max_tokens} > {max_len} - {len(ids)}).", max_tokens_param)

    async def compile_structured(self, params: SamplingParams, cache_salt: str | None) -> None:
        """Compile the request's grammar (if it has one) for its cache namespace on the engine's
        grammar threads, so the event loop goes on meanwhile (the first one also builds
        xgrammar's tokenizer info there); ``start`` awaits it, then adds the request without
        compiling again. 503 with Retry-After while --max-structured-outputs-compiles compiles
        are running or queued (code "server_overloaded"; a request for a spec already compiling
        waits for it instead), or once the wait passes --structured-outputs-compile-timeout
        (code "structured_outputs_compile_timeout": the compile goes on, and its grammar is
        cached for the retry). A spec that does not compile raises ValueError (see
        constraint_errors)."""
        spec = params.structured_outputs
        if spec is None:
            return
        lim = self.limits
        try:
            await self.engine.grammar_pool.compile(
                spec, cache_salt or None, lim.structured_outputs_compile_timeout,
                lim.max_structured_outputs_compiles)
        except CompilePoolFullError:
            raise retry_later(f"The server is overloaded: {lim.max_structured_outputs_compiles} "
                              "structured-output grammars are compiling or queued "
                              "(--max-structured-outputs-compiles).") from None
        except TimeoutError:
            # 503, not 400: the wait includes the queue, and the retry finds the grammar cached.
            raise retry_later("The structured-output grammar did not compile within "
                              f"{lim.structured_outputs_compile_timeout:g} s "
                              "(--structured-outputs-compile-timeout); it goes on compiling.",
                              "structured_outputs_compile_timeout") from None

    def check_prompt_logprobs(self, prompts: Sequence[PromptType], params: SamplingParams,
                              param: str) -> None:
        """400 naming ``param`` when scoring the prompts (token ids) would return more than
        --max-prompt-logprobs-entries entries: a 50 KiB request must not ask for a 10 MiB
        answer."""
        if params.prompt_logprobs is None:
            return
        entries = sum(prompt_logprob_entries(len(p["prompt_token_ids"]), params.prompt_logprobs)
                      for p in prompts if isinstance(p, dict))
        cap = self.limits.max_prompt_logprobs_entries
        if entries > cap:
            raise bad_request(
                f"{param} would return up to {entries} prompt logprob entries (prompt tokens x "
                f"(1 + {params.prompt_logprobs})), more than {cap} "
                "(--max-prompt-logprobs-entries): score fewer or shorter prompts, or fewer top "
                "tokens.", param)

    async def respond(self, build: Callable[[], dict[str, Any]]) -> Response:
        """``build()``'s JSON body, built and serialized off the event loop: with prompt
        logprobs it decodes up to --max-prompt-logprobs-entries tokens into megabytes. The
        encoder is json's Python one, which lets the loop's thread run between its pieces (the
        C encoder would hold the GIL for the whole body)."""
        def encode() -> Response:
            pieces, batch = [], []
            for chunk in _JSON_ENCODER.iterencode(build()):
                batch.append(chunk)
                if len(batch) == _JOIN_BATCH:  # one join of a million pieces holds the GIL
                    pieces.append("".join(batch))
                    batch.clear()
            pieces.append("".join(batch))
            return Response(content="".join(pieces).encode(), media_type="application/json")

        return await self.tokenizer_pool.run_decode(encode)

    async def start(self, request_id: str, prompts: Sequence[PromptType],
                    params: SamplingParams, stream: bool, priority: int = 0,
                    cache_salt: str | None = None) -> list[RequestStream]:
        """Start every prompt, or none; the grammar (if any) compiles first, for
        ``cache_salt``'s namespace (compile_structured: a spec that does not compile raises
        ValueError). The prompts are token ids checked by check_prompt, so any other
        ValueError from the engine here is a bug (a 500), not the client's fault."""
        self.check_start(params, priority)
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        num_seqs = len(prompts) * params.n
        self.check_capacity(num_seqs)
        if params.structured_outputs is not None:
            await self.compile_structured(params, cache_salt)
            self.check_capacity(num_seqs)  # the queue may have filled meanwhile
        streams: list[RequestStream] = []

        def add(rid: str, prompt: PromptType) -> RequestStream:
            return self.engine.add_request(
                rid, prompt, params, kind, priority=priority,
                grammar_compiled=params.structured_outputs is not None)

        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                try:
                    streams.append(add(rid, prompt))
                except RequestIdInUseError:
                    # Generated ids are unique, a client's X-Request-Id may not be (two
                    # tenants may pick the same one): the engine's id gets a suffix, the
                    # response keeps the client's id, and nobody learns what is in flight.
                    streams.append(add(random_id(rid), prompt))
        except BaseException:
            close_all(streams)
            raise
        return streams

    def check_start(self, params: SamplingParams, priority: int) -> None:
        """The checks ``start`` makes of a request before admitting it (render makes them too:
        the same 400s, without starting anything)."""
        if priority != 0 and self.engine.config.scheduler.policy != "priority":
            raise bad_request("priority needs a server started with --scheduling-policy "
                              "priority.", "priority")
        vocab = self.engine.config.model.vocab_size
        bad_stop = [t for t in params.stop_token_ids or [] if t >= vocab]
        if bad_stop:
            raise bad_request(f"stop_token_ids has token id {bad_stop[0]}, outside the "
                              f"vocabulary (size {vocab}).", "stop_token_ids")

    def usage(self, num_prompt: int, num_completion: int, num_cached: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                         total_tokens=num_prompt + num_completion,
                         prompt_tokens_details=self.prompt_details(num_cached))

    def prompt_details(self, num_cached: int) -> PromptTokensDetails | None:
        """usage.prompt_tokens_details: None (absent) unless --enable-prompt-tokens-details."""
        if not self.enable_prompt_tokens_details:
            return None
        return PromptTokensDetails(cached_tokens=num_cached)

    def token_str(self, token_id: int, decoded: str | None) -> str:
        if decoded is not None:
            return decoded
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def retry_later(reason: str, code: str = "server_overloaded") -> OpenAIError:
    """A 503 with Retry-After: the request may succeed later as it is."""
    return OpenAIError(503, f"{reason} Retry later.", code=code,
                       headers={"Retry-After": str(RETRY_AFTER_S)})
