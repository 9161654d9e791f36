"""Tenant isolation on a real server (the default model, fp32, prefix caching on, API keys from
--api-key and --api-key-file): requests of different keys, or with different cache_salt, never
share KV blocks (per-request cached_tokens and the prefix-cache counters) unless
--prefix-cache-scope global says so; cached_tokens is reported only with
--enable-prompt-tokens-details; the keys guard every non-probe path and are compared with
hmac.compare_digest; and no prompt text reaches the log without --enable-log-requests."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_utils import TINY_ARGS, ServerProcess, metric, scrape

from pagellm.entrypoints.openai import tenancy
from pagellm.entrypoints.openai.api_server import OPEN_PATHS, ApiKeyMiddleware

KEY = "sk-tenant-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Two more tenants, from --api-key-file: one named, one not.
KEY_B, KEY_C = "sk-tenant-b-file-key-000", "sk-tenant-c-file-key-111"
KEY_FILE = f"# tenants of the test\n\n{KEY_B} team-b\n   # indented comment\n{KEY_C}\n"
BLOCK = 16  # the default --block-size
SECRET = "PANGOLIN-SECRET-4242"  # must never appear in the log
LONG = ("Tenant isolation: the prefix cache must not let one tenant learn what another sent. "
        * 12)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    (tmp / "keys.txt").write_text(KEY_FILE)
    srv = ServerProcess([*TINY_ARGS, "--enable-prefix-caching", "--api-key", KEY,
                         "--api-key-file", str(tmp / "keys.txt"),
                         "--enable-prompt-tokens-details"], tmp / "server.log")
    yield srv
    srv.stop()


def hits_and_queries(base: str) -> tuple[float, float]:
    m = scrape(base)
    return metric(m, "pagellm:prefix_cache_hits_total"), \
        metric(m, "pagellm:prefix_cache_queries_total")


def streamed(base: str, salt: str | None) -> tuple[dict, float]:
    """(usage, seconds to the first token) of a 1-token streamed completion of LONG."""
    body = {"prompt": LONG, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if salt is not None:
        body["cache_salt"] = salt
    start = time.perf_counter()
    ttft, usage = None, None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH,
                      timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data["choices"] and ttft is None:
                ttft = time.perf_counter() - start
            usage = data.get("usage") or usage
    return usage, ttft


def test_different_salts_never_share_blocks(server):
    base = server.base_url
    cases = [("a", "tenant-a"), ("a again", "tenant-a"), ("b", "tenant-b"), ("no salt", None),
             ("no salt again", None), ("b again", "tenant-b")]
    results = {}
    for name, salt in cases:
        hits0, queries0 = hits_and_queries(base)
        usage, ttft = streamed(base, salt)
        hits1, queries1 = hits_and_queries(base)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        # The server's counters agree with what the response reports.
        assert (hits1 - hits0, queries1 - queries0) == (cached, usage["prompt_tokens"]), name
        results[name] = (cached, usage["prompt_tokens"], ttft)
    num_prompt = results["a"][1]
    assert num_prompt > 8 * BLOCK
    full_hit = (num_prompt - 1) // BLOCK * BLOCK  # every full block but the last token's
    cached = {name: c for name, (c, _, _) in results.items()}
    assert cached == {"a": 0, "a again": full_hit, "b": 0, "no salt": 0,
                      "no salt again": full_hit, "b again": full_hit}
    # Reported, not asserted (no wall-clock thresholds in tests): a hit skips the prefill.
    print("TTFT ms:", {name: round(t * 1000, 1) for name, (_, _, t) in results.items()})


def test_chat_salts_are_isolated_too(server):
    base = server.base_url
    body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 1,
            "temperature": 0}

    def cached(salt: str) -> int:
        r = httpx.post(f"{base}/v1/chat/completions", json={**body, "cache_salt": salt},
                       headers=AUTH, timeout=300)
        assert r.status_code == 200
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("chat-x") == 0
    assert cached("chat-x") > 8 * BLOCK
    assert cached("chat-y") == 0


def test_no_prompt_text_in_the_log_without_enable_log_requests(server):
    base = server.base_url
    prompt = f"Tell me about {SECRET} please."
    posts = [
        ("/v1/completions", {"prompt": prompt, "max_tokens": 2}),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 2, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                  "max_tokens": 2}),
        ("/v1/completions", {"prompt": prompt * 300, "max_tokens": 2}),  # too long: 400
        ("/v1/completions", {"prompt": prompt, "temperature": -1}),  # bad field: 400
        ("/v1/completions", {"prompt": prompt, "stop": [SECRET] * 100}),  # too many stops
        # Any role renders (a 200): max_tokens keeps it short on a loaded machine.
        ("/v1/chat/completions", {"messages": [{"role": "nobody", "content": prompt}],
                                  "max_tokens": 2}),
        ("/tokenize", {"prompt": prompt}),
    ]
    statuses = [httpx.post(f"{base}{path}", json=body, headers=AUTH, timeout=300).status_code
                for path, body in posts]
    assert statuses[:3] == [200, 200, 200] and all(s in (200, 400) for s in statuses)
    time.sleep(1.0)  # let the log flush
    log = server.log()
    assert "POST /v1/completions" in log  # the access log is on: requests are logged...
    assert "PANGOLIN" not in log  # ...without their text


def test_api_key_guards_every_path(server):
    base = server.base_url
    spec = httpx.get(f"{base}/openapi.json").json()  # a probe path: open
    routes = [(path, method.upper()) for path, ops in spec["paths"].items() for method in ops]
    guarded = [(p, m) for p, m in routes if p not in OPEN_PATHS]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
            "/detokenize", "/reset_prefix_cache"} <= {p for p, _ in guarded}
    wrong = ["", f"Bearer {KEY[:-1]}x", f"Bearer {KEY[:-1]}", f"Bearer {KEY}0", KEY,
             f"bearer {KEY}"]
    for path, method in guarded:
        for value in wrong:
            headers = {"Authorization": value} if value else {}
            r = httpx.request(method, f"{base}{path}", headers=headers, json={}, timeout=60)
            assert r.status_code == 401, (path, method, value)
            if path.startswith("/v1/messages"):  # Anthropic's routes: Anthropic's 401 body
                assert r.json()["error"]["type"] == "authentication_error"
            else:
                assert r.json()["error"]["code"] == "invalid_api_key"
        if path != "/reset_prefix_cache":
            r = httpx.request(method, f"{base}{path}", headers=AUTH, json={}, timeout=60)
            assert r.status_code != 401, (path, method)
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{base}{path}").status_code == 200


def test_api_key_is_compared_in_constant_time(monkeypatch):
    """Every request to a guarded path goes through one hmac.compare_digest of the whole
    header against the whole expected value (no early-exit == on any path)."""
    calls = []
    real = tenancy.hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tenancy.hmac, "compare_digest", recording)
    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = ApiKeyMiddleware(inner, KEY)

    async def call(path: str, auth: bytes | None) -> int:
        headers = [(b"authorization", auth)] if auth is not None else []
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(msg):
            sent.append(msg)

        await app({"type": "http", "method": "POST", "path": path, "headers": headers},
                   receive, send)
        return sent[0]["status"]

    async def main():
        expected = f"Bearer {KEY}".encode()
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/anything"):
            for auth in (None, b"Bearer nope", expected[:-1] + b"x", expected):
                calls.clear()
                status = await call(path, auth)
                assert calls == [(auth or b"", expected)]
                assert status == (200 if auth == expected else 401)
        calls.clear()
        assert await call("/health", None) == 200 and calls == []  # probes carry no key

    asyncio.run(main())
    assert reached.count("/v1/completions") == 1


def complete(base: str, key: str, salt: str | None = None, prompt: str = LONG) -> dict:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{base}/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {key}"}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_each_key_is_its_own_cache_namespace(server):
    base = server.base_url
    prompt = "Each API key is a tenant with a prefix cache of its own. " * 14
    full = None
    seen = {}
    for name, key, salt in [("a", KEY, None), ("b", KEY_B, None), ("c", KEY_C, None),
                            ("a again", KEY, None), ("b again", KEY_B, None),
                            ("a salted", KEY, "s1"), ("b salted", KEY_B, "s1"),
                            ("a salted again", KEY, "s1"), ("a other salt", KEY, "s2")]:
        hits0, _ = hits_and_queries(base)
        usage = complete(base, key, salt, prompt)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert hits_and_queries(base)[0] - hits0 == cached, name
        full = (usage["prompt_tokens"] - 1) // BLOCK * BLOCK
        seen[name] = cached
    assert full > 8 * BLOCK
    # Another key never hits (not even with the same salt); the same key (and salt) does.
    assert seen == {"a": 0, "b": 0, "c": 0, "a again": full, "b again": full,
                    "a salted": 0, "b salted": 0, "a salted again": full, "a other salt": 0}


@pytest.fixture(scope="module")
def global_server(tmp_path_factory):
    """Two keys, --prefix-cache-scope global, and no --enable-prompt-tokens-details."""
    tmp = tmp_path_factory.mktemp("global")
    (tmp / "keys.txt").write_text(f"{KEY_B} team-b\n")
    srv = ServerProcess([*TINY_ARGS, "--enable-prefix-caching", "--api-key", KEY,
                         "--api-key-file", str(tmp / "keys.txt"), "--prefix-cache-scope",
                         "global"], tmp / "server.log")
    yield srv
    srv.stop()


def test_global_scope_shares_and_details_are_off_by_default(global_server):
    base = global_server.base_url
    prompt = "With a global scope every tenant shares the prefix cache. " * 14
    deltas = []
    for key in (KEY, KEY_B, KEY_B):
        hits0, _ = hits_and_queries(base)
        usage = complete(base, key, prompt=prompt)
        # No cached_tokens without --enable-prompt-tokens-details (as vLLM).
        assert usage.get("prompt_tokens_details") is None, usage
        deltas.append(hits_and_queries(base)[0] - hits0)
    full = (usage["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert deltas == [0, full, full]  # the second tenant hits the first one's blocks
    body = {"prompt": prompt, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH,
                      timeout=300) as r:
        usages = [json.loads(line[6:]).get("usage") for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert usages[-1]["prompt_tokens"] > 0 and usages[-1].get("prompt_tokens_details") is None
    chat = httpx.post(f"{base}/v1/chat/completions", headers=AUTH, timeout=300, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}).json()
    assert chat["usage"].get("prompt_tokens_details") is None
