"""Real client libraries against a real ``pagellm serve`` (the tiny random Llama, fp32 on the
CPU): the openai SDK, langchain-openai and litellm as people point them at a vLLM server, plus
raw HTTP for what they do not show (per-chunk usage, error bodies). One server for the module.

The reference is transformers' greedy decoding on the same weights (one request) and, for the
clients, the same greedy request through the openai SDK. Nothing may leave this machine: the
``no_network`` guard refuses any host name but the local ones (litellm fetches its model cost
map at import unless LITELLM_LOCAL_MODEL_COST_MAP is set)."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
from server_utils import ServerProcess

API_KEY = "clients-key"
NAMES = ["tiny", "org/tiny-llama"]  # a served name may hold a slash (sent as %2F by the SDK)
MAX_MODEL_LEN = 256
ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory",
        "8MiB", "--max-num-seqs", "8", "--api-key", API_KEY, "--served-model-name", *NAMES]
MESSAGES = [{"role": "user", "content": "Hello, world! How are you today?"}]
NUM_TOKENS = 8
GREEDY = {"temperature": 0, "max_tokens": NUM_TOKENS}
IGNORE_EOS = {"ignore_eos": True}  # vLLM's field: every request runs NUM_TOKENS tokens
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    srv = ServerProcess([str(tiny_llama_dir), *ARGS],
                        tmp_path_factory.mktemp("clients") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any name lookup of a non-local host fails at once, and the test with it."""
    tried: list[str] = []
    real_getaddrinfo = socket.getaddrinfo

    def local_only(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else str(host)
        if name not in LOCAL_HOSTS:
            tried.append(name)
            raise socket.gaierror(f"tests must not reach the network ({name})")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", local_only)
    yield
    assert not tried, f"a client tried to reach {tried}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def reference_chat(client):
    """The greedy chat answer through the openai SDK, which the other clients must repeat."""
    return client.chat.completions.create(model=NAMES[0], messages=MESSAGES, **GREEDY,
                                          extra_body=IGNORE_EOS)


def post(server, path: str, body: dict | bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if isinstance(body, bytes):
        return httpx.post(f"{server.base_url}{path}", content=body, timeout=120,
                          headers={**headers, "Content-Type": "application/json"})
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=120)


def sse_events(server, path: str, body: dict) -> list[dict]:
    """The data events of a streamed response, up to (not including) [DONE]."""
    events = []
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return events
            events.append(json.loads(line.removeprefix("data: ")))
    raise AssertionError("the stream ended without [DONE]")


# ---- the openai SDK ---------------------------------------------------------------------------
def test_sdk_chat_matches_transformers(server, tiny_llama_dir, reference_chat):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = post(server, "/tokenize", {"model": NAMES[0], "messages": MESSAGES}).json()["tokens"]
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32,
                                               local_files_only=True).eval()
    ref.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=NUM_TOKENS, do_sample=False)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True)
    expected = tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    choice = reference_chat.choices[0]
    assert choice.message.content == expected and choice.finish_reason == "length"
    assert reference_chat.usage.prompt_tokens == len(ids)
    assert reference_chat.usage.completion_tokens == NUM_TOKENS


def test_sdk_completions_and_streams(client, reference_chat):
    prompt = "The quick brown fox"
    full = client.completions.create(model=NAMES[1], prompt=prompt, **GREEDY,
                                     extra_body=IGNORE_EOS)
    chunks = list(client.completions.create(model=NAMES[1], prompt=prompt, **GREEDY,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=IGNORE_EOS))
    *content, last = chunks
    assert "".join(c.choices[0].text for c in content) == full.choices[0].text
    assert last.choices == [] and last.usage == full.usage
    assert full.usage.completion_tokens == NUM_TOKENS

    chat_chunks = list(client.chat.completions.create(
        model=NAMES[0], messages=MESSAGES, **GREEDY, stream=True, extra_body=IGNORE_EOS))
    text = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert text == reference_chat.choices[0].message.content
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].choices[0].finish_reason == "length"


def test_sdk_models_list_and_retrieve(server, client):
    listed = client.models.list()
    assert [m.id for m in listed.data] == NAMES
    for name in NAMES:
        model = client.models.retrieve(name)
        assert (model.id, model.object, model.owned_by) == (name, "model", "pagellm")
        assert model.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and "no-such-model" in e.value.body["message"]
    # As /v1/models: the key is needed.
    keyless = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        keyless.models.retrieve(NAMES[0])
    assert httpx.get(f"{server.base_url}/v1/models/{NAMES[0]}").status_code == 401


# ---- raw HTTP: per-chunk usage, errors ---------------------------------------------------------
@pytest.mark.parametrize("path,body,count", [
    ("/v1/completions", {"prompt": "Hello, world!", "logprobs": 0},
     lambda choice: len(choice["logprobs"]["tokens"])),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True},
     lambda choice: len((choice.get("logprobs") or {}).get("content") or [])),
])
def test_continuous_usage_stats(server, path, body, count):
    """Every chunk carries the usage so far; completion_tokens counts the tokens streamed so
    far (each token's logprob entry counts one); include_usage keeps its final chunk."""
    events = sse_events(server, path, {
        "model": NAMES[0], **body, **GREEDY, **IGNORE_EOS, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == NUM_TOKENS
    prompt_tokens = final["usage"]["prompt_tokens"]
    streamed = 0
    for chunk in chunks:
        usage = chunk["usage"]
        streamed += sum(count(c) for c in chunk["choices"])
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["completion_tokens"] == streamed
        assert usage["total_tokens"] == prompt_tokens + streamed
    assert streamed == NUM_TOKENS and chunks[-1]["usage"] == final["usage"]
    # Without the option the chunks carry no usage (null), as before.
    plain = sse_events(server, path, {"model": NAMES[0], **body, **GREEDY, "stream": True})
    assert all(chunk.get("usage") is None for chunk in plain)


def test_malformed_json_names_no_field(server):
    resp = post(server, "/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] is None and err["type"] == "invalid_request_error"
    assert "not valid JSON" in err["message"]


def test_max_tokens_past_the_context_is_a_400(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAMES[0], prompt=[5], max_tokens=100_000)
    err = e.value.body
    assert err["param"] == "max_tokens"
    assert "100000" in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAMES[0], messages=MESSAGES,
                                       max_completion_tokens=100_000)
    assert e.value.body["param"] == "max_completion_tokens"
    # Completions' default max_tokens (16, not sent) is cut to the room the prompt leaves.
    full = client.completions.create(model=NAMES[0], prompt=[5] * (MAX_MODEL_LEN - 4),
                                     extra_body=IGNORE_EOS)
    assert full.usage.completion_tokens == 4 and full.choices[0].finish_reason == "length"


# ---- langchain-openai and litellm --------------------------------------------------------------
def test_langchain_chat_openai(server, reference_chat):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=NAMES[0], base_url=f"{server.base_url}/v1", api_key=API_KEY,
                     temperature=0, max_tokens=NUM_TOKENS, max_retries=0, timeout=120,
                     extra_body=IGNORE_EOS, stream_usage=True)
    expected = reference_chat.choices[0].message.content
    reply = llm.invoke(MESSAGES[0]["content"])
    assert reply.content == expected
    assert reply.usage_metadata["output_tokens"] == NUM_TOKENS
    chunks = list(llm.stream(MESSAGES[0]["content"]))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert merged.content == expected
    assert merged.usage_metadata["output_tokens"] == NUM_TOKENS
    assert merged.usage_metadata["input_tokens"] == reference_chat.usage.prompt_tokens


def test_litellm_completion(server, monkeypatch, reference_chat):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    import litellm

    kwargs = dict(model=f"openai/{NAMES[0]}", api_base=f"{server.base_url}/v1",
                  api_key=API_KEY, messages=MESSAGES, **GREEDY, extra_body=IGNORE_EOS,
                  num_retries=0, timeout=120)
    expected = reference_chat.choices[0].message.content
    resp = litellm.completion(**kwargs)
    assert resp.choices[0].message.content == expected
    assert resp.usage.completion_tokens == NUM_TOKENS
    chunks = list(litellm.completion(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
