"""Request ids from ``X-Request-Id``, and ``--enable-request-id-headers`` (vLLM's): the response
carries ``X-Request-Id``.

As in vLLM, a client's (or a gateway's) X-Request-Id names its request: the completion's id,
and the engine's request id, is ``<prefix>-<X-Request-Id>`` (cmpl-, chatcmpl-), so the logs, the
trace span and the response share it. With the flag, every response echoes the header the client
sent; without one, a generation answers with the id it generated and any other route with a
fresh one.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from pagellm.entrypoints.openai.serving_errors import bad_request

REQUEST_ID_HEADER = "x-request-id"
# Where a generation route leaves the id it generated, for the middleware to send.
REQUEST_ID_SCOPE_KEY = "pagellm.request_id"
MAX_REQUEST_ID_CHARS = 256
# Visible ASCII: the id is logged, echoed in a header and part of the response body.
_VALID_ID = re.compile(r"[\x21-\x7e]+")


def _is_valid(value: str) -> bool:
    return len(value) <= MAX_REQUEST_ID_CHARS and _VALID_ID.fullmatch(value) is not None


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The request's X-Request-Id, or None; 400 for one that cannot name a request."""
    value = headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    if not _is_valid(value):
        raise bad_request(f"The X-Request-Id header must be 1 to {MAX_REQUEST_ID_CHARS} "
                          "visible ASCII characters (no spaces).", "X-Request-Id")
    return value


class RequestIdHeaderMiddleware:
    """Adds ``X-Request-Id`` to every HTTP response (streamed ones too: it rides on the
    response's start)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = None
        for name, value in scope.get("headers", ()):
            if name == REQUEST_ID_HEADER.encode():
                sent = value.decode("latin-1")
                break

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                # An invalid one got a 400: the header names no request then.
                request_id = (sent if sent is not None and _is_valid(sent) else None) \
                    or scope.get(REQUEST_ID_SCOPE_KEY) or uuid.uuid4().hex
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != REQUEST_ID_HEADER.encode()]
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
