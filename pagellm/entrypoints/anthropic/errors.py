"""Anthropic-shaped errors: ``{"type": "error", "error": {"type", "message"}}``, for every error
of the /v1/messages routes (the key check's 401 included).

Status codes are Anthropic's, with one choice: pagellm's 503 (a full queue, a sleeping engine)
is answered as Anthropic answers its own overload, 529 ``overloaded_error`` (the anthropic SDK
raises OverloadedError for it and retries it, honouring Retry-After, as it retries 503)."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.entrypoints.openai.serving_errors import (
    OpenAIError,
    describe_error,
    internal_error,
)
from pagellm.errors import EngineDeadError, EngineSleepingError, RequestFailedError

OVERLOADED_STATUS = 529  # Anthropic's status of overloaded_error
# Anthropic's error type of each status.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          OVERLOADED_STATUS: "overloaded_error"}
MESSAGES_PATH_PREFIX = "/v1/messages"


def anthropic_status(status: int) -> int:
    return OVERLOADED_STATUS if status == 503 else status


def error_type(status: int) -> str:
    return _TYPES.get(anthropic_status(status), "api_error" if status >= 500
                      else "invalid_request_error")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_error_response(status: int, message: str,
                             headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message),
                        status_code=anthropic_status(status), headers=headers)


def validation_message(errors: list[Any], where: str = "") -> str:
    """Anthropic's style: ``messages.0.content: Field required`` (body fields, dotted;
    ``where``: the place of the validated value in the body)."""
    parts = []
    for err in errors:
        if err.get("type") == "json_invalid":
            return "The request body is not valid JSON."
        loc = ".".join([where] * bool(where)
                       + [str(x) for x in err.get("loc", ()) if x != "body"])
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "Invalid request."


def exception_response(exc: BaseException, request_id: str | None = None) -> Response:
    """The Anthropic response of any exception a /v1/messages route raises."""
    if isinstance(exc, RequestValidationError | ValidationError):
        return anthropic_error_response(400, validation_message(list(exc.errors())))
    if isinstance(exc, StarletteHTTPException):
        return anthropic_error_response(exc.status_code, str(exc.detail))
    if isinstance(exc, OpenAIError):
        return anthropic_error_response(exc.status, exc.message, exc.headers)
    if not isinstance(exc, EngineDeadError | EngineSleepingError | RequestFailedError):
        exc = internal_error(exc, request_id, "/v1/messages")
    status, message, _ = describe_error(exc)
    return anthropic_error_response(status, message)


def sse_error_event(exc: BaseException, request_id: str) -> str:
    """A stream's ``event: error`` (its headers are sent, so the status cannot change)."""
    response = exception_response(exc, request_id)
    return f"event: error\ndata: {bytes(response.body).decode()}\n\n"


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class AnthropicRoute(APIRoute):
    """A route whose errors (body validation included, which FastAPI raises before the
    handler runs) are Anthropic-shaped, whatever the app's OpenAI error handlers say."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as e:  # every error of these routes is answered here
                return exception_response(e)

        return route
