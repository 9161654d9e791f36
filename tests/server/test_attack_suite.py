"""The hostile-input suite (docs/reliability.md, "The attack suite"): each attack of issue 34 runs
against a real ``pagellm serve`` (a tiny random model; two tenant keys and an admin key from
--api-key-file) and a real vllm-router behind its gate, while a pinger sends ``/health`` and a
small streaming completion every 50 ms. Throughout each attack no ping waits longer than the
stall budget (250 ms to /health's answer and to the stream's response headers), every attack
gets its documented 4xx, nothing leaks between tenants, and the server's memory stays under the
documented bound."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import REPO, ServerProcess
from weight_update_utils import perturbed_model

from pagellm.entrypoints.openai.limits import (
    DEFAULT_MAX_PROMPT_LOGPROBS_ENTRIES,
    DEFAULT_MAX_STRUCTURED_OUTPUTS_CHOICES,
    DEFAULT_MAX_TOOLS,
)
from pagellm.entrypoints.ports import free_port

STALL_BUDGET_S = 0.25  # /health: the event loop answers within it
# A streamed 2-token completion's headers: admission plus the engine's next step and first
# token, beside a 4,000-token n=2 tool stream (the CI run of 2026-12-03 saw 319 ms once in
# 217 pings on an AVX2-only machine, 66 ms at issue 34: see that stop's closing note).
STREAM_HEADERS_BUDGET_S = 0.5
PING_INTERVAL_S = 0.05
# The server's processes (API server and engine core) may grow by at most this much over the
# whole suite: the two grammar caches' byte bounds (docs/reliability.md) plus the allocator's
# slack. Measured: see the closing note of issue 34.
MEMORY_GROWTH_BOUND_BYTES = 768 * 2**20
TENANT_A, TENANT_B, ADMIN = "sk-tenant-a-key", "sk-tenant-b-key", "sk-admin-key"
MAX_MODEL_LEN = 4608
ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory",
        "256MiB", "--max-num-seqs", "16", "--max-num-batched-tokens", "2048",
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-sleep-mode",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3"]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights-root")


@pytest.fixture(scope="module")
def server(tmp_path_factory, make_tiny_model, weights_root) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("attack-suite")
    model = make_tiny_model(root / "model", "llama", max_position_embeddings=8192)
    keys = root / "keys.txt"
    keys.write_text(f"{TENANT_A} tenant-a\n{TENANT_B} tenant-b\n{ADMIN} ops role=admin\n")
    srv = ServerProcess([str(model), *ARGS, "--api-key-file", str(keys),
                         "--allowed-weights-path", str(weights_root)], root / "server.log")
    srv.model_dir = model  # type: ignore[attr-defined]
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def gate(server, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """vllm-router and its gate in front of the server: (client URL, router URL)."""
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "replicas.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagellm.entrypoints.replicas", "--backend",
             server.base_url, "--policy", "round_robin", "--port", str(port)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while "Serving on" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    (router_url,) = re.findall(r"router management API on (\S+) only", log.read_text())
    try:
        yield f"http://127.0.0.1:{port}", router_url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) * 1024


@pytest.fixture(scope="module")
def memory(server) -> Iterator[None]:
    """The API server's and the engine core's resident memory may not grow past the bound
    over the suite (measured after the first warm request)."""
    pids = (server.proc.pid, server.engine_pid)
    httpx.post(f"{server.base_url}/v1/completions", headers=auth(TENANT_A), timeout=120,
               json={"prompt": "warm up", "max_tokens": 4}).raise_for_status()
    before = sum(_rss_bytes(p) for p in pids)
    yield
    growth = sum(_rss_bytes(p) for p in pids) - before
    print(f"memory growth over the attack suite: {growth / 2**20:.0f} MiB")
    assert growth <= MEMORY_GROWTH_BOUND_BYTES, growth


def ping_loop(base_url: str, key: str, ready, stopped, results) -> None:
    """Every PING_INTERVAL_S until ``stopped``: /health (time to its answer) and a 2-token
    streamed completion (time to its response headers: the event loop admitted it). Runs in
    a process of its own, so the test's own work (encoding a 5 MB body, decoding a 4 MB
    answer) never delays a ping; puts (health times, stream times, failures) on ``results``."""
    health: list[float] = []
    stream: list[float] = []
    failures: list[str] = []
    # Token ids: the ping measures the event loop and admission, not the tokenizer thread's
    # queue (one thread, shared by every request: a 480 KB prompt holds it ~0.4 s).
    body = {"prompt": [5, 17, 42], "max_tokens": 2, "stream": True}
    with httpx.Client(base_url=base_url, timeout=30, headers=auth(key)) as client:
        while not stopped.is_set():
            start = time.perf_counter()
            r = client.get("/health")
            health.append(time.perf_counter() - start)
            if r.status_code != 200:
                failures.append(f"/health {r.status_code}")
            start = time.perf_counter()
            with client.stream("POST", "/v1/completions", json=body) as r:
                stream.append(time.perf_counter() - start)
                if r.status_code != 200:
                    failures.append(f"stream {r.status_code}")
                r.read()
            ready.set()
            stopped.wait(PING_INTERVAL_S)
    results.put((health, stream, failures))


@contextlib.contextmanager
def pinged(server: ServerProcess) -> Iterator[None]:
    """Run the body as an attack: the pings go on throughout and must stay in the budget."""
    ctx = multiprocessing.get_context("spawn")
    ready, stopped, results = ctx.Event(), ctx.Event(), ctx.Queue()
    pinger = ctx.Process(target=ping_loop, daemon=True,
                         args=(server.base_url, TENANT_A, ready, stopped, results))
    pinger.start()
    assert ready.wait(120), "the pinger did not start"
    try:
        yield
    finally:
        stopped.set()
        health, stream, failures = results.get(timeout=60)
        pinger.join(30)
    report = (f"{len(health)} pings; worst /health {max(health, default=0) * 1e3:.0f} ms, "
              f"worst stream headers {max(stream, default=0) * 1e3:.0f} ms; failures "
              f"{failures[:5]}")
    print(report)
    assert health and stream and not failures, report
    assert max(health) <= STALL_BUDGET_S and max(stream) <= STREAM_HEADERS_BUDGET_S, report


def error_of(r: httpx.Response, status: int, param: str | None = None,
             code: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err["message"]


def greedy(server: ServerProcess, key: str = TENANT_A) -> str:
    r = httpx.post(f"{server.base_url}/v1/completions", headers=auth(key), timeout=120,
                   json={"prompt": "The capital of France is", "max_tokens": 8,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_routers_management_api_is_closed(server, gate, memory) -> None:
    """A client that adds its own "worker" would get every other request of other tenants:
    through the gate every management route is a 404, and the router keeps its one worker."""
    url, router_url = gate
    with pinged(server):
        for method, path in [("POST", "/add_worker?url=http://127.0.0.1:9"),
                             ("POST", "/remove_worker?url=" + server.base_url),
                             ("GET", "/list_workers"), ("POST", "/flush_cache"),
                             ("GET", "/workers"), ("POST", "/workers"),
                             ("DELETE", "/workers/x"), ("GET", "/v1/../list_workers")]:
            r = httpx.request(method, url + path, headers=auth(TENANT_A), timeout=30)
            error_of(r, 404, code="not_found")
        r = httpx.post(f"{url}/v1/completions", headers=auth(TENANT_B), timeout=60,
                       json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    workers = httpx.get(f"{router_url}/list_workers", timeout=10).json()["urls"]
    assert workers == [server.base_url]


ADMIN_ROUTES = [("POST", "/reset_prefix_cache", None), ("POST", "/sleep?level=1", None),
                ("POST", "/wake_up", None), ("GET", "/is_sleeping", None),
                ("POST", "/update_weights_from_disk", {"model_path": "x"})]


def test_tenant_keys_cannot_run_the_admin_routes(server, memory) -> None:
    before = greedy(server)
    with pinged(server):
        for method, path, body in ADMIN_ROUTES:
            for key in (TENANT_A, TENANT_B):
                r = httpx.request(method, server.base_url + path, headers=auth(key),
                                  json=body, timeout=60)
                error_of(r, 403, code="admin_key_required")
            r = httpx.request(method, server.base_url + path, json=body, timeout=60)
            error_of(r, 401, code="invalid_api_key")
        # Nothing happened: the engine is awake, and tenants are served.
        r = httpx.get(f"{server.base_url}/is_sleeping", headers=auth(ADMIN), timeout=60)
        assert r.json() == {"is_sleeping": False}
        assert greedy(server, TENANT_B)
    # The admin key may (outside the pings: a sleeping engine answers them 503): a sleep and a
    # wake, then the same greedy text.
    for path in ("/sleep?level=1", "/wake_up"):
        r = httpx.post(server.base_url + path, headers=auth(ADMIN), timeout=120)
        assert r.status_code == 200, r.text
    assert greedy(server) == before


def test_weight_paths_stay_under_the_root_and_tell_nothing(server, weights_root,
                                                           tmp_path, memory) -> None:
    """Outside --allowed-weights-path nothing is read; inside it, a missing folder, a folder
    that is no checkpoint and one of another shape get the same kind of answer, naming no file
    and echoing no loader error; a checkpoint with one good and one wrongly shaped tensor
    changes nothing."""
    outside = tmp_path / "outside"
    perturbed_model(server.model_dir, outside)
    (weights_root / "link-out").symlink_to(outside)
    (weights_root / "not-a-checkpoint").mkdir()
    (weights_root / "not-a-checkpoint" / "secret.txt").write_text("SECRET-CONTENT")
    half = weights_root / "half-bad"
    perturbed_model(server.model_dir, half)
    _break_one_tensor(half)
    before = greedy(server)

    def update(path: str) -> httpx.Response:
        return httpx.post(f"{server.base_url}/update_weights_from_disk", headers=auth(ADMIN),
                          json={"model_path": path}, timeout=300)

    with pinged(server):
        for path in (str(outside), "../" + outside.name, str(weights_root / "link-out"),
                     "/etc", "/proc/self"):
            message = error_of(update(path), 400, "model_path")
            assert "--allowed-weights-path" in message, message
        for path in ("missing", "not-a-checkpoint", str(half)):
            message = error_of(update(path), 400, "model_path")
            assert "secret.txt" not in message and "SECRET" not in message, message
            assert "Error" not in message and "Traceback" not in message, message
    assert greedy(server) == before  # the half-bad checkpoint changed nothing


def _break_one_tensor(folder: Path) -> None:
    """Keep the first tensor of the checkpoint as it is and give another a wrong shape."""
    from safetensors.torch import load_file, save_file

    (file,) = folder.glob("*.safetensors")
    tensors = load_file(str(file))
    name = sorted(n for n in tensors if n.endswith("mlp.down_proj.weight"))[-1]
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_grammar_attacks(server, memory) -> None:
    """A 60k-entry enum (889 KB) stalled /health for 14 s: now a 400 naming the field before
    anything compiles; so are too many tools. What the caps allow compiles off the loop, a few
    at a time (a flood of them gets 503s, never a stall)."""
    url = f"{server.base_url}/v1/chat/completions"
    messages = [{"role": "user", "content": "pick"}]
    huge_enum = {"type": "string", "enum": [f"value-{i:05d}" for i in range(60_000)]}
    at_cap = {"type": "object", "properties": {
        "a": {"enum": [f"choice-{i}-{'x' * 40}" for i in range(
            DEFAULT_MAX_STRUCTURED_OUTPUTS_CHOICES)]}}, "required": ["a"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}

    def tools(n: int) -> list[dict]:
        return [json.loads(json.dumps(tool).replace('"f"', f'"f{i}"')) for i in range(n)]

    with pinged(server):
        r = httpx.post(url, headers=auth(TENANT_A), timeout=60, json={
            "messages": messages, "max_tokens": 4, "guided_json": huge_enum})
        assert r.status_code in (400, 413), r.text
        if r.status_code == 400:
            assert "guided_json" in (r.json()["error"]["param"] or ""), r.text
        r = httpx.post(url, headers=auth(TENANT_A), timeout=60, json={
            "messages": messages, "max_tokens": 4, "tools": tools(DEFAULT_MAX_TOOLS + 1),
            "tool_choice": "required"})
        error_of(r, 400, "tools")
        bodies = [{"messages": messages, "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": at_cap}}}
            for i in range(12)]
        bodies.append({"messages": messages, "max_tokens": 2, "tools": tools(DEFAULT_MAX_TOOLS),
                       "tool_choice": "required"})
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: httpx.post(url, headers=auth(TENANT_B), json=b,
                                                         timeout=300), bodies))
        for r in answers:
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "server_overloaded", r.text
        assert any(r.status_code == 200 for r in answers)


def test_prompt_logprobs_cannot_amplify(server, memory) -> None:
    """4 prompts of 1,900 tokens with prompt_logprobs 20 (a 50 KiB body) made a 10.3 MiB
    answer: now a 400 naming the field and the flag; what the cap allows is decoded and
    serialized off the loop."""
    ids = [(7 * i) % 300 + 3 for i in range(1900)]
    url = f"{server.base_url}/v1/completions"
    with pinged(server):
        r = httpx.post(url, headers=auth(TENANT_A), timeout=120, json={
            "prompt": [ids] * 4, "max_tokens": 1, "prompt_logprobs": 20})
        assert "--max-prompt-logprobs-entries" in error_of(r, 400, "prompt_logprobs")
        r = httpx.post(url, headers=auth(TENANT_A), timeout=120, json={
            "prompt": [ids] * 4, "max_tokens": 0, "echo": True, "logprobs": 20})
        error_of(r, 400, "logprobs")
        # At the cap: 3,100 tokens x 21 entries = 65,100.
        longest = DEFAULT_MAX_PROMPT_LOGPROBS_ENTRIES // 21
        r = httpx.post(url, headers=auth(TENANT_A), timeout=300, json={
            "prompt": (ids * 2)[:longest], "max_tokens": 1, "prompt_logprobs": 20})
        assert r.status_code == 200, r.text
        scores = r.json()["choices"][0]["prompt_logprobs"]
        assert len(scores) == longest and scores[0] is None
        assert all(e["decoded_token"] is not None for e in scores[1].values())


def test_tokenize_and_detokenize_do_not_stall(server, memory) -> None:
    """/detokenize of 1M ids held the loop 0.4 s (a fast tokenizer decodes holding the GIL,
    from any thread): more ids than the context are a 400 now, a context's worth decodes off
    the loop; /tokenize of a 480 KB chat message renders and encodes off the loop."""
    with pinged(server):
        r = httpx.post(f"{server.base_url}/detokenize", headers=auth(TENANT_A), timeout=300,
                       json={"tokens": [5, 17, 42, 99] * 250_000})
        assert "max_model_len" in error_of(r, 400, "tokens")
        r = httpx.post(f"{server.base_url}/detokenize", headers=auth(TENANT_A), timeout=300,
                       json={"tokens": [5, 17, 42, 99] * (MAX_MODEL_LEN // 4)})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{server.base_url}/tokenize", headers=auth(TENANT_A), timeout=300,
                       json={"messages": [{"role": "user", "content": "hello there " * 40_000}],
                             "add_special_tokens": True})
        assert r.status_code == 200, r.text


def test_long_streams_through_the_tool_and_reasoning_parsers(server, memory) -> None:
    """4,000 streamed tokens through the hermes and qwen3 parsers: each delta's parse is
    linear in the delta (it was 1.5 s of loop time per choice)."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 4000,
            "ignore_eos": True, "temperature": 1.0, "seed": 1, "stream": True, "n": 2,
            "tools": [tool]}
    with pinged(server):
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions",
                          headers=auth(TENANT_A), json=body, timeout=600) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    finishes = [c["finish_reason"] for e in events[:-1]
                for c in json.loads(e[6:])["choices"] if c.get("finish_reason")]
    assert len(finishes) == 2, finishes


def test_tenants_do_not_share_prefix_cache_hits(server, memory) -> None:
    prompt = "A long shared system prompt that both tenants send, word for word. " * 8

    def cached(key: str) -> int:
        r = httpx.post(f"{server.base_url}/v1/completions", headers=auth(key), timeout=120,
                       json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with pinged(server):
        cached(TENANT_A)
        assert cached(TENANT_A) > 0  # tenant A hits its own blocks...
        assert cached(TENANT_B) == 0  # ...tenant B does not see them
