"""The Anthropic routes, on a router whose errors are Anthropic-shaped (errors.AnthropicRoute)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from pagellm.entrypoints.anthropic.errors import MESSAGES_PATH_PREFIX, AnthropicRoute
from pagellm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagellm.entrypoints.anthropic.serving_messages import AnthropicServingMessages

Handler = Callable[..., Awaitable[Any]]


def add_anthropic_routes(app: FastAPI, serving: AnthropicServingMessages,
                         with_cancellation: Callable[[Handler], Handler]) -> None:
    """``with_cancellation``: api_server's (a client that leaves aborts its request)."""
    router = APIRouter(route_class=AnthropicRoute)

    @router.post(MESSAGES_PATH_PREFIX)
    @with_cancellation
    async def create_message(body: MessagesRequest, raw_request: Request) -> Response:
        return await serving.create(body, raw_request)

    @router.post(f"{MESSAGES_PATH_PREFIX}/count_tokens")
    async def count_tokens(body: CountTokensRequest, raw_request: Request) -> dict:
        return await serving.count_tokens(body, raw_request)

    app.include_router(router)
