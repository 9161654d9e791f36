"""vLLM's token-in/token-out ``POST /inference/v1/generate`` on a real ``pagellm serve`` (tiny
random llama, --chat-template chatml_tools, two API keys, prefix caching): its ids are the ids
/v1/completions generates for the same token prompt (greedy, seeded, stop ids, logprobs, prompt
logprobs); a chat render fed to it as-is gives the chat completion's ids (the disaggregated
flow); streamed chunks join to the whole answer; bad bodies are 400s naming the field; the key,
the tenant's cache namespace and the router gate apply as for /v1/completions."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from server_utils import bearer, ok, post, serve_tiny_llama, sse_events

from pagellm.entrypoints.router_gate import RouterGate

KEY, KEY_B = "sk-generate-test", "sk-generate-other-tenant"
MAX_MODEL_LEN = 256
ARGS = ["--served-model-name", "m", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory", "16MiB", "--chat-template", "chatml_tools", "--api-key", KEY,
        "--api-key", KEY_B, "--enable-prefix-caching", "--enable-prompt-tokens-details"]
AUTH, AUTH_B = bearer(KEY), bearer(KEY_B)
PATH = "/inference/v1/generate"
PROMPT = [5, 17, 42, 99, 7, 300, 12, 64]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, make_tiny_model):
    yield from serve_tiny_llama(tmp_path_factory, make_tiny_model, "generate", ARGS,
                                api_key=KEY, max_position_embeddings=MAX_MODEL_LEN)


def generate(server, token_ids: list[int], headers: dict | None = None, **params) -> dict:
    return ok(post(server, PATH, {"token_ids": token_ids, "sampling_params": params}, headers))


def completion(server, prompt: list[int], **fields) -> dict:
    return ok(post(server, "/v1/completions", {"prompt": prompt, "return_token_ids": True,
                                               **fields}))


def test_greedy_generate_is_the_completion_of_the_same_ids(server):
    body = {"request_id": "rl-rollout-1", "token_ids": PROMPT,
            "sampling_params": {**GREEDY, "max_tokens": 12}}
    answer = ok(post(server, PATH, body))
    expected = completion(server, PROMPT, max_tokens=12, **GREEDY)["choices"][0]
    assert set(answer) == {"request_id", "choices", "prompt_logprobs", "kv_transfer_params"}
    assert answer["request_id"] == "rl-rollout-1"
    assert (answer["prompt_logprobs"], answer["kv_transfer_params"]) == (None, None)
    (choice,) = answer["choices"]
    assert choice == {"index": 0, "logprobs": None, "finish_reason": "length",
                      "token_ids": expected["token_ids"]}
    assert len(choice["token_ids"]) == 12
    # detokenize false (ids only, no decoding): the same ids.
    plain = generate(server, PROMPT, max_tokens=12, detokenize=False, **GREEDY)
    assert plain["choices"][0]["token_ids"] == expected["token_ids"]


def test_max_tokens_absent_is_the_rest_of_the_context(server):
    (choice,) = generate(server, PROMPT, **GREEDY)["choices"]
    assert len(choice["token_ids"]) == MAX_MODEL_LEN - len(PROMPT)
    assert choice["finish_reason"] == "length"


def test_chat_render_fed_to_generate_is_the_chat_completion(server):
    chat = {"model": "m", "messages": MESSAGES, "max_tokens": 6, **GREEDY}
    rendered = ok(post(server, "/v1/chat/completions/render", chat))
    answer = ok(post(server, PATH, rendered))
    done = ok(post(server, "/v1/chat/completions", {**chat, "return_token_ids": True}))
    assert answer["request_id"] == rendered["request_id"]
    assert answer["choices"][0]["token_ids"] == done["choices"][0]["token_ids"]
    assert len(done["choices"][0]["token_ids"]) == 6
    assert done["prompt_token_ids"] == rendered["token_ids"]
    # A completions render is a list of GenerateRequests: each runs as it is.
    batch = ok(post(server, "/v1/completions/render",
                    {"model": "m", "prompt": [PROMPT, PROMPT[:4]], "max_tokens": 3, **GREEDY}))
    for item, prompt in zip(batch, (PROMPT, PROMPT[:4]), strict=True):
        ids = ok(post(server, PATH, item))["choices"][0]["token_ids"]
        assert ids == completion(server, prompt, max_tokens=3, **GREEDY)["choices"][0][
            "token_ids"]


def test_streamed_chunks_join_to_the_answer(server):
    params = {**GREEDY, "max_tokens": 10, "n": 2, "seed": 3, "temperature": 0.8}
    whole = generate(server, PROMPT, **params)
    body = {"request_id": "s-1", "token_ids": PROMPT, "sampling_params": params,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    chunks = sse_events(server, PATH, body)
    *parts, last = chunks
    assert last == {"request_id": "s-1", "choices": [],
                    "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 20,
                              "total_tokens": len(PROMPT) + 20,
                              "prompt_tokens_details": last["usage"]["prompt_tokens_details"]}}
    joined: dict[int, list[int]] = {0: [], 1: []}
    for chunk in parts:
        assert chunk["request_id"] == "s-1" and len(chunk["choices"]) == 1
        (choice,) = chunk["choices"]
        joined[choice["index"]] += choice["token_ids"]
        # continuous_usage_stats: that choice's tokens so far, as vLLM counts them.
        assert chunk["usage"]["completion_tokens"] == len(joined[choice["index"]])
        assert choice["finish_reason"] == ("length" if len(joined[choice["index"]]) == 10
                                           else None)
    by_index = {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert joined == by_index
    plain = sse_events(server, PATH, {**body, "stream_options": None})
    assert all(chunk["usage"] is None and chunk["choices"] for chunk in plain)


def test_n_gives_n_choices_and_a_seed_repeats(server):
    params = {"n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 8, "ignore_eos": True}
    first = generate(server, PROMPT, **params)
    assert sorted(c["index"] for c in first["choices"]) == [0, 1]
    assert all(len(c["token_ids"]) == 8 for c in first["choices"])
    again = generate(server, PROMPT, **params)
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"]
                                                          for c in first["choices"]]
    reference = completion(server, PROMPT, **params)["choices"]
    assert sorted(c["token_ids"] for c in reference) == sorted(c["token_ids"]
                                                               for c in first["choices"])


def test_logprobs_have_the_chat_shape_and_the_completions_values(server):
    answer = generate(server, PROMPT, max_tokens=4, logprobs=2, **GREEDY)
    (choice,) = answer["choices"]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    reference = completion(server, PROMPT, max_tokens=4, logprobs=2, **GREEDY)["choices"][0]
    for entry, expected in zip(content, reference["logprobs"]["token_logprobs"], strict=True):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] is None
        assert entry["logprob"] == pytest.approx(expected, abs=1e-5)
        tops = entry["top_logprobs"]
        assert len(tops) == 2 and tops[0]["logprob"] >= tops[1]["logprob"]
        # Greedy: the sampled token is the likeliest.
        assert tops[0] == {"token": entry["token"], "logprob": entry["logprob"], "bytes": None}
    scored = generate(server, PROMPT, max_tokens=1, prompt_logprobs=1, **GREEDY)
    expected = completion(server, PROMPT, max_tokens=1, prompt_logprobs=1, **GREEDY)
    got = scored["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT)
    want = expected["choices"][0]["prompt_logprobs"]
    for mine, theirs, tid in zip(got[1:], want[1:], PROMPT[1:], strict=True):
        assert mine[str(tid)]["logprob"] == pytest.approx(theirs[str(tid)]["logprob"], abs=1e-5)
        assert mine.keys() == theirs.keys()


def test_stop_token_ids_and_max_tokens_finish_reasons(server):
    free = generate(server, PROMPT, max_tokens=10, **GREEDY)["choices"][0]["token_ids"]
    stop_id = free[3]
    first_at = free.index(stop_id)
    stopped = generate(server, PROMPT, max_tokens=10, stop_token_ids=[stop_id],
                       **GREEDY)["choices"][0]
    reference = completion(server, PROMPT, max_tokens=10, stop_token_ids=[stop_id],
                           **GREEDY)["choices"][0]
    assert stopped["finish_reason"] == reference["finish_reason"] == "stop"
    assert stopped["token_ids"] == reference["token_ids"] == free[:first_at + 1]
    short = generate(server, PROMPT, max_tokens=2, **GREEDY)["choices"][0]
    assert (short["finish_reason"], short["token_ids"]) == ("length", free[:2])


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"token_ids": [5, 999_999]}, "token_ids", None),
    ({"token_ids": []}, "token_ids", None),
    ({"token_ids": list(range(1, MAX_MODEL_LEN + 1))}, "token_ids", None),
    ({"sampling_params": {"max_tokens": MAX_MODEL_LEN}}, "sampling_params.max_tokens", None),
    ({"sampling_params": {"bad_words": [""]}}, "sampling_params.bad_words", None),
    ({"sampling_params": {"use_beam_search": True}}, "sampling_params.use_beam_search",
     "unsupported_parameter"),
    ({"sampling_params": {"allowed_token_ids": [1, 999_999]}},
     "sampling_params.allowed_token_ids", None),
    ({"sampling_params": {"temprature": 0.5}}, "sampling_params.temprature",
     "unsupported_parameter"),
    ({"sampling_params": {"n": 17}}, "sampling_params.n", None),
    ({"sampling_params": {"logprobs": 21}}, "sampling_params.logprobs", None),
    ({"sampling_params": {"top_p": 0}}, "sampling_params.top_p", None),
    ({"sampling_params": {"stop_token_ids": [999_999]}}, "sampling_params.stop_token_ids", None),
    ({"sampling_params": {"logit_bias": {"999999": 1.0}}}, "sampling_params.logit_bias", None),
    ({"sampling_params": {"stop": ["a"], "detokenize": False}}, "sampling_params.stop", None),
    ({"sampling_params": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
     "sampling_params.structured_outputs.choice", None),
    ({"features": {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {}}}, "features",
     "unsupported_parameter"),
    ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params",
     "unsupported_parameter"),
    ({"model": "nope"}, "model", "model_not_found"),
    ({"priority": 2}, "priority", None),
    ({"cache_salt": ""}, "cache_salt", None),
    ({"request_id": "has space"}, "request_id", None),
])
def test_bad_bodies_are_400s_naming_the_field(server, body, param, code):
    full = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}, **body}
    r = post(server, PATH, full)
    assert r.status_code == (404 if code == "model_not_found" else 400), r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


def test_masks_and_truncation_run_as_on_completions(server):
    """bad_words, allowed_token_ids and truncate_prompt_tokens are vLLM SamplingParams fields
    pagellm implements: generate runs them exactly as /v1/completions does."""
    free = generate(server, PROMPT, max_tokens=8, **GREEDY)["choices"][0]["token_ids"]
    allowed = sorted(set(free[:3]) | {5, 6})
    words = [ok(post(server, "/detokenize", {"model": "m", "tokens": [t]}))["prompt"]
             for t in free]
    word = next(w.strip() for w in words if w.strip())  # a word the free answer holds
    cases = [{"allowed_token_ids": allowed}, {"truncate_prompt_tokens": 3},
             {"bad_words": [word]}]
    for extra in cases:
        got = generate(server, PROMPT, max_tokens=8, **GREEDY, **extra)["choices"][0]
        want = completion(server, PROMPT, max_tokens=8, **GREEDY, **extra)["choices"][0]
        assert got["token_ids"] == want["token_ids"], extra
    only = generate(server, PROMPT, max_tokens=8, allowed_token_ids=allowed, **GREEDY)
    assert set(only["choices"][0]["token_ids"]) <= set(allowed)


def test_defaults_that_ask_for_nothing_are_taken(server):
    # What vLLM's own SamplingParams serializes at its defaults, plus its bookkeeping.
    params = {**GREEDY, "max_tokens": 3, "bad_words": None, "use_beam_search": False,
              "spaces_between_special_tokens": True, "logits_processors": None,
              "output_kind": 0, "skip_clone": False, "flat_logprobs": False,
              "routed_experts_prompt_start": 0, "best_of": 1, "stop": []}
    ids = generate(server, PROMPT, **params)["choices"][0]["token_ids"]
    assert ids == completion(server, PROMPT, max_tokens=3, **GREEDY)["choices"][0]["token_ids"]


def test_generate_is_behind_the_api_key(server):
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = post(server, PATH, {"token_ids": PROMPT, "sampling_params": {}}, headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def cached_tokens(server, token_ids: list[int], headers: dict, **fields) -> int:
    (last,) = [c for c in sse_events(server, PATH, {
        "token_ids": token_ids, "stream": True, "stream_options": {"include_usage": True},
        "sampling_params": {"max_tokens": 1}, **fields}, headers) if not c["choices"]]
    return last["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_tenants_cache_namespace_applies(server):
    prompt = [(7 * i) % 390 + 1 for i in range(70)]  # 4 full blocks of 16
    completion(server, prompt, max_tokens=1)  # key A fills its namespace
    assert cached_tokens(server, prompt, AUTH) == 64
    assert cached_tokens(server, prompt, AUTH_B) == 0  # another tenant: nothing shared
    assert cached_tokens(server, prompt, AUTH, cache_salt="s1") == 0  # the salt narrows it


def test_the_router_gate_forwards_generate(server):
    async def run() -> None:
        gate = RouterGate(server.base_url)
        transport = httpx.ASGITransport(app=gate)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gate") as client:
                body = {"token_ids": PROMPT, "sampling_params": {**GREEDY, "max_tokens": 4}}
                r = await client.post(PATH, json=body, headers=AUTH)
                assert r.status_code == 200, r.text
                direct = generate(server, PROMPT, **GREEDY, max_tokens=4)
                assert r.json()["choices"] == direct["choices"]
                assert (await client.post(PATH, json=body)).status_code == 401  # the server's
                for path in ("/inference/v1/generate/x", "/inference/v2/generate",
                             "/inference/v1//generate"):
                    refused = await client.post(path, json=body, headers=AUTH)
                    assert refused.status_code == 404
                    assert refused.json()["error"]["code"] == "not_found"
        finally:
            if gate.client is not None:
                await gate.client.aclose()

    asyncio.run(run())
