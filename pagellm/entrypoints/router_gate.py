"""The client-facing port in front of vllm-router: it forwards only what clients and probes need
(``/v1/*``, vLLM's token-in/token-out ``/inference/v1/generate``, ``/health``, and the router's
own probes ``/readiness`` and ``/liveness``) to the router, which listens on loopback only.

vllm-router serves its management API (``/add_worker``, ``/remove_worker``, ``/list_workers``,
``/flush_cache``, ``/workers/...``) on its one port to anyone, with or without its ``--api-key``
(which it only sends to workers): a client that adds its own "worker" receives other tenants'
requests with their keys and prompts. So the router listens on 127.0.0.1 (in Kubernetes: inside
its pod) and this forwarder, with an allow-list, is the only way in.

    python -m pagellm.entrypoints.router_gate --upstream http://127.0.0.1:8001 --port 8000

Streams pass through chunk by chunk; a client that leaves closes the upstream request (so the
router and the replica abort it). Any other path is a 404 that never reaches the router.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn
from fastapi.responses import JSONResponse

from pagellm.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from pagellm.entrypoints.openai.protocol_generate import GENERATE_PATH
from pagellm.entrypoints.openai.serving_errors import error_body

logger = logging.getLogger("pagellm")

CLIENT_PREFIX = "/v1/"  # every OpenAI-compatible route, any method
# Client routes outside /v1 (any method): vllm-router and llm-d send GenerateRequests here.
CLIENT_PATHS = frozenset({GENERATE_PATH})
PROBE_PATHS = frozenset({"/health", "/readiness", "/liveness"})  # GET/HEAD only
# RFC 9110 hop-by-hop fields, and those the gate sets itself.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate",
                         b"proxy-authorization", b"te", b"trailer", b"transfer-encoding",
                         b"upgrade", b"host", b"content-length"})
_RESPONSE_DROPPED = _HOP_BY_HOP - {b"content-length"} | {b"server", b"date"}
CONNECT_TIMEOUT_S = 10.0


class _ClientGone(Exception):
    """The client left before its request body was read."""


def _clean(path: str) -> bool:
    """No dot segments and no empty segment before the last (``//``): nothing a router could
    resolve to another route. Checked on the decoded path and on the path as sent."""
    segments = path.split("/")[1:]
    return all(s not in (".", "..") for s in segments) and all(segments[:-1]) \
        and "\\" not in path and "%2e" not in path.lower()


def is_allowed(method: str, path: str, raw_path: str) -> bool:
    """Whether a request may go on to the router: ``/v1/...`` or a CLIENT_PATHS route (any
    method) or a probe (GET or HEAD), with a clean path both decoded and as sent."""
    if not (_clean(path) and _clean(raw_path)):
        return False
    if path.startswith(CLIENT_PREFIX) and raw_path.startswith(CLIENT_PREFIX):
        return True
    if path in CLIENT_PATHS and raw_path == path:
        return True
    return path in PROBE_PATHS and raw_path == path and method in ("GET", "HEAD")


class RouterGate:
    """The ASGI app: an allow-listed, streaming reverse proxy to ``upstream``."""

    def __init__(self, upstream: str, max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
                 ) -> None:
        self.upstream = upstream.rstrip("/")
        self.max_body_bytes = max_body_bytes
        self.client: httpx.AsyncClient | None = None

    def _client(self) -> httpx.AsyncClient:
        if self.client is None:
            # No read timeout: a long generation streams for minutes; no pool cap below the
            # router's own concurrency.
            self.client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self.client

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: refused (the handshake is never accepted)
        raw_path = scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if not is_allowed(scope["method"], scope["path"], raw_path):
            await _error(scope, receive, send, 404, "Not found (this port serves /v1/*, "
                         f"{GENERATE_PATH} and the health probes only).", "not_found")
            return
        try:
            body = await self._read_body(receive)
        except _ClientGone:
            return
        if body is None:
            await _error(scope, receive, send, 413, f"The request body is larger than "
                         f"{self.max_body_bytes} bytes.", "request_too_large")
            return
        query = scope.get("query_string", b"").decode("latin-1")
        url = self.upstream + raw_path + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP_BY_HOP]
        client = self._client()
        request = client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as e:
            logger.warning("router gate: %s %s: upstream failed: %r", scope["method"],
                           scope["path"], e)
            await _error(scope, receive, send, 502, "The router did not answer.",
                         "bad_gateway")
            return
        try:
            await self._relay(response, receive, send)
        finally:
            await response.aclose()

    async def _read_body(self, receive: Callable) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _relay(self, response: httpx.Response, receive: Callable, send: Callable
                     ) -> None:
        """Send the router's answer on as it comes; stop (closing it) if the client leaves."""
        headers = [(k, v) for k, v in response.headers.raw
                   if k.lower() not in _RESPONSE_DROPPED]

        async def copy() -> None:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        copying = asyncio.ensure_future(copy())
        watching = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait([copying, watching], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (copying, watching):
                task.cancel()
            await asyncio.gather(copying, watching, return_exceptions=True)
        if copying.done() and not copying.cancelled() and copying.exception() is not None:
            raise copying.exception()  # type: ignore[misc]

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.client is not None:
                    await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _error(scope: dict, receive: Callable, send: Callable, status: int, message: str,
                 code: str) -> None:
    await JSONResponse(error_body(status, message, code=code), status_code=status)(
        scope, receive, send)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pagellm.entrypoints.router_gate",
                                description=f"Forward /v1/*, {GENERATE_PATH} and the probes to "
                                            "vllm-router; nothing else.")
    p.add_argument("--upstream", required=True, help="the router's URL, e.g. "
                   "http://127.0.0.1:8001 (it should listen on loopback only)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies get 413 (default 8 MiB, as pagellm serve)")
    p.add_argument("--log-level", default="warning")
    ns = p.parse_args(argv)
    if ns.max_request_body_bytes < 1:
        p.error(f"--max-request-body-bytes must be >= 1, got {ns.max_request_body_bytes}")
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s [router-gate] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per forwarded request
    app: Any = RouterGate(ns.upstream, ns.max_request_body_bytes)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level, lifespan="on",
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
