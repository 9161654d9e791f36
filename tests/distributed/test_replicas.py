"""Two real `pagellm serve` replicas behind the least-loaded proxy (scripts/replicas.py): both
serve, streaming passes through, a dead replica is routed around without failing requests, and
stopping the launcher stops every replica."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tp_utils import pid_alive

from pagellm.worker.multiproc_executor import free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600.0
SERVE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256",
               "--served-model-name", "tiny"]
KEY = "sk-replicas-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}




@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("replicas") / "replicas.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "replicas.py"), "--data-parallel-size", "2",
             "--port", str(port), "--health-interval", "0.3", "--api-key", KEY, "--",
             str(tiny_model_dir("llama")), *SERVE_FLAGS],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)
    yield url, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _stats(url: str) -> list[dict]:
    return httpx.get(f"{url}/proxy/stats", headers=AUTH, timeout=5).json()


def _complete(url: str, prompt: list[int], max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True})


def test_both_replicas_serve_the_same_model(proxy) -> None:
    url, _ = proxy
    assert [r["healthy"] for r in _stats(url)] == [True, True]
    prompt = [5, 17, 42, 99, 7]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: _complete(url, prompt, max_tokens=24), range(6)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    # Least-loaded routing spreads concurrent requests over both replicas...
    assert {r.headers["x-pagellm-replica"] for r in responses} == {"0", "1"}
    # ...which run the same model: the same greedy text from either.
    assert len({r.json()["choices"][0]["text"] for r in responses}) == 1
    served = [r["served"] for r in _stats(url)]
    assert sum(served) >= 6 and min(served) >= 1


def test_the_api_key_reaches_every_replica(proxy) -> None:
    url, _ = proxy
    assert httpx.get(f"{url}/proxy/stats", timeout=5).status_code == 401
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
    for replica in _stats(url):  # the launcher passed --api-key on to each replica
        r = httpx.post(f"{replica['url']}/v1/completions", json=body, timeout=60)
        assert r.status_code == 401, r.text
        r = httpx.post(f"{replica['url']}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text


def test_streaming_passes_through(proxy) -> None:
    url, _ = proxy
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH,
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    assert text == _complete(url, [5, 6, 7], max_tokens=6).json()["choices"][0]["text"]


def _wait_closed(replica_url: str) -> None:
    """Until the killed replica's port refuses connections (its threads may hold the socket a
    moment after the process is a zombie): a connection the dying process still accepted may
    have delivered its body, so the proxy answers 502 instead of retrying."""
    host, port = replica_url.removeprefix("http://").split(":")
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except ConnectionRefusedError:
            return
        except OSError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_dead_replica_is_routed_around(proxy) -> None:
    url, launcher = proxy
    victim = _stats(url)[0]
    os.kill(victim["pid"], signal.SIGKILL)
    _wait_closed(victim["url"])
    # Straight away (before any health check can notice), requests still succeed: a refused
    # connection is retried on another replica.
    for i in range(4):
        r = _complete(url, [3, 4, 5 + i])
        assert r.status_code == 200, r.text
        assert r.headers["x-pagellm-replica"] == "1"
    deadline = time.monotonic() + 10
    while _stats(url)[0]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [r["healthy"] for r in _stats(url)] == [False, True]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    metrics = httpx.get(f"{url}/proxy/metrics", timeout=5).text
    assert 'pagellm_proxy_replica_healthy{replica="0"' in metrics
    assert launcher.poll() is None  # the front end stays up

    # The last replica gone too: a clear 503, not a hang.
    last = _stats(url)[1]
    os.kill(last["pid"], signal.SIGKILL)
    _wait_closed(last["url"])
    r = _complete(url, [3, 4, 5])
    assert r.status_code == 503 and "no healthy replica" in r.text, r.text
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_stopping_the_launcher_stops_every_replica(tiny_model_dir) -> None:
    """SIGTERM to the launcher (before its replicas are even up) leaves no server behind."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagellm.entrypoints.replicas", "-dp", "2", "--port", str(port),
         "--", str(tiny_model_dir("llama")), *SERVE_FLAGS],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    children: list[int] = []
    deadline = time.monotonic() + 60
    while len(children) < 2 and time.monotonic() < deadline:
        children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
                    .read_text().split()]
        time.sleep(0.2)
    assert len(children) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert not any(pid_alive(pid) for pid in children)
