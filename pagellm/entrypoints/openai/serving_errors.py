"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``, with the status codes
OpenAI uses (400 for any invalid field, never FastAPI's 422)."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.errors import EngineDeadError, EngineSleepingError, RequestFailedError

logger = logging.getLogger("pagellm")

# The code of a 400 for a field this server knows but does not support (OpenAI's code for it).
UNSUPPORTED_PARAMETER = "unsupported_parameter"

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    err_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def describe_error(exc: BaseException) -> tuple[int, str, str | None]:
    """(status, message, code) of an exception, for a response body or a stream's error event.
    Anything but an OpenAIError gets a fixed message: exception text (a traceback from the
    engine process, paths, prompt text) stays in the server log."""
    if isinstance(exc, OpenAIError):
        return exc.status, exc.message, exc.code
    if isinstance(exc, RequestFailedError):
        return 500, str(exc), "internal_server_error"  # our own text, naming no cause
    if isinstance(exc, EngineSleepingError):
        return 503, str(exc), "engine_sleeping"  # our own text: call /wake_up
    if isinstance(exc, EngineDeadError):
        return 500, ("The engine is not running (it failed or was shut down); the cause is in "
                     "the server log."), "engine_dead"
    return 500, "Internal server error; the details are in the server log.", \
        "internal_server_error"


def internal_error(exc: BaseException, request_id: str | None = None,
                   where: str = "a request") -> OpenAIError:
    """A 500 for an unexpected exception (a bug, never the client's fault): logged here with
    its traceback under an id that the client gets too, so the two can be matched."""
    request_id = request_id or f"err-{uuid.uuid4().hex}"
    logger.error("Unhandled error in %s (request %s)", where, request_id, exc_info=exc)
    return OpenAIError(500, f"Internal server error (request {request_id}); the details are "
                       "in the server log.", code="internal_server_error")


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def model_not_found(name: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str | None]:
    """(message, param, code): the first failing field is the param; a field the server knows
    but does not support (protocol.UNSUPPORTED_FIELDS) names itself in the error's context."""
    parts, param, code = [], None, None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            # Its loc is ("body", <character offset>): a position, not a field, so no param.
            offset = next((x for x in err.get("loc", ()) if isinstance(x, int)), None)
            detail = (err.get("ctx") or {}).get("error") or "JSON decode error"
            where = f" at character {offset}" if offset is not None else ""
            return f"The request body is not valid JSON: {detail}{where}.", None, None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        ctx_param = (err.get("ctx") or {}).get("param")
        if param is None:
            if err.get("type") == UNSUPPORTED_PARAMETER and ctx_param:
                param, code = str(ctx_param), UNSUPPORTED_PARAMETER
            elif loc:
                param = loc[0]
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return "; ".join(parts) or "Invalid request.", param, code


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_message(exc)
        return error_response(400, message, param, code)

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineSleepingError)
    @app.exception_handler(RequestFailedError)
    async def _engine(request: Request, exc: Exception) -> JSONResponse:
        # Already logged where it happened (the engine), with the cause.
        status, message, code = describe_error(exc)
        return error_response(status, message, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # A ValueError here is a bug too, not a bad request: request checks raise OpenAIError.
        err = internal_error(exc, where=request.url.path)
        return error_response(err.status, err.message, code=err.code)
