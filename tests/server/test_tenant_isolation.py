"""Tenant isolation on a real server (the default model, fp32, prefix caching on, --api-key):
requests with different cache_salt never share KV blocks (per-request cached_tokens and the
prefix-cache counters), the API key guards every non-probe path and is compared with
hmac.compare_digest, and no prompt text reaches the log without --enable-log-requests."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_utils import TINY_ARGS, ServerProcess, metric, scrape

from pagellm.entrypoints.openai import api_server
from pagellm.entrypoints.openai.api_server import OPEN_PATHS, ApiKeyMiddleware

KEY = "sk-tenant-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK = 16  # the default --block-size
SECRET = "PANGOLIN-SECRET-4242"  # must never appear in the log
LONG = ("Tenant isolation: the prefix cache must not let one tenant learn what another sent. "
        * 12)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("tenants") / "server.log"
    srv = ServerProcess([*TINY_ARGS, "--enable-prefix-caching", "--api-key", KEY], log)
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
        ("/v1/chat/completions", {"messages": [{"role": "nobody", "content": prompt}]}),
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
    real = api_server.hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api_server.hmac, "compare_digest", recording)
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
