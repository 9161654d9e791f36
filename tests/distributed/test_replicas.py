"""Two real `pagellm serve` replicas behind a real vllm-router (scripts/replicas.py) and its gate:
completions, chat and streams pass through (checked with the openai SDK), the API key is
enforced by the replicas through the router, the router's management API cannot be reached
through the client port (the router listens on loopback only), no key is on any command line,
round_robin reaches both, power_of_two's load poll reads each replica's load, a dead replica is
routed around, and stopping the launcher stops everything."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from tp_utils import pid_alive

from pagellm.entrypoints import replica_router, replicas
from pagellm.entrypoints.ports import free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600.0
SERVE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256",
               "--served-model-name", "tiny"]
KEY = "sk-replicas-test-key"
ADMIN_KEY = "sk-replicas-admin-key"  # given through the environment
AUTH = {"Authorization": f"Bearer {KEY}"}
# vllm-router's management routes (0.1.17), as an attacker would try them on the client port.
MANAGEMENT = [("POST", "/add_worker?url=http://127.0.0.1:9"), ("POST", "/remove_worker?url=x"),
              ("GET", "/list_workers"), ("POST", "/flush_cache"), ("GET", "/workers"),
              ("POST", "/workers"), ("GET", "/workers/http%3A%2F%2F127.0.0.1%3A9"),
              ("DELETE", "/workers/x"), ("GET", "/get_loads"), ("GET", "/get_server_info"),
              ("GET", "/v1/../list_workers"), ("GET", "/v1/%2e%2e/list_workers"),
              ("GET", "/v1/%2E%2E/list_workers"), ("GET", "//list_workers"),
              ("GET", "/v1//../list_workers"), ("GET", "/health/../list_workers"),
              ("GET", "/%76%31/../list_workers"), ("GET", "/v1/..%2flist_workers")]
BODY_CAP = 64 * 1024


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.fixture(scope="module")
def launcher(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("replicas") / "replicas.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "replicas.py"), "-dp", "2",
             "--policy", "round_robin", "--port", str(port), "--health-interval", "1",
             "--api-key", KEY, "--max-request-body-bytes", str(BODY_CAP), "--",
             str(tiny_model_dir("llama")), *SERVE_FLAGS],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                           "PAGELLM_ADMIN_API_KEY": ADMIN_KEY}, stdout=out,
            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Serving on" not in log.read_text():  # the launcher saw every replica and the router
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)
    (router_url,) = re.findall(r"router management API on (\S+) only", log.read_text())
    yield url, proc, router_url
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _workers(router_url: str) -> list[str]:
    return httpx.get(f"{router_url}/list_workers", timeout=5).json()["urls"]


def _listen_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net shows them) of sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                found.add(address)
    return found


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _successes(worker: str) -> float:
    text = httpx.get(f"{worker}/metrics", timeout=5).text  # open, as /health
    return sum(float(v) for v in re.findall(r"^pagellm:request_success_total\{.*\} (\S+)$", text,
                                            re.M))


def test_completions_chat_and_streams_pass_through(launcher) -> None:
    url, _, router_url = launcher
    client = _client(url)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    done = client.completions.create(model="tiny", prompt=[5, 17, 42], max_tokens=6,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 6
    stream = client.completions.create(model="tiny", prompt=[5, 17, 42], max_tokens=6,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == done.choices[0].text
    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                                 temperature=0.0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        chat.choices[0].message.content


def test_round_robin_reaches_both_replicas_with_the_same_model(launcher) -> None:
    url, _, router_url = launcher
    workers = _workers(router_url)
    assert len(workers) == 2
    before = [_successes(w) for w in workers]
    client = _client(url)
    texts = [client.completions.create(model="tiny", prompt=[9, 8, 7, i // 2], max_tokens=4,
                                       temperature=0.0).choices[0].text for i in range(4)]
    after = [_successes(w) for w in workers]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2.0, 2.0]
    # Each prompt went to both replicas in turn: the same greedy text from either.
    assert texts[0] == texts[1] and texts[2] == texts[3]


def test_the_api_key_is_enforced_through_the_router(launcher) -> None:
    url, _, router_url = launcher
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(url, key="sk-wrong").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH,
                      timeout=60).status_code == 200
    for worker in _workers(router_url):  # the launcher passed --api-key on to each replica
        assert httpx.post(f"{worker}/v1/completions", json=body, timeout=60).status_code == 401
    # The body cap: the router refuses a larger body; each replica would too.
    big = {**body, "prompt": "x" * BODY_CAP}
    r = httpx.post(f"{url}/v1/completions", json=big, headers=AUTH, timeout=60)
    assert r.status_code == 413, r.text
    r = httpx.post(f"{_workers(router_url)[0]}/v1/completions", json=big, headers=AUTH, timeout=60)
    assert r.status_code == 413, r.text


def test_the_routers_management_api_is_not_reachable_through_the_client_port(launcher) -> None:
    """An attacker who adds a "worker" receives other tenants' requests with their keys: the
    client port (the gate) answers every management route, and every path trick toward one,
    with a 404 that never reaches the router; the router itself listens on loopback only."""
    url, _, router_url = launcher
    workers = _workers(router_url)
    for method, path in MANAGEMENT:
        # A raw request, so no client normalizes the path first.
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), 10) as conn:
            conn.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         f"{KEY}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 404"), (method, path, reply[:200])
        assert b"/v1/*, /inference/v1/generate and the health probes only" in reply, \
            (method, path)
    assert _workers(router_url) == workers  # nothing was added or removed
    router_port = int(router_url.rsplit(":", 1)[1])
    assert _listen_addresses(router_port) == {"0100007F"}  # 127.0.0.1 only
    # What clients need still passes: the models, a completion, the probes.
    assert _client(url).models.list().data
    for probe in ("/health", "/readiness", "/liveness"):
        assert httpx.get(f"{url}{probe}", timeout=10).status_code == 200, probe


def test_no_key_is_on_any_command_line_and_admin_keys_reach_the_replicas(launcher) -> None:
    """The launcher hands the keys on in a private file: ``ps`` shows none of them for the
    replicas, the router or the gate. The admin key (from the environment) runs an admin route
    on a replica; the tenant key gets 403 there."""
    _, proc, router_url = launcher
    for pid in _children(proc.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert KEY.encode() not in cmdline and ADMIN_KEY.encode() not in cmdline, cmdline
    worker = _workers(router_url)[0]
    r = httpx.post(f"{worker}/reset_prefix_cache", headers=AUTH, timeout=60)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", r.text
    r = httpx.post(f"{worker}/reset_prefix_cache",
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    assert r.status_code == 200 and r.json() == {"success": True}, r.text


def test_power_of_two_reads_each_replicas_load(launcher) -> None:
    """power_of_two polls /get_load (without a key); the router's /get_loads shows what it
    read: 0 at rest, then the sequences running on the replica that has work."""
    url, _, router_url = launcher
    workers = _workers(router_url)
    for worker in workers:
        assert httpx.get(f"{worker}/get_load", timeout=5).json() == {"load": 0}
    # A warm tiny model runs 200 tokens in a fraction of a second: 2 x n=16 keep it busy.
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True,
            "n": 16}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = [pool.submit(httpx.post, f"{workers[0]}/v1/completions", json=body,
                               headers=AUTH, timeout=300) for _ in range(2)]
        seen: dict[str, int] = {}
        while not all(r.done() for r in running):
            loads = httpx.get(f"{router_url}/get_loads", timeout=5).json()["workers"]
            seen = {w["worker"]: w["load"] for w in loads}
            if seen[workers[0]] > 0:
                break
        assert all(r.result().status_code == 200 for r in running)
    assert 1 <= seen[workers[0]] <= 32 and seen[workers[1]] == 0, seen


def test_a_dead_replica_is_routed_around(launcher) -> None:
    url, proc, router_url = launcher
    victim_url = _workers(router_url)[0]
    port = victim_url.rsplit(":", 1)[1]
    (victim,) = [pid for pid in _children(proc.pid)
                 if f"--port\0{port}\0" in Path(f"/proc/{pid}/cmdline").read_text()]
    os.kill(victim, signal.SIGKILL)
    client = _client(url)
    for i in range(4):  # the router retries a refused connection on the other replica
        assert client.completions.create(model="tiny", prompt=[3, 4, i], max_tokens=2).choices
    assert proc.poll() is None


def test_stopping_the_launcher_stops_the_router_and_replicas(launcher) -> None:
    _, proc, _ = launcher
    children = _children(proc.pid)  # the live replica and the router (its process title)
    assert any(b"vllm::router" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert not any(pid_alive(pid) for pid in children)


def test_sigterm_during_start_up_stops_the_replicas(tiny_model_dir) -> None:
    """SIGTERM to the launcher before its replicas are even up leaves no server behind."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagellm.entrypoints.replicas", "-dp", "2", "--port",
         str(free_port()), "--", str(tiny_model_dir("llama")), *SERVE_FLAGS],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    children: list[int] = []
    deadline = time.monotonic() + 60
    while len(children) < 2 and time.monotonic() < deadline:
        children = _children(proc.pid)
        time.sleep(0.2)
    assert len(children) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert not any(pid_alive(pid) for pid in children)


def test_a_replica_whose_port_was_taken_starts_again_on_a_new_one(tiny_model_dir,
                                                                   monkeypatch) -> None:
    """free_port releases the port it finds; a process that takes it while the replica loads
    makes the replica's bind fail: the launcher starts it again on a new port."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports = iter([taken])
        monkeypatch.setattr(replicas, "free_port", lambda: next(ports, None) or free_port())
        started = replicas.launch_replicas(1, [str(tiny_model_dir("llama")), *SERVE_FLAGS],
                                           None)
        try:
            replicas.wait_healthy(started.procs, {n: f"{u}/health" for n, u in
                                                  started.urls.items()}, START_TIMEOUT_S,
                                  restart=started.relaunch_if_port_lost)
            replica = started.replicas["replica 0"]
            url = replica.url
            assert replica.starts == 2 and replica.port != taken
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        finally:
            replicas.stop_processes(list(started.procs.values()))


def test_a_replica_that_fails_otherwise_is_not_started_again() -> None:
    started = replicas.launch_replicas(1, ["--no-such-flag"], None)
    with pytest.raises(RuntimeError, match="replica 0 exited with 2 during start-up"):
        replicas.wait_healthy(started.procs, {"replica 0": f"{started.urls['replica 0']}/health"},
                              60, restart=started.relaunch_if_port_lost)
    assert [r.starts for r in started.replicas.values()] == [1]


def test_a_replica_starts_at_most_three_times(monkeypatch) -> None:
    monkeypatch.setattr(replicas, "port_taken", lambda port: True)
    started = replicas.launch_replicas(1, ["--no-such-flag"], None)
    with pytest.raises(RuntimeError, match="replica 0 exited with 2 during start-up"):
        replicas.wait_healthy(started.procs, {"replica 0": f"{started.urls['replica 0']}/health"},
                              120, restart=started.relaunch_if_port_lost)
    assert [r.starts for r in started.replicas.values()] == [replicas.REPLICA_START_ATTEMPTS]


def test_port_taken_sees_a_listener_only() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert replicas.port_taken(port)
    assert not replicas.port_taken(port)


def test_a_missing_router_names_the_fix(monkeypatch, caplog) -> None:
    real_find_spec = replica_router.importlib.util.find_spec
    monkeypatch.setattr(replica_router.importlib.util, "find_spec",
                        lambda name: None if name == "vllm_router_rs" else real_find_spec(name))
    monkeypatch.setattr(replicas, "launch_replicas", lambda *a: pytest.fail("launched"))
    with pytest.raises(SystemExit) as exit_info:
        replicas.main(["-dp", "2", "--", "MODEL"])
    assert exit_info.value.code == 2
    assert "pip install 'pagellm[router]'" in caplog.text


@pytest.mark.parametrize("argv, message", [
    (["--backend", "http://a:1", "--policy", "power_of_two"], "at least 2 replicas"),
    (["-dp", "2", "--policy", "kv_aware", "--", "M"], "invalid choice: 'kv_aware'"),
    (["-dp", "2", "--", "M", "--api-key", "k"], "give --api-key before --"),
    (["--backend", "http://a:1", "--", "M"], "only for launched replicas"),
    (["-dp", "2", "--health-interval", "0", "--", "M"], "--health-interval must be >= 1"),
    (["-dp", "2", "--router-log-level", "loud", "--", "M"], "--router-log-level must be one"),
])
def test_bad_command_lines_are_refused(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        replicas.parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_router_command_line_parses_with_vllm_router() -> None:
    from vllm_router.launch_router import parse_router_args

    ns, _ = replicas.parse_args(["-dp", "2", "--policy", "cache_aware", "--host", "0.0.0.0",
                                 "--port", "9000", "--router-args", "--cache-threshold 0.5",
                                 "--", "M"])
    options = dataclasses.replace(ns.router, port=9001)  # main() picks a free one
    cmd = replica_router.router_command(["http://127.0.0.1:1", "http://127.0.0.1:2"], options)
    assert cmd[1:3] == ["-m", "vllm_router.launch_router"]
    args = parse_router_args(cmd[3:])
    assert args.worker_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert (args.policy, args.port, args.cache_threshold) == ("cache_aware", 9001, 0.5)
    # --host is the gate's: the router's management API stays on loopback.
    assert (args.host, args.prometheus_host) == ("127.0.0.1", "0.0.0.0")
    assert args.max_payload_size == 8 * 2**20


def test_the_fields_vllm_router_adds_are_known(caplog) -> None:
    """vllm-router re-serializes each body with SGLang's fields at their defaults (as captured
    from vllm-router 0.1.17): accepted without an "unknown field" warning; other values are a
    400 naming the field."""
    from pydantic import ValidationError

    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    completion = {"model": "tiny", "prompt": "x", "stream": False, "echo": False,
                  "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                  "return_hidden_states": False}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
            "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
            "return_hidden_states": False, "include_reasoning": True}
    with caplog.at_level("WARNING", logger="pagellm"):
        CompletionRequest(**completion)
        ChatCompletionRequest(**chat)
    assert "unknown" not in caplog.text
    for model, body, name, value in (
            (CompletionRequest, completion, "no_stop_trim", True),
            (CompletionRequest, completion, "return_hidden_states", True),
            (ChatCompletionRequest, chat, "separate_reasoning", False),
            (ChatCompletionRequest, chat, "include_reasoning", False)):
        with pytest.raises(ValidationError, match=name):
            model(**{**body, name: value})
