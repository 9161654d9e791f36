"""--max-waiting-requests (alias --max-queued-requests): past the bound, new requests get 503 +
Retry-After (not an ever growing queue); once the backlog drains, requests are admitted again
and no KV block stays taken."""

from __future__ import annotations

import argparse
import threading

import httpx
import openai
import pytest
from server_utils import drained, serve_tiny_llama, wait_until

from pagellm.entrypoints.openai.cli_serve import add_server_args, server_limits_from

# One running sequence plus two waiting ones fit; a fourth sequence is refused. The long
# requests must outlast the checks: with a 256-token context the tiny model finished one in a
# fraction of a second on a fast CPU, freeing a queue slot before the last check (seen in CI),
# so the model gets a 4,096-token context (the streams are disconnected, never run out).
ARGS = ["--dtype", "float32", "--max-model-len", "4096", "--kv-cache-memory", "8MiB",
        "--max-num-seqs", "1", "--max-num-batched-tokens", "64", "--max-waiting-requests", "2"]
LONG = {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True, "temperature": 0,
        "stream": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory, make_tiny_model):
    yield from serve_tiny_llama(tmp_path_factory, make_tiny_model, "backpressure", ARGS,
                                max_position_embeddings=4096)


def stream_first_chunk(base_url: str, body: dict, started: threading.Event,
                       results: list, hold: threading.Event) -> None:
    """Start a streaming request, signal once its headers arrived, keep it open until ``hold``."""
    with httpx.Client(base_url=base_url, timeout=120) as c, \
            c.stream("POST", "/v1/completions", json=body) as resp:
        results.append(resp.status_code)
        started.set()
        if resp.status_code != 200:
            return
        text = ""
        for chunk in resp.iter_text():
            text += chunk
            if hold.is_set():
                break  # disconnect: the request is aborted
        results.append(text)


def fill_queue(base: str, hold: threading.Event) -> list[threading.Thread]:
    """1 running + 2 waiting streams, open until ``hold`` is set."""
    threads, results = [], []
    for _ in range(3):
        started = threading.Event()
        res: list = []
        t = threading.Thread(target=stream_first_chunk,
                             args=(base, LONG, started, res, hold), daemon=True)
        t.start()
        assert started.wait(60)
        threads.append(t)
        results.append(res)
    assert [r[0] for r in results] == [200, 200, 200]
    return threads


def test_full_queue_gets_503_then_recovers(server):
    base = server.base_url
    hold = threading.Event()
    threads: list[threading.Thread] = []
    try:
        threads = fill_queue(base, hold)
        over = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                          timeout=60)
        assert over.status_code == 503, over.text
        assert over.headers["retry-after"] == "1"
        err = over.json()["error"]
        assert err["code"] == "server_overloaded" and err["type"] == "server_error"
        # n counts as n sequences: the chat endpoint is bounded the same way.
        chat = httpx.post(f"{base}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=60)
        assert chat.status_code == 503
        assert httpx.get(f"{base}/health").status_code == 200
    finally:
        hold.set()
        for t in threads:
            t.join(120)
    # Disconnected streams are aborted: the queue drains and requests are admitted again.
    assert wait_until(lambda: drained(base), 60)
    ok = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                    "n": 3}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == 3
    # n = 4 alone is more than 1 running + 2 waiting: it could never be admitted (400).
    too_many = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                          "n": 4}, timeout=60)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


def test_openai_sdk_sees_503_with_retry_after_and_no_blocks_leak(server):
    base = server.base_url
    # max_retries=0: the SDK would otherwise retry a 503 itself (honouring Retry-After).
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    hold = threading.Event()
    threads: list[threading.Thread] = []
    try:
        threads = fill_queue(base, hold)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=client.models.list().data[0].id, prompt="x",
                                      max_tokens=1)
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "1"
        err = info.value.response.json()["error"]
        assert err["code"] == "server_overloaded" and "queue is full" in err["message"]
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=client.models.list().data[0].id,
                                           messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=1, stream=True)
    finally:
        hold.set()
        for t in threads:
            t.join(120)
    # Refused requests took no slot and no block: at idle the KV cache is empty again.
    assert wait_until(lambda: drained(base), 60)
    done = client.completions.create(model=client.models.list().data[0].id, prompt="x",
                                     max_tokens=3, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop")
    assert wait_until(lambda: drained(base), 60)


@pytest.mark.parametrize("flag", ["--max-waiting-requests", "--max-queued-requests"])
def test_queue_bound_flag_spellings(flag: str) -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert server_limits_from(parser.parse_args([flag, "5"])).max_waiting_requests == 5
    assert server_limits_from(parser.parse_args([])).max_waiting_requests is None
