"""The OpenAI server end to end: a real ``pagellm serve`` subprocess (default model, fp32 on the
CPU) and the official ``openai`` SDK as the client. One server for the whole module; its last
test kills the engine process."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time

import httpx
import openai
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from server_utils import (
    TINY_ARGS,
    ServerProcess,
    drained,
    metric,
    pid_alive,
    scrape,
    wait_until,
)

from pagellm.benchmarks.serve import benchmark, load_dataset

API_KEY = "test-key-123"
ADMIN_KEY = "test-admin-key-456"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProcess([*TINY_ARGS, "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
                         "--served-model-name", "smol",
                         "alias", "--enable-prefix-caching", "--max-num-seqs", "16",
                         "--enable-prompt-tokens-details", "--enable-tokenizer-info-endpoint"], log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=300)


def post(server, path, body, key=API_KEY, timeout=300):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=timeout)


@pytest.fixture(scope="module")
def greedy(client):
    """The reference greedy completion of PROMPT (8 tokens), non-streaming."""
    return client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})


def test_models_version_docs(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["smol", "alias"]
    assert models.data[0].model_extra["max_model_len"] == 1024
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    assert httpx.get(f"{server.base_url}/docs").status_code == 200


def test_completion_stream_equals_non_stream(client, greedy):
    assert greedy.id.startswith("cmpl-") and greedy.object == "text_completion"
    choice = greedy.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert greedy.usage.completion_tokens == 8
    assert greedy.usage.total_tokens == greedy.usage.prompt_tokens + 8

    chunks = list(client.completions.create(
        model="alias", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    *content, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in content) == choice.text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage == greedy.usage
    assert all(c.id == chunks[0].id and c.id.startswith("cmpl-") for c in chunks)


def test_token_id_prompts_and_batches(server, client, greedy):
    ids = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    assert len(ids) == greedy.usage.prompt_tokens
    # A list of token-id prompts; each gives the same greedy text as the text prompt.
    r = client.completions.create(model="smol", prompt=[ids, ids[:-1]], max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == greedy.choices[0].text
    assert r.usage.prompt_tokens == 2 * len(ids) - 1
    assert r.usage.completion_tokens == 16
    # A list of text prompts, with echo.
    r = client.completions.create(model="smol", prompt=[PROMPT, "Hello"], max_tokens=2,
                                  temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT) and r.choices[1].text.startswith("Hello")
    assert r.choices[0].text == PROMPT + greedy.choices[0].text[:len(r.choices[0].text)
                                                                 - len(PROMPT)]


def test_n_samples_stream_and_not(client):
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, n=3, seed=7,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 12
    chunks = list(client.completions.create(
        model="smol", prompt=PROMPT, max_tokens=4, n=2, seed=7, temperature=1.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    per_index: dict[int, list] = {0: [], 1: []}
    for c in chunks[:-1]:
        assert len(c.choices) == 1
        per_index[c.choices[0].index].append(c.choices[0].finish_reason)
    for reasons in per_index.values():
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage.completion_tokens == 8
    # Same seed, same samples: the non-streaming n=3 run's first two choices.
    texts = {i: "".join(c.choices[0].text for c in chunks[:-1] if c.choices[0].index == i)
             for i in (0, 1)}
    by_index = {c.index: c.text for c in r.choices}
    assert texts == {0: by_index[0], 1: by_index[1]}


def test_completion_logprobs(client, greedy):
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text == greedy.choices[0].text[:len(r.choices[0]
                                                                                   .text)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and logprob <= 0
        # Greedy: the sampled token is the most likely one.
        assert math.isclose(top[token], max(top.values()), abs_tol=1e-4)
        assert math.isclose(logprob, top[token], abs_tol=1e-5)
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


def test_stop_strings(client, greedy):
    text = greedy.choices[0].text
    words = text.split()
    stop = words[1] if len(words) > 1 else words[0]
    cut = text.index(stop)
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == text[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0,
                                  stop=stop, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == text[:cut + len(stop)]
    chunks = list(client.completions.create(model="smol", prompt=PROMPT, max_tokens=8,
                                            temperature=0, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_stream_and_not(server, client):
    messages = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]
    r = client.chat.completions.create(model="smol", messages=messages, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.content)
    for entry in r.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.token == entry.top_logprobs[0].token  # greedy
    assert "".join(e.token for e in r.choices[0].logprobs.content) == msg.content or \
        r.choices[0].finish_reason == "stop"
    tok = post(server, "/tokenize", {"messages": messages}).json()
    assert tok["count"] == r.usage.prompt_tokens

    chunks = list(client.chat.completions.create(
        model="smol", messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    content_chunks = chunks[:-1]
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert content_chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == msg.content
    assert chunks[-1].choices == []
    # Equal usage, but for the prefix-cache hit: the stream found the first run's blocks.
    details = ("prompt_tokens_details",)
    assert chunks[-1].usage.model_dump(exclude=details) == r.usage.model_dump(exclude=details)
    first, second = (u.prompt_tokens_details.cached_tokens for u in (r.usage, chunks[-1].usage))
    assert first == 0 and second == (r.usage.prompt_tokens - 1) // 16 * 16


def test_tokenize_detokenize_round_trip(server):
    text = "Paged attention keeps the KV cache in blocks."
    tok = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    back = post(server, "/detokenize", {"tokens": tok["tokens"]}).json()
    assert back["prompt"] == text
    assert post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400


def test_tokenizer_info_template_is_the_one_chats_use(server):
    url = f"{server.base_url}/tokenizer_info"
    assert httpx.get(url, timeout=30).status_code == 401
    info = httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and info["tokenizer_class"]
    assert "/" not in info.get("name_or_path", "")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]
    # What lm-evaluation-harness does with it: render locally, then /tokenize the text.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(info["chat_template"]).render(
        messages=messages, add_generation_prompt=True, bos_token=info["bos_token"],
        eos_token=info["eos_token"])
    local = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    served = post(server, "/tokenize", {"messages": messages}).json()
    assert local["tokens"] == served["tokens"]


def test_max_tokens_past_the_context(server, client):
    ids = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    long_ids = (ids * 1000)[:1020]
    # As vLLM and OpenAI: a 400 with the numbers, not a silently shorter completion.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt=long_ids, max_tokens=100,
                                  temperature=0)
    err = e.value.body
    assert err["param"] == "max_tokens" and "1020 input tokens" in err["message"]
    assert "1024" in err["message"] and "100" in err["message"]
    # null: the rest of the context.
    r = post(server, "/v1/completions", {"model": "smol", "prompt": long_ids, "max_tokens": None,
                                         "temperature": 0, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "length"


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, "empty"),
    ("/v1/completions", {"prompt": [[]]}, "empty"),
    ("/v1/completions", {"prompt": [1, 2, 10**8]}, "vocabulary"),
    ("/v1/completions", {"prompt": [1] * 1100}, "1100"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "image_url"),
]


@pytest.mark.parametrize(("path", "body", "needle"), BAD_REQUESTS)
def test_bad_requests_are_400(server, path, body, needle):
    r = post(server, path, {"model": "smol", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert needle in err["message"] or needle == err["param"], err


def test_too_long_prompt_message_has_both_numbers(server):
    err = post(server, "/v1/completions", {"prompt": [1] * 1100}).json()["error"]
    assert "1100" in err["message"] and "1024" in err["message"]


def test_sdk_error_classes(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="x", logprobs=25)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert "gpt-4" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user",
                                                                 "content": "x"}])
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="smol", prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert post(server, "/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    assert post(server, "/tokenize", {"prompt": "x"}, key="wrong").status_code == 401
    # Probes stay open, and the server is still healthy after all the errors.
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200
    r = client.completions.create(model="smol", prompt="x", max_tokens=1)
    assert r.usage.completion_tokens == 1


def test_metrics_count_requests(server, client):
    before = scrape(server.base_url)
    prompts = ["One", "Two words", "And three words here"]
    usages = [client.completions.create(model="smol", prompt=p, max_tokens=2, temperature=0,
                                        extra_body={"ignore_eos": True}).usage for p in prompts]
    after = scrape(server.base_url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("pagellm:request_success_total", finished_reason="length") == 3
    assert delta("pagellm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("pagellm:generation_tokens_total") == 6
    assert delta("pagellm:e2e_request_latency_seconds_count") == 3
    assert delta("pagellm:time_to_first_token_seconds_count") == 3
    assert delta("pagellm:inter_token_latency_seconds_count") == 3
    assert delta("pagellm:request_queue_time_seconds_count") == 3
    assert delta("pagellm:request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert delta("pagellm:request_generation_tokens_sum") == 6
    assert delta("pagellm:prefix_cache_queries_total") >= sum(u.prompt_tokens for u in usages)
    assert metric(after, "pagellm:num_requests_running") == 0
    assert metric(after, "pagellm:num_requests_waiting") == 0
    assert metric(after, "pagellm:kv_cache_usage_perc") == 0
    for name in ("pagellm:num_preemptions_total", "pagellm:prefix_cache_hits_total"):
        assert name in {k.partition("{")[0] for k in after}
    assert post(server, "/reset_prefix_cache", {}).status_code == 403  # a tenant's key
    assert post(server, "/reset_prefix_cache", {}, key=ADMIN_KEY).json() == {"success": True}


async def _hang_up_after_two_chunks(base_url: str, i: int) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "smol", "prompt": f"Story number {i}:", "max_tokens": 500,
            "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", f"{base_url}/v1/completions", json=body,
                               headers=headers) as r:
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if n == 2:
                        return  # leaving the block closes the connection


async def _hang_up_non_streaming(base_url: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "smol", "prompt": "A long story:", "max_tokens": 500, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=3) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{base_url}/v1/completions", json=body, headers=headers)


def test_client_disconnects_abort_requests(server, client):
    before = scrape(server.base_url)

    async def main():
        await asyncio.gather(*[_hang_up_after_two_chunks(server.base_url, i) for i in range(8)],
                             _hang_up_non_streaming(server.base_url))

    asyncio.run(main())

    assert wait_until(lambda: drained(server.base_url), timeout_s=60), scrape(server.base_url)
    after = scrape(server.base_url)
    aborted = (metric(after, "pagellm:request_success_total", finished_reason="abort")
               - metric(before, "pagellm:request_success_total", finished_reason="abort"))
    assert aborted == 9
    # Nothing ran to max_tokens: 9 requests x 500 tokens would be 4500.
    generated = (metric(after, "pagellm:generation_tokens_total")
                 - metric(before, "pagellm:generation_tokens_total"))
    assert generated < 500
    start = time.monotonic()
    r = client.completions.create(model="smol", prompt="Hi", max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert time.monotonic() - start < 60


def test_bench_serve_against_this_server(server):
    requests = load_dataset("random", 4, 8, 3, 1000, 0.0, seed=0)
    summary = asyncio.run(benchmark(server.base_url, requests, api_key=API_KEY,
                                    max_concurrency=2, ignore_eos=True))
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["model"] == "smol"
    assert summary["total_input_tokens"] == 32 and summary["total_output_tokens"] == 12
    assert 0 < summary["ttft_ms"]["mean"] <= summary["e2e_latency_ms"]["mean"]


def test_engine_death_gives_503_then_exit(server):
    """Runs last: kill -9 the engine process; /health answers 503 and the server exits 1."""
    engine_pid = server.engine_pid
    os.kill(engine_pid, signal.SIGKILL)
    seen_503 = wait_until(lambda: _health(server) == 503, timeout_s=10, interval_s=0.05)
    assert seen_503, server.log()
    server.proc.wait(60)
    assert server.proc.returncode == 1, server.log()
    assert not pid_alive(engine_pid)


def _health(server) -> int | None:
    try:
        return httpx.get(f"{server.base_url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return None
