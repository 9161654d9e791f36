"""A tiny least-loaded HTTP proxy in front of N ``pagellm serve`` replicas (stdlib asyncio).

Each client request goes to the healthy replica with the fewest requests in flight through this
proxy (ties: the one that served fewest). Replicas are health-checked with ``GET /health`` every
``health_interval_s``; a replica that refuses a connection is marked down at once and the request
is retried on another (nothing was sent yet, so this is safe). Once a connection is open the
request is never retried: its body may have reached the replica, and generation is not
idempotent, so a replica that fails before answering is a 502. Responses, streamed ones
included, are piped through byte for byte with one header added, ``x-pagellm-replica: <index>``.
Requests already running on a replica that dies fail; new ones go to the others.

The proxy holds clients to the server's own rules: with API keys, every path but the open
ones needs a key, checked before any body is read; bodies over ``max_body_bytes`` are a 413
(only Content-Length bytes are ever read, so no body can be larger); a client that has not
sent its whole request within ``client_timeout_s`` gets a 408 and is cut.

The proxy answers three paths itself: ``/health`` (200 while any replica is healthy, else 503),
``/proxy/stats`` (JSON, per replica; needs a key when keys are configured) and
``/proxy/metrics`` (Prometheus text, per replica; open, as the server's /metrics).
One request per client connection (``Connection: close``), which every HTTP client handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pagellm.entrypoints.openai.tenancy import OPEN_PATHS, ApiKeys

logger = logging.getLogger("pagellm")

_MAX_HEAD = 64 * 1024
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade",
               "transfer-encoding"}
DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # the server's --max-request-body-bytes default
DEFAULT_CLIENT_TIMEOUT_S = 30.0
_OPEN_PATHS = OPEN_PATHS | {"/proxy/metrics"}


@dataclass
class Replica:
    index: int
    url: str  # http://host:port
    pid: int | None = None  # when this process launched it
    healthy: bool = False
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    last_check: float = field(default=0.0)

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80

    def as_dict(self) -> dict:
        return {"index": self.index, "url": self.url, "pid": self.pid, "healthy": self.healthy,
                "in_flight": self.in_flight, "served": self.served, "failures": self.failures}


class ReplicaProxy:
    def __init__(self, replicas: list[Replica], health_interval_s: float = 1.0,
                 health_timeout_s: float = 2.0, api_keys: ApiKeys | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S) -> None:
        if not replicas:
            raise ValueError("the proxy needs at least one replica")
        self.replicas = replicas
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes
        self.client_timeout_s = client_timeout_s
        self._server: asyncio.base_events.Server | None = None

    # ---- routing ------------------------------------------------------------------------------
    def pick(self, exclude: set[int]) -> Replica | None:
        live = [r for r in self.replicas if r.healthy and r.index not in exclude]
        return min(live, key=lambda r: (r.in_flight, r.served, r.index), default=None)

    async def serve(self, host: str, port: int) -> None:
        """Health-check the replicas and serve clients until cancelled."""
        checker = asyncio.create_task(self._health_loop())
        self._server = await asyncio.start_server(self._handle, host, port, limit=_MAX_HEAD)
        logger.info("Replica proxy on http://%s:%d -> %s", host, port,
                    ", ".join(r.url for r in self.replicas))
        try:
            async with self._server:
                await self._server.serve_forever()
        finally:
            checker.cancel()

    # ---- health -------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(r) for r in self.replicas))
            await asyncio.sleep(self.health_interval_s)

    async def _check(self, replica: Replica) -> None:
        ok = False
        with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError, IndexError):
            ok = await asyncio.wait_for(self._get_status(replica, "/health"),
                                        self.health_timeout_s) == 200
        if ok != replica.healthy:
            logger.log(logging.INFO if ok else logging.WARNING, "replica %d (%s) is %s",
                       replica.index, replica.url, "healthy" if ok else "DOWN")
        replica.healthy = ok
        replica.last_check = time.monotonic()

    @staticmethod
    async def _get_status(replica: Replica, path: str) -> int:
        host, port = replica.host_port
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                         "Connection: close\r\n\r\n".encode())
            await writer.drain()
            status_line = await reader.readline()
            return int(status_line.split()[1])
        finally:
            writer.close()

    # ---- one client connection ------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                async with asyncio.timeout(self.client_timeout_s):
                    request = await self._read_request(reader, writer)
            except TimeoutError:  # before OSError, its base class
                return await _reply(writer, 408, {"error": "the request was not sent within "
                                                  f"{self.client_timeout_s:g} s"})
            if request is None:
                return  # refused, and answered
            method, target, path, headers, body = request
            if path == "/health":
                live = sum(r.healthy for r in self.replicas)
                return await _reply(writer, 200 if live else 503,
                                    {"healthy_replicas": live, "replicas": len(self.replicas)})
            if path == "/proxy/stats":
                return await _reply(writer, 200, [r.as_dict() for r in self.replicas])
            if path == "/proxy/metrics":
                return await _reply(writer, 200, self._metrics(), "text/plain; version=0.0.4")
            await self._forward(method, target, headers, body, writer)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            with contextlib.suppress(OSError):
                await _reply(writer, 400, {"error": "malformed HTTP request"})
        except (ConnectionError, OSError):
            pass  # the client went away
        finally:
            writer.close()

    async def _read_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                            ) -> tuple[str, str, str, dict[str, str], bytes] | None:
        """(method, target, path, headers, body), or None once a refusal is sent. The key is
        checked and the length capped before any body byte is read."""
        head = await reader.readuntil(b"\r\n\r\n")
        method, target, headers = _parse_head(head)
        path = target.split("?", 1)[0]
        if self.api_keys is not None and path not in _OPEN_PATHS and method != "OPTIONS" and \
                self.api_keys.identity_of(headers.get("authorization", "").encode("latin-1")) \
                is None:
            await _reply(writer, 401, {"error": {
                "message": "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})
            return None
        if "chunked" in headers.get("transfer-encoding", "").lower():
            await _reply(writer, 411, {"error": "chunked request bodies are not supported; "
                                                "send Content-Length"})
            return None
        length = headers.get("content-length", "0")
        if not length.isdigit():  # no sign, no spaces: one reading for us and the replica
            raise ValueError("bad Content-Length")
        if int(length) > self.max_body_bytes:
            await _reply(writer, 413, {"error": f"the request body is larger than "
                                                f"{self.max_body_bytes} bytes"})
            return None
        return method, target, path, headers, await reader.readexactly(int(length))

    async def _forward(self, method: str, target: str, headers: dict[str, str], body: bytes,
                       client: asyncio.StreamWriter) -> None:
        tried: set[int] = set()
        while (replica := self.pick(tried)) is not None:
            tried.add(replica.index)
            host, port = replica.host_port
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port, limit=_MAX_HEAD), self.health_timeout_s)
            except OSError:  # TimeoutError included
                replica.healthy = False  # refused: down until the health check says otherwise
                replica.failures += 1
                logger.warning("replica %d (%s) refused a connection; marked DOWN",
                               replica.index, replica.url)
                continue
            # Connected: from here the body may reach the replica, so no other replica gets it.
            replica.in_flight += 1
            try:
                try:
                    up_writer.write(_request_head(method, target, headers, host, port,
                                                  len(body)))
                    up_writer.write(body)
                    await up_writer.drain()
                    head = await up_reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                        OSError):
                    replica.failures += 1
                    logger.warning("replica %d (%s) failed before answering; not retried (the "
                                   "request may have run)", replica.index, replica.url)
                    await _reply(client, 502, {"error": f"replica {replica.index} failed "
                                               "before answering; the request was not retried "
                                               "(it may have run)"})
                    return
                client.write(head[:-2] + f"x-pagellm-replica: {replica.index}\r\n\r\n".encode())
                while chunk := await up_reader.read(65536):
                    client.write(chunk)
                    await client.drain()
                replica.served += 1
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                    OSError):
                replica.failures += 1
                raise ConnectionError("replica or client connection lost") from None
            finally:
                replica.in_flight -= 1
                up_writer.close()
            return
        await _reply(client, 503, {"error": "no healthy replica"})

    def _metrics(self) -> str:
        lines = []
        for name, kind, attr in (("pagellm_proxy_replica_healthy", "gauge", "healthy"),
                                 ("pagellm_proxy_replica_in_flight", "gauge", "in_flight"),
                                 ("pagellm_proxy_replica_served_total", "counter", "served"),
                                 ("pagellm_proxy_replica_failures_total", "counter", "failures")):
            lines.append(f"# TYPE {name} {kind}")
            lines += [f'{name}{{replica="{r.index}",url="{r.url}"}} {int(getattr(r, attr))}'
                      for r in self.replicas]
        return "\n".join(lines) + "\n"


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, target, _version = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length" and name in headers:
                raise ValueError("two Content-Length headers")  # which one would a peer use?
            headers[name] = value.strip()
    return method, target, headers


def _request_head(method: str, target: str, headers: dict[str, str], host: str, port: int,
                  body_len: int) -> bytes:
    out = [f"{method} {target} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
           f"Content-Length: {body_len}"]
    out += [f"{k}: {v}" for k, v in headers.items()
            if k not in _HOP_BY_HOP and k not in ("host", "content-length")]
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")


async def _reply(writer: asyncio.StreamWriter, status: int, payload: object,
                 content_type: str = "application/json") -> None:
    body = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
    reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 408: "Request Timeout",
              411: "Length Required", 413: "Content Too Large", 502: "Bad Gateway",
              503: "Service Unavailable"}.get(status, "")
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
