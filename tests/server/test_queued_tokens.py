"""--max-num-queued-tokens (vLLM's): while the prompts still waiting for their first token hold at
least N tokens, new requests get 503 + Retry-After, so an admitted request's TTFT stays bounded
under overload; once the backlog drains, requests are admitted again and no KV block leaks."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from server_utils import drained, serve_tiny_llama, wait_until

from pagellm.core.sched_output import EngineCoreOutput
from pagellm.metrics.request_stats import RequestStatsTracker

# One sequence runs at a time, so a second one waits with its whole prompt counted; with a
# bound of 1 token the third request is refused. A 4,096-token context keeps the running
# stream going through the checks (it is disconnected, never runs out).
ARGS = ["--dtype", "float32", "--max-model-len", "4096", "--kv-cache-memory", "8MiB",
        "--max-num-seqs", "1", "--max-num-batched-tokens", "64", "--max-num-queued-tokens", "1"]
LONG = {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True, "temperature": 0,
        "stream": True}


def test_tracker_counts_prompts_until_their_first_token() -> None:
    stats = RequestStatsTracker()
    stats.add("a", 0.0, 10)
    stats.add("b", 0.0, 7)
    stats.add("c", 0.0, 5)
    assert stats.num_prefill_tokens == 22
    stats.update([EngineCoreOutput(req_id="a", new_token_ids=[])], {}, [], now=1.0)
    assert stats.num_prefill_tokens == 22  # a prefill chunk: no token yet
    stats.update([EngineCoreOutput(req_id="a", new_token_ids=[3])], {}, [], now=2.0)
    assert stats.num_prefill_tokens == 12
    stats.update([EngineCoreOutput(req_id="a", new_token_ids=[4], finish_reason="length")],
                 {}, [], now=3.0)
    assert stats.num_prefill_tokens == 12  # a's prompt was already out of the count
    stats.abort(["b"], now=4.0)  # aborted before its first token
    assert stats.num_prefill_tokens == 5
    stats.update([EngineCoreOutput(req_id="c", new_token_ids=[1], finish_reason="stop")],
                 {}, [], now=5.0)
    assert stats.num_prefill_tokens == 0 and len(stats) == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory, make_tiny_model):
    yield from serve_tiny_llama(tmp_path_factory, make_tiny_model, "queued_tokens", ARGS,
                                max_position_embeddings=4096)


def open_stream(base_url: str, first_token: threading.Event, results: list,
                hold: threading.Event) -> None:
    """Stream a long completion; set ``first_token`` once text arrived (or on a refusal), keep
    the stream open until ``hold``."""
    with httpx.Client(base_url=base_url, timeout=120) as c, \
            c.stream("POST", "/v1/completions", json=LONG) as resp:
        results.append(resp.status_code)
        if resp.status_code != 200:
            first_token.set()
            return
        for chunk in resp.iter_text():
            if '"text"' in chunk:
                first_token.set()
            if hold.is_set():
                break  # disconnect: the request is aborted


def test_prefill_backlog_gets_503_then_recovers(server):
    base = server.base_url
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    hold = threading.Event()
    threads, results = [], []
    try:
        # The first stream runs and has its first token: its prompt no longer counts.
        first = threading.Event()
        t = threading.Thread(target=open_stream, args=(base, first, results, hold), daemon=True)
        t.start()
        threads.append(t)
        assert first.wait(60) and results == [200]
        # The second is admitted (nothing waits yet) and then waits: max_num_seqs is 1.
        second_result: list = []
        t = threading.Thread(target=open_stream,
                             args=(base, threading.Event(), second_result, hold), daemon=True)
        t.start()
        threads.append(t)
        assert wait_until(lambda: second_result == [200], 60)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=model, prompt="x", max_tokens=1)
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "1"
        err = info.value.response.json()["error"]
        assert err["code"] == "server_overloaded"
        assert "--max-num-queued-tokens 1" in err["message"]
        chat = httpx.post(f"{base}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=60)
        assert chat.status_code == 503
    finally:
        hold.set()
        for t in threads:
            t.join(120)
    assert wait_until(lambda: drained(base), 60)
    done = client.completions.create(model=model, prompt="x", max_tokens=3, temperature=0)
    assert len(done.choices) == 1
    assert wait_until(lambda: drained(base), 60)
