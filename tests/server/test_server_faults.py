"""A worker exception in one step, through the real server (tiny random model, fault injected with
PAGELLM_FAULT_INJECT in the engine process): the requests of that step get a 500 with an OpenAI
error body, or an error event then [DONE] when streaming; the server goes on serving with the
same outputs as before and no leaked block. Failed steps in a row stop the engine: /health 503,
a clear log line, a non-zero exit. Also: --enable-log-requests logs prompt text."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from server_utils import ServerProcess, metric, scrape, wait_until

from pagellm.engine.core import MAX_CONSECUTIVE_STEP_FAILURES

POISON = 7
# A 4,096-token context: the long stream must still be running when the poisoned request
# comes; with 256 the tiny model can finish it first on a fast CPU.
ARGS = ["--dtype", "float32", "--max-model-len", "4096", "--kv-cache-memory", "16MiB",
        "--enable-prefix-caching", "--max-num-seqs", "8", "--disable-log-stats"]
GOOD = [10, 20, 30, 40] * 6
BAD = [11, 12, POISON, 13] * 4
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
LOGGED_PROMPT = "zebra quokka 7781 marmalade"


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory, make_tiny_model):
    return make_tiny_model(tmp_path_factory.mktemp("faults-model"), "llama",
                           max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(tmp_path_factory, long_context_llama):
    log = tmp_path_factory.mktemp("faults") / "server.log"
    srv = ServerProcess([str(long_context_llama), *ARGS, "--enable-log-requests"], log,
                        env={"PAGELLM_FAULT_INJECT": f"forward:{POISON}"})
    yield srv
    srv.stop()


def complete(base: str, prompt, **fields) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"prompt": prompt, **GREEDY, **fields},
                      timeout=120)


def stream_events(base: str, body: dict, path: str = "/v1/completions",
                  started: threading.Event | None = None) -> list:
    """The SSE data payloads (parsed JSON, or the string "[DONE]")."""
    events = []
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if started is not None:
                    started.set()
    return events


def assert_idle(base: str) -> None:
    assert wait_until(lambda: metric(scrape(base), "pagellm:num_requests_running") == 0
                      and metric(scrape(base), "pagellm:num_requests_waiting") == 0, 30)
    assert metric(scrape(base), "pagellm:kv_cache_usage_perc") == 0
    assert httpx.get(f"{base}/health").status_code == 200


def assert_server_error(resp: httpx.Response) -> None:
    assert resp.status_code == 500, resp.text
    err = resp.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_server_error"
    assert "failed" in err["message"] and "server log" in err["message"]


def test_failed_step_gives_500_then_serving_goes_on(server):
    base = server.base_url
    ref = complete(base, GOOD).json()["choices"][0]["text"]
    errors_before = metric(scrape(base), "pagellm:request_success_total",
                           finished_reason="error")
    assert_server_error(complete(base, BAD))
    assert metric(scrape(base), "pagellm:request_success_total",
                  finished_reason="error") == errors_before + 1
    assert_server_error(complete(base, [GOOD, BAD]))  # a batch fails whole
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], **GREEDY})
    assert chat.status_code == 200  # chat still works
    assert complete(base, GOOD).json()["choices"][0]["text"] == ref
    assert_idle(base)
    log = server.log()
    assert "Model step failed" in log and "InjectedFault" in log
    assert "Unhandled error" not in log


def test_failed_step_in_a_stream_sends_an_error_event_then_done(server):
    base = server.base_url
    events = stream_events(base, {"prompt": BAD, **GREEDY, "n": 2,
                                  "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_server_error"
    assert all("error" not in e for e in events[:-2])
    assert_idle(base)


def test_requests_sharing_the_failed_step_fail_too_and_nothing_hangs(server):
    """A long stream that is running when the poisoned request is admitted shares its step: it
    ends with an error event and [DONE]; requests after that run normally."""
    base = server.base_url
    ref = complete(base, GOOD, max_tokens=40).json()["choices"][0]["text"]
    started = threading.Event()
    result: dict = {}

    def long_stream():
        result["events"] = stream_events(base, {"prompt": [5, 6, 8, 9] * 10, "max_tokens": 4000,
                                                "temperature": 0, "ignore_eos": True},
                                         started=started)

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(60)
    assert_server_error(complete(base, BAD))
    t.join(120)
    assert not t.is_alive()
    events = result["events"]
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert complete(base, GOOD, max_tokens=40).json()["choices"][0]["text"] == ref
    assert_idle(base)


def test_enable_log_requests_logs_the_prompt(server):
    assert complete(server.base_url, LOGGED_PROMPT).status_code == 200
    assert wait_until(lambda: LOGGED_PROMPT in server.log(), 10)


def test_failed_steps_in_a_row_stop_the_server(tmp_path, long_context_llama):
    srv = ServerProcess([str(long_context_llama), *ARGS], tmp_path / "server.log",
                        env={"PAGELLM_FAULT_INJECT": f"before:{POISON}"})
    try:
        base = srv.base_url
        assert complete(base, GOOD).status_code == 200
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
            assert_server_error(complete(base, BAD))
        assert httpx.get(f"{base}/health").status_code == 200
        last = complete(base, BAD)  # the engine stops: its requests see the engine dead
        assert last.status_code == 500 and last.json()["error"]["code"] == "engine_dead"
        assert httpx.get(f"{base}/health").status_code == 503
        srv.proc.wait(60)
        assert srv.proc.returncode != 0
        log = srv.log()
        assert f"{MAX_CONSECUTIVE_STEP_FAILURES} model steps in a row raised" in log
        assert "The engine is dead; the server stops" in log
    finally:
        srv.stop()
