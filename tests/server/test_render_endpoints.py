"""vLLM's render endpoints and return_token_ids on a real ``pagellm serve`` (the shared
``tools_server``: tiny random llama, --chat-template chatml_tools, hermes tool parser, API keys):
the ids a render answers with are
the ids /tokenize gives, the ids the real request runs on (its usage and its return_token_ids),
and for tools the ids of the template applied locally; a bad body gets the real endpoint's error;
return_token_ids' ids, fed back as a token prompt, continue the same greedy sequence."""

from __future__ import annotations

import json

import openai
import pytest
from server_utils import TOOLS_ARGS, TOOLS_KEY, ok, post, sse_events
from tiny_tokenizer import build_test_tokenizer

from pagellm.entrypoints.openai.serving_chat import load_chat_template

MAX_MODEL_LEN = int(TOOLS_ARGS[TOOLS_ARGS.index("--max-model-len") + 1])
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tools_server):
    return tools_server


def tokenize(server, **body) -> list[int]:
    return ok(post(server, "/tokenize", {"model": "m", **body}))["tokens"]


def test_completion_render_is_the_prompt_the_request_runs_on(server):
    text = "The quick brown fox jumps over the lazy dog"
    body = {"model": "m", "prompt": text, "max_tokens": 5, "temperature": 0.3, "seed": 7,
            "stop": "dog"}
    (rendered,) = ok(post(server, "/v1/completions/render", body))
    ids = rendered["token_ids"]
    assert ids == tokenize(server, prompt=text)
    assert rendered["request_id"].startswith("cmpl-")
    assert (rendered["model"], rendered["stream"], rendered["features"]) == ("m", False, None)
    params = rendered["sampling_params"]
    assert (params["max_tokens"], params["temperature"], params["seed"], params["stop"]) == \
        (5, 0.3, 7, ["dog"])
    done = ok(post(server, "/v1/completions", {**body, "return_token_ids": True}))
    assert done["usage"]["prompt_tokens"] == len(ids)
    assert done["choices"][0]["prompt_token_ids"] == ids


def test_completion_render_of_ids_and_batches(server):
    (rendered,) = ok(post(server, "/v1/completions/render", {"prompt": [5, 17, 42]}))
    assert rendered["token_ids"] == [5, 17, 42]
    # The default max_tokens (16) as the engine runs it; the model is echoed as sent (none).
    assert rendered["sampling_params"]["max_tokens"] == 16 and rendered["model"] is None
    texts = ["hello there", "a longer second prompt", "3"]
    for prompts, expected in ((texts, [tokenize(server, prompt=t) for t in texts]),
                              ([[9, 8, 7], [1, 2]], [[9, 8, 7], [1, 2]])):
        batch = ok(post(server, "/v1/completions/render", {"model": "m", "prompt": prompts}))
        assert [item["token_ids"] for item in batch] == expected
        ids = [item["request_id"] for item in batch]
        assert len(set(ids)) == len(ids) and all(i.endswith(f"-{n}") for n, i in enumerate(ids))
        done = ok(post(server, "/v1/completions", {"model": "m", "prompt": prompts,
                                                   "max_tokens": 2, "return_token_ids": True}))
        assert done["usage"]["prompt_tokens"] == sum(map(len, expected))
        by_index = sorted(done["choices"], key=lambda c: c["index"])
        assert [c["prompt_token_ids"] for c in by_index] == expected


@pytest.mark.parametrize("fields", [{}, {"add_generation_prompt": False},
                                    {"add_generation_prompt": False,
                                     "continue_final_message": True}])
def test_chat_render_is_tokenize_and_usage(server, fields):
    messages = MESSAGES if not fields.get("continue_final_message") else \
        [*MESSAGES, {"role": "assistant", "content": "It is"}]
    rendered = ok(post(server, "/v1/chat/completions/render",
                       {"model": "m", "messages": messages, **fields}))
    ids = rendered["token_ids"]
    assert rendered["request_id"].startswith("chatcmpl-")
    assert ids == tokenize(server, messages=messages, **fields)
    # No max_tokens: the rest of the context.
    assert rendered["sampling_params"]["max_tokens"] == MAX_MODEL_LEN - len(ids)
    done = ok(post(server, "/v1/chat/completions", {"model": "m", "messages": messages,
                                                    "max_tokens": 2, "return_token_ids": True,
                                                    **fields}))
    assert done["usage"]["prompt_tokens"] == len(ids) and done["prompt_token_ids"] == ids


def test_chat_render_with_tools_is_the_template_applied_locally(server):
    body = {"model": "m", "messages": MESSAGES, "tools": [TOOL], "max_tokens": 3}
    rendered = ok(post(server, "/v1/chat/completions/render", body))
    tokenizer = build_test_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, tools=[TOOL], tokenize=False,
                                         chat_template=load_chat_template("chatml_tools"),
                                         add_generation_prompt=True)
    assert "get_weather" in text
    assert rendered["token_ids"] == tokenizer.encode(text, add_special_tokens=False)
    assert rendered["sampling_params"]["structured_outputs"] is None  # "auto": free text
    # A named tool_choice forces the call: the parameters carry that constraint (with the hermes
    # parser, a structural tag of its <tool_call> block holding the tool's schema).
    named = ok(post(server, "/v1/chat/completions/render", {
        **body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    assert named["token_ids"] == rendered["token_ids"]
    tag = json.dumps(named["sampling_params"]["structured_outputs"]["structural_tag"])
    assert "city" in tag and "<tool_call>" in tag
    done = ok(post(server, "/v1/chat/completions", {**body, "return_token_ids": True}))
    assert done["prompt_token_ids"] == rendered["token_ids"]
    assert done["usage"]["prompt_tokens"] == len(rendered["token_ids"])


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": [5, 999_999]}),
    ("/v1/completions", {"prompt": "hi", "n": 0}),
    ("/v1/completions", {"prompt": "hi", "suffix": "tail"}),
    ("/v1/completions", {"prompt": "hi", "model": "nope"}),
    ("/v1/completions", {"prompt": "hi", "priority": 3}),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10_000]}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": MAX_MODEL_LEN}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "guided_regex": "a", "guided_choice": ["b"]}),
])
def test_a_bad_body_gets_the_real_endpoints_error(server, path, body):
    real = post(server, path, body)
    rendered = post(server, f"{path}/render", body)
    assert real.status_code in (400, 404), real.text
    assert (rendered.status_code, rendered.json()) == (real.status_code, real.json())


def test_render_is_behind_the_api_key(server):
    for path, body in (("/v1/completions/render", {"prompt": "hi"}),
                       ("/v1/chat/completions/render", {"messages": MESSAGES})):
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            r = post(server, path, body, headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_completion_token_ids_continue_the_sequence(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=TOOLS_KEY, max_retries=0)
    first = client.completions.create(model="m", prompt="Once upon a time", max_tokens=8,
                                      extra_body={**GREEDY, "return_token_ids": True})
    choice = first.model_dump()["choices"][0]
    prompt_ids, out_ids = choice["prompt_token_ids"], choice["token_ids"]
    assert len(out_ids) == 8 and first.usage.prompt_tokens == len(prompt_ids)
    # Token in, token out: the prompt plus half the answer, as ids, gives the other half.
    rest = ok(post(server, "/v1/completions", {"prompt": prompt_ids + out_ids[:4],
                                               "max_tokens": 4, "return_token_ids": True,
                                               **GREEDY}))["choices"][0]
    assert rest["prompt_token_ids"] == prompt_ids + out_ids[:4]
    assert rest["token_ids"] == out_ids[4:]
    assert choice["text"] == build_test_tokenizer().decode(out_ids)
    # Streamed: the prompt's ids once, in the choice's first chunk; the new ids per chunk.
    chunks = sse_events(server, "/v1/completions", {"prompt": "Once upon a time",
                                                    "max_tokens": 8, "stream": True,
                                                    "return_token_ids": True, **GREEDY})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [c["prompt_token_ids"] for c in choices] == [prompt_ids] + [None] * (len(choices) - 1)
    assert [t for c in choices for t in c["token_ids"]] == out_ids
    # Not asked for: null, as vLLM.
    plain = ok(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}))["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_chat_token_ids_continue_the_sequence(server):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 8, "return_token_ids": True,
            **GREEDY}
    done = ok(post(server, "/v1/chat/completions", body))
    prompt_ids, out_ids = done["prompt_token_ids"], done["choices"][0]["token_ids"]
    assert len(out_ids) == 8
    rest = ok(post(server, "/v1/completions", {"prompt": prompt_ids + out_ids[:5],
                                               "max_tokens": 3, "return_token_ids": True,
                                               **GREEDY}))["choices"][0]
    assert rest["token_ids"] == out_ids[5:]
    chunks = sse_events(server, "/v1/chat/completions", {**body, "stream": True})
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    streamed = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"] or []]
    assert streamed == out_ids
    plain = ok(post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}))
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None


def test_add_special_tokens_is_honoured_by_the_shared_render_step():
    """The test model's tokenizer adds no special tokens, so this runs the render step itself
    (no server) on a tokenizer whose post-processor adds BOS: completions add it unless
    add_special_tokens is false; chat adds it only when asked."""
    import asyncio
    from types import SimpleNamespace

    from tokenizers import processors

    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from pagellm.entrypoints.openai.serving_chat import ChatRenderer, OpenAIServingChat
    from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from pagellm.entrypoints.openai.serving_engine import ServedModels

    tokenizer = build_test_tokenizer()
    bos = tokenizer.convert_tokens_to_ids(tokenizer.bos_token)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, bos)])
    plain = build_test_tokenizer().encode("hello world", add_special_tokens=False)
    assert tokenizer.encode("hello world") == [bos, *plain]
    engine = SimpleNamespace(
        tokenizer=tokenizer, input_processor=SimpleNamespace(validate=lambda ids: None),
        config=SimpleNamespace(model=SimpleNamespace(vocab_size=len(tokenizer)),
                               scheduler=SimpleNamespace(policy="fcfs")))
    models = ServedModels(["m"], "m", MAX_MODEL_LEN)
    completions = OpenAIServingCompletion(engine, models)
    chat = OpenAIServingChat(engine, models,
                             ChatRenderer(tokenizer, load_chat_template("chatml_tools")))

    async def ids(serving, **body) -> list[int]:
        rendered = await serving.render(
            (CompletionRequest if serving is completions else ChatCompletionRequest)(**body))
        prompts = rendered.prompts if serving is completions else [rendered.prompt]
        return prompts[0]["prompt_token_ids"]

    async def run() -> None:
        assert await ids(completions, prompt="hello world") == [bos, *plain]
        assert await ids(completions, prompt="hello world", add_special_tokens=False) == plain
        messages = [{"role": "user", "content": "hi"}]
        templated = await ids(chat, messages=messages)
        assert templated[:2] != [bos, bos]  # the template's own <|im_start|>, no more
        assert await ids(chat, messages=messages, add_special_tokens=True) == [bos, *templated]
        completions.tokenizer_pool.shutdown()
        chat.tokenizer_pool.shutdown()

    asyncio.run(run())
