"""The replica proxy (`python -m pagellm.entrypoints.replicas --backend ...`, a real process on a
real port) in front of two fake replicas (stdlib HTTP servers in this process that record what
reaches them): API keys, the body cap, slow clients, and no retry once a body was sent."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from pagellm.entrypoints import replica_proxy, replicas
from pagellm.entrypoints.openai import limits
from pagellm.worker.multiproc_executor import free_port

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-proxy-test-0123456789"
FILE_KEY = "sk-proxy-file-key-abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAP = 1000  # --max-request-body-bytes of the proxy under test
CLIENT_TIMEOUT_S = 0.5


class FakeReplica:
    """/health is 200; a POST is recorded (path, body length) and answered, or, with ``drop``,
    read whole and then left unanswered (a replica that dies while running the request)."""

    def __init__(self) -> None:
        self.received: list[tuple[str, int]] = []
        self.drop = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._answer({"path": self.path})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                fake.received.append((self.path, len(body)))
                if fake.drop:
                    self.close_connection = True
                    return
                self._answer({"got": len(body)})

            def _answer(self, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(ConnectionError):  # health checks read one line
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def backends() -> Iterator[list[FakeReplica]]:
    fakes = [FakeReplica(), FakeReplica()]
    yield fakes
    for fake in fakes:
        fake.close()


def start_proxy(backends: list[FakeReplica], flags: list[str], log: Path
                ) -> tuple[str, subprocess.Popen]:
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagellm.entrypoints.replicas", "--port", str(port),
             "--health-interval", "0.2", *[a for b in backends for a in ("--backend", b.url)],
             *flags],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "PAGELLM_API_KEY": ""},
            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            stats = httpx.get(f"{url}/proxy/stats", headers=AUTH, timeout=2)
            if stats.status_code == 200 and all(r["healthy"] for r in stats.json()):
                return url, proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@pytest.fixture(scope="module")
def proxy(backends, tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("proxy")
    key_file = tmp / "keys.txt"
    key_file.write_text(f"# tenants\n\n{FILE_KEY} team-b\n")
    url, proc = start_proxy(backends, [
        "--api-key", KEY, "--api-key-file", str(key_file), "--max-request-body-bytes",
        str(CAP), "--client-timeout", str(CLIENT_TIMEOUT_S)], tmp / "proxy.log")
    yield url
    stop(proc)
    assert FILE_KEY not in (tmp / "proxy.log").read_text()  # keys are never logged


@pytest.fixture(autouse=True)
def reset(backends) -> None:
    for fake in backends:
        fake.received.clear()
        fake.drop = False


def raw_exchange(url: str, data: bytes, pause_after: bool = False) -> bytes:
    """Send ``data`` on a fresh connection (then, with ``pause_after``, send nothing more) and
    read until the proxy closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(data)
        if not pause_after:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def post_head(length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def test_stats_and_forwarding_need_an_api_key(proxy, backends):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        r = httpx.get(f"{proxy}/proxy/stats", headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{proxy}/v1/completions", headers=headers, json={"a": 1}, timeout=10)
        assert r.status_code == 401
    assert all(not fake.received for fake in backends)  # refused before any replica
    for key in (KEY, FILE_KEY):
        r = httpx.get(f"{proxy}/proxy/stats", headers={"Authorization": f"Bearer {key}"},
                      timeout=10)
        assert r.status_code == 200 and len(r.json()) == 2
    for path in ("/health", "/proxy/metrics"):  # probes and scrapers carry no key
        assert httpx.get(f"{proxy}{path}", timeout=10).status_code == 200
    r = httpx.post(f"{proxy}/v1/completions", headers=AUTH, json={"a": 1}, timeout=10)
    assert r.status_code == 200 and r.json() == {"got": len(b'{"a":1}')}


def test_bodies_past_the_cap_never_reach_a_replica(proxy, backends):
    assert raw_exchange(proxy, post_head(CAP + 1)).startswith(b"HTTP/1.1 413 ")
    assert raw_exchange(proxy, post_head(10**12)).startswith(b"HTTP/1.1 413 ")
    for bad in ("-1", "+5", "1e3", "0x10"):
        head = post_head(0).replace(b"Content-Length: 0", f"Content-Length: {bad}".encode())
        assert raw_exchange(proxy, head).startswith(b"HTTP/1.1 400 ")
    two = post_head(5).replace(b"\r\n\r\n", b"\r\nContent-Length: 5000\r\n\r\n")
    assert raw_exchange(proxy, two + b"x" * 5000).startswith(b"HTTP/1.1 400 ")
    assert all(not fake.received for fake in backends)
    # At the cap: forwarded whole.
    assert b'{"got": 1000}' in raw_exchange(proxy, post_head(CAP) + b"x" * CAP)
    # A Content-Length smaller than the body: only that many bytes go on, never more.
    assert b'{"got": 10}' in raw_exchange(proxy, post_head(10) + b"y" * (CAP * 5))
    # No Content-Length: no body.
    no_length = post_head(0).replace(b"Content-Length: 0\r\n", b"")
    assert b'{"got": 0}' in raw_exchange(proxy, no_length + b"z" * (CAP * 5))
    assert sorted(n for fake in backends for _, n in fake.received) == [0, 10, CAP]


def test_slow_clients_are_cut(proxy, backends):
    # Headers never finished, and a body shorter than its Content-Length: 408, then closed.
    partial_head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}"
    for data in (partial_head.encode(), post_head(100) + b"x" * 10):
        answer = raw_exchange(proxy, data, pause_after=True)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert all(not fake.received for fake in backends)


def test_a_request_that_reached_a_replica_is_never_retried(proxy, backends):
    for fake in backends:
        fake.drop = True  # reads the whole request, then dies without answering
    r = httpx.post(f"{proxy}/v1/completions", headers=AUTH, json={"prompt": "x"}, timeout=30)
    assert r.status_code == 502 and "not retried" in r.text
    # It ran once, on one replica: generation is not idempotent.
    assert sorted(len(fake.received) for fake in backends) == [0, 1]
    failed = next(i for i, fake in enumerate(backends) if fake.received)
    stats = httpx.get(f"{proxy}/proxy/stats", headers=AUTH, timeout=10).json()
    assert stats[failed]["failures"] == 1


def test_flags_and_their_forwarding(tmp_path):
    ns, serve = replicas.parse_args(["-dp", "2", "--", "MODEL", "--dtype", "float32"])
    assert ns.max_request_body_bytes == limits.DEFAULT_MAX_REQUEST_BODY_BYTES
    assert replica_proxy.DEFAULT_MAX_BODY_BYTES == limits.DEFAULT_MAX_REQUEST_BODY_BYTES
    assert ns.client_timeout == 30.0
    key_file = tmp_path / "keys"
    key_file.write_text("k1 a\n")
    ns, serve = replicas.parse_args(["-dp", "2", "--api-key", "k0", "--api-key-file",
                                     str(key_file), "--max-request-body-bytes", "4096", "--",
                                     "MODEL"])
    assert replicas.replica_serve_args(ns, serve) == [
        "MODEL", "--api-key", "k0", "--api-key-file", str(key_file),
        "--max-request-body-bytes", "4096"]
    assert len(ns.api_keys) == 2
    for flag in ("--api-key", "--api-key=k", "--max-request-body-bytes"):
        with pytest.raises(SystemExit):
            replicas.parse_args(["-dp", "1", "--", "MODEL", flag, "1"])
