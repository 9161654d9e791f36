"""The OpenAI-compatible HTTP front end (FastAPI + uvicorn) over AsyncLLM."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import socket
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import pagellm
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.anthropic.errors import MESSAGES_PATH_PREFIX, anthropic_error_response
from pagellm.entrypoints.anthropic.routes import add_anthropic_routes
from pagellm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pagellm.entrypoints.openai.admin_routes import AdminOptions, add_admin_routes
from pagellm.entrypoints.openai.chat_tools import ChatToolOptions
from pagellm.entrypoints.openai.limits import RequestLimitsMiddleware, ServerLimits
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagellm.entrypoints.openai.protocol_generate import GENERATE_PATH, GenerateRequest
from pagellm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagellm.entrypoints.openai.request_ids import RequestIdHeaderMiddleware
from pagellm.entrypoints.openai.response_store import ResponseStore
from pagellm.entrypoints.openai.serving_chat import ChatRenderer, OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_engine import ServedModels, TokenizerPool
from pagellm.entrypoints.openai.serving_errors import (
    bad_request,
    error_body,
    install_error_handlers,
    model_not_found,
)
from pagellm.entrypoints.openai.serving_generate import OpenAIServingTokens
from pagellm.entrypoints.openai.serving_render import add_render_routes
from pagellm.entrypoints.openai.serving_responses import (
    OpenAIServingResponses,
    add_responses_routes,
)
from pagellm.entrypoints.openai.serving_tokenization import tokenizer_info
from pagellm.entrypoints.openai.tenancy import (
    OPEN_PATHS,
    PREFIX_CACHE_SCOPES,
    ROLE_SCOPE_KEY,
    TENANT_SCOPE_KEY,
    ApiKey,
    ApiKeys,
    cache_namespace,
)

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.tracing import RequestTracer

logger = logging.getLogger("pagellm")

ENGINE_DEAD_GRACE_S = 2.0  # /health answers 503 this long before the server exits


class ApiKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``) matches
    one of the keys (constant-time compare); a match leaves the key's tenant identity (for the
    cache namespace) and its role (for the admin routes) in the scope."""

    def __init__(self, app: Any, api_key: str | ApiKeys) -> None:
        self.app = app
        self.keys = api_key if isinstance(api_key, ApiKeys) else ApiKeys([ApiKey(api_key)])

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" \
                or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given, x_api_key = b"", None
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and not given:
                given = value
            elif name == b"x-api-key" and x_api_key is None:
                x_api_key = value
        caller = self.keys.caller_of(given)
        if caller is None and x_api_key is not None:
            caller = self.keys.caller_of(b"Bearer " + x_api_key)
        if caller is not None:
            scope[TENANT_SCOPE_KEY] = caller.identity
            scope[ROLE_SCOPE_KEY] = caller.role
            await self.app(scope, receive, send)
            return
        response = JSONResponse(error_body(401, "Invalid or missing API key (send "
                                           "'Authorization: Bearer <key>').",
                                           code="invalid_api_key"), status_code=401)
        if scope["path"].startswith(MESSAGES_PATH_PREFIX):  # Anthropic's routes, its shape
            response = anthropic_error_response(401, "Invalid or missing API key (send "
                                                "'x-api-key: <key>').")
        await response(scope, receive, send)


def with_cancellation(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Cancel the handler (so its requests are aborted) if the client disconnects first.
    Streaming responses are cancelled by Starlette itself once they start."""

    @functools.wraps(handler)
    async def wrapper(body: Any, raw_request: Request) -> Any:
        handler_task = asyncio.ensure_future(handler(body, raw_request))

        async def wait_disconnect() -> None:
            while (await raw_request.receive())["type"] != "http.disconnect":
                pass

        disconnect_task = asyncio.ensure_future(wait_disconnect())
        done, _ = await asyncio.wait([handler_task, disconnect_task],
                                     return_when=asyncio.FIRST_COMPLETED)
        if handler_task in done:
            disconnect_task.cancel()
            return handler_task.result()
        handler_task.cancel()
        await asyncio.gather(handler_task, return_exceptions=True)
        return Response(status_code=499)  # nobody is listening

    return wrapper


def build_app(engine: AsyncLLM, served_model_names: list[str] | None = None,
              chat_template: str | None = None, api_key: str | ApiKeys | None = None,
              limits: ServerLimits | None = None, prefix_cache_scope: str = "key",
              enable_prompt_tokens_details: bool = False,
              health_max_step_s: float = 0.0,
              enable_tokenizer_info_endpoint: bool = False,
              tool_options: ChatToolOptions | None = None,
              admin: AdminOptions | None = None,
              tracer: RequestTracer | None = None,
              enable_request_id_headers: bool = False,
              enable_per_request_metrics: bool = False,
              response_store: ResponseStore | None = None) -> FastAPI:
    """``api_key``: one key or several (ApiKeys); with ``prefix_cache_scope`` "key" each key's
    tenant gets its own prefix-cache namespace (a request's cache_salt narrows it further).
    ``health_max_step_s`` (> 0): /health answers 503 once requests have waited this long for
    an engine step (a wedged engine); ``pagellm serve`` sets it (--health-max-step-seconds).
    ``enable_tokenizer_info_endpoint``: add GET /tokenizer_info (it shows the chat template).
    ``tool_options``: tool calling and reasoning (--enable-auto-tool-choice, --tool-call-parser,
    --reasoning-parser, ...). ``admin``: who may run the admin routes (admin_routes.py; default:
    admin keys only, and none without keys).
    ``tracer``: --otlp-traces-endpoint's span maker (tracing.py; None: no tracing).
    ``enable_request_id_headers``: responses carry X-Request-Id (request_ids.py).
    ``enable_per_request_metrics``: generation responses carry vLLM's ``metrics`` object.
    ``response_store``: /v1/responses' store (default: response_store.py's bounds)."""
    if prefix_cache_scope not in PREFIX_CACHE_SCOPES:
        raise ValueError(f"prefix_cache_scope must be one of {PREFIX_CACHE_SCOPES}, got "
                         f"{prefix_cache_scope!r}")
    config = engine.config
    limits = limits or ServerLimits()
    models = ServedModels(served_model_names or [config.model.served_model_name],
                          str(config.model.model or config.model.served_model_name),
                          config.model.max_model_len)
    renderer = ChatRenderer(engine.tokenizer, chat_template)
    # One pool for every endpoint: the tokenizer is one object, used by one thread at a time.
    tokenizer_pool = TokenizerPool(engine.tokenizer)
    completions = OpenAIServingCompletion(engine, models, limits, tokenizer_pool)
    chat = OpenAIServingChat(engine, models, renderer, limits, tokenizer_pool, tool_options)
    tokens = OpenAIServingTokens(engine, models, limits, tokenizer_pool)  # /inference/v1/generate
    for serving in (completions, chat, tokens):
        serving.enable_prompt_tokens_details = enable_prompt_tokens_details
        serving.tracer = tracer
        serving.enable_per_request_metrics = enable_per_request_metrics

    def scope_salt(body: CompletionRequest | ChatCompletionRequest | GenerateRequest
                   | ResponsesRequest,
                   raw_request: Request) -> None:
        """The engine sees the tenant's namespace (never the key) plus the client's salt."""
        tenant = raw_request.scope.get(TENANT_SCOPE_KEY) if prefix_cache_scope == "key" \
            else None
        body.cache_salt = cache_namespace(tenant, body.cache_salt)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            tokenizer_pool.shutdown()
            await engine.aclose()

    app = FastAPI(title="pagellm OpenAI-compatible server", version=pagellm.__version__,
                  lifespan=lifespan)
    app.state.engine = engine
    install_error_handlers(app)
    # The API key check is added last, so it runs first: no body is read for a client
    # without a key.
    app.add_middleware(RequestLimitsMiddleware, limits=limits)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if enable_request_id_headers:  # outermost: a 401 or 413 carries the header too
        app.add_middleware(RequestIdHeaderMiddleware)

    stall_logged = False  # log a stall once, not at every probe

    @app.get("/health")
    async def health() -> Response:
        nonlocal stall_logged
        if engine.errored:
            return Response(status_code=503)
        stalled_s = engine.seconds_without_progress()
        if not 0 < health_max_step_s < stalled_s:
            stall_logged = False
            return Response(status_code=200)
        message = (f"The engine looks wedged: no step has completed for {stalled_s:.1f} s "
                   f"while {engine.num_unfinished_requests} sequence(s) are in flight "
                   f"(limit {health_max_step_s:g} s, --health-max-step-seconds).")
        if not stall_logged:
            stall_logged = True
            logger.error("/health answers 503: %s", message)
        return JSONResponse(error_body(503, message, code="engine_stalled"), status_code=503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagellm.__version__}

    @app.get("/get_load")
    async def get_load() -> dict:
        # vllm-router's power_of_two polls this (without a key): sequences in the engine.
        return {"load": engine.num_unfinished_requests}

    @app.get("/v1/models")
    async def list_models() -> dict:
        cards = [ModelCard(id=name, root=models.root, max_model_len=models.max_model_len)
                 for name in models.names]
        return ModelList(data=cards).model_dump()

    # ":path": a served name may hold "/" (an SDK sends it as %2F, which arrives decoded).
    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        if model_id not in models.names:
            raise model_not_found(model_id)
        return ModelCard(id=model_id, root=models.root,
                         max_model_len=models.max_model_len).model_dump()

    @app.post("/v1/completions")
    @with_cancellation
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        scope_salt(body, raw_request)
        return await completions.create(body, raw_request)

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def create_chat_completion(body: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        scope_salt(body, raw_request)
        return await chat.create(body, raw_request)

    add_render_routes(app, completions, chat)  # vLLM's /v1/{,chat/}completions/render
    # Anthropic's /v1/messages{,/count_tokens}, through the chat path.
    add_anthropic_routes(app, AnthropicServingMessages(chat, scope_salt), with_cancellation)

    responses = OpenAIServingResponses(chat, response_store or ResponseStore())

    @app.post("/v1/responses")  # OpenAI's Responses API, on the chat path
    @with_cancellation
    async def create_response(body: ResponsesRequest, raw_request: Request) -> Response:
        scope_salt(body, raw_request)
        return await responses.create(body, raw_request)

    add_responses_routes(app, responses)  # GET/DELETE /v1/responses/{id}, .../cancel

    @app.post(GENERATE_PATH)  # vLLM's token-in/token-out generation (serving_generate.py)
    @with_cancellation
    async def generate_tokens(body: GenerateRequest, raw_request: Request) -> Response:
        scope_salt(body, raw_request)
        return await tokens.create(body, raw_request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        models.check(body.model)
        if body.messages is not None:
            ids = await tokenizer_pool.run(renderer.render, body.messages,
                                           body.add_generation_prompt,
                                           body.continue_final_message,
                                           add_special_tokens=bool(body.add_special_tokens))
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            (ids,) = await tokenizer_pool.encode([body.prompt], add_special)
        return TokenizeResponse(count=len(ids), max_model_len=models.max_model_len,
                                tokens=ids).model_dump()

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        models.check(body.model)
        # No sequence this server reads or writes is longer; and a fast tokenizer's decode holds
        # the GIL (1M ids: 0.1-0.2 s of a stopped event loop, from any thread).
        if len(body.tokens) > models.max_model_len:
            raise bad_request(f"tokens has {len(body.tokens)} ids, more than this model's "
                              f"context (max_model_len {models.max_model_len}).", "tokens")
        vocab = config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"Token id {bad[0]} is out of vocabulary (size {vocab}).",
                              "tokens")
        text = await tokenizer_pool.run_decode(engine.tokenizer.decode, body.tokens)
        return DetokenizeResponse(prompt=text).model_dump()

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict:
            return tokenizer_info(engine.tokenizer, renderer.template())

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = engine.prometheus.render()
        return Response(content=data, media_type=content_type)

    add_admin_routes(app, engine, admin or AdminOptions(), keys_configured=bool(api_key),
                     # test doubles' configs lack it
                     enable_sleep_mode=getattr(config, "enable_sleep_mode", False))
    return app


async def serve_http(app: FastAPI, engine: AsyncLLM, sock: socket.socket,
                     log_level: str = "info", **uvicorn_kwargs: Any) -> int:
    """Run uvicorn on ``sock`` (ports.listen_socket) until SIGINT/SIGTERM (exit code 0) or engine
    death (exit code 1)."""
    host, port = sock.getsockname()[:2]
    # uvicorn logs no address for sockets it is handed.
    logger.info("Listening on %s.", f"http://[{host}]:{port}" if ":" in host
                else f"http://{host}:{port}")
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5, **uvicorn_kwargs))
    exit_code = 0

    def on_dead(error: Exception) -> None:
        nonlocal exit_code
        exit_code = 1
        logger.error("The engine is dead; the server stops in %.0f s.", ENGINE_DEAD_GRACE_S)
        asyncio.get_running_loop().call_later(ENGINE_DEAD_GRACE_S,
                                              lambda: setattr(server, "should_exit", True))

    engine.on_dead(on_dead)
    # What start-up made (modules, the tokenizer, the app: millions of objects) lives as long
    # as the server: out of the collector's sight, a full collection, which holds the GIL
    # and so stops the event loop, walks only what requests made (it took 250 ms after a
    # large prompt-logprobs answer).
    gc.collect()
    gc.freeze()
    await server.serve(sockets=[sock])
    if not server.started and exit_code == 0:
        exit_code = 1
    return exit_code
