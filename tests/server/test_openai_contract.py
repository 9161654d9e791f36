"""What the server promises a client, on the real app over the fake engine core (in this process,
through httpx's ASGI transport; no model): tokenization does not stall the event loop, a field of
a feature the server lacks is refused by name instead of dropped, max_tokens past the context is
a 400 with the numbers, and a 500 says nothing of the exception behind it."""

from __future__ import annotations

import asyncio
import logging
import re
import threading

import pytest
from server_fakes import make_tokenizer
from server_fakes import run_fake_server as run

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.protocol import UNSUPPORTED_FIELDS
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.errors import EngineDeadError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PATHS = {"completions": COMPLETIONS, "chat": CHAT}
SECRET = "/srv/secret/weights.bin"  # stands for whatever an internal exception says
GATE_TIMEOUT_S = 30.0  # how long a gated tokenizer call waits before giving up


def body_for(path: str, **fields) -> dict:
    main = ({"messages": [{"role": "user", "content": "w3 w4"}]} if path == CHAT
            else {"prompt": [3, 4]})
    return {**main, "max_tokens": 2, **fields}


def post_all(requests: list[tuple[str, dict]], **server_kwargs) -> list:
    async def send(client, engine):
        return [await client.post(path, json=body) for path, body in requests]

    return run(send, **server_kwargs)


def assert_error(resp, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- tokenization off the event loop ---------------------------------------------------------
class GatedTokenizer:
    """The test tokenizer, but the first call of ``method`` on the huge prompt blocks until the
    test opens the gate: deterministic "tokenizing takes long"."""

    def __init__(self, method: str) -> None:
        self.inner = make_tokenizer()
        self.method = method
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.opened_by_test: bool | None = None

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        def gated(first, *args, **kwargs):
            if "w7 w7 w7" in str(first)[:100] and not self.entered.is_set():
                self.entered.set()
                # On the event loop this wait blocks the test itself, which then cannot open
                # the gate: the wait times out and opened_by_test is False.
                self.opened_by_test = self.gate.wait(GATE_TIMEOUT_S)
            return attr(first, *args, **kwargs)

        return gated


HUGE = " ".join(["w7"] * 20_000)


@pytest.mark.parametrize(("path", "method", "body"), [
    (COMPLETIONS, "encode", {"prompt": HUGE, "max_tokens": 2}),
    (CHAT, "apply_chat_template", {"messages": [{"role": "user", "content": HUGE}],
                                   "max_tokens": 2}),
    ("/tokenize", "encode", {"prompt": HUGE}),
])
def test_a_huge_prompt_being_tokenized_does_not_stall_other_requests(path, method, body):
    tokenizer = GatedTokenizer(method)

    async def scenario(client, engine):
        big = asyncio.ensure_future(client.post(path, json=body))
        while not tokenizer.entered.is_set():
            await asyncio.sleep(0.01)
        # The huge prompt is inside the tokenizer now; the rest of the server goes on.
        health = await client.get("/health")
        small = await client.post(COMPLETIONS, json={"prompt": [3, 4], "max_tokens": 2})
        tokenizer.gate.set()
        return health, small, await big

    health, small, big = run(scenario, tokenizer=tokenizer, max_model_len=32_768)
    assert tokenizer.opened_by_test, "the tokenizer ran on the event loop and blocked it"
    assert health.status_code == 200
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2
    assert big.status_code == 200, big.text
    usage = big.json().get("usage") or {"prompt_tokens": big.json()["count"]}
    assert usage["prompt_tokens"] == 20_000


# ---- fields of features the server lacks -----------------------------------------------------
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("path", "fields", "param"), [
    (COMPLETIONS, {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    (COMPLETIONS, {"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    (COMPLETIONS, {"use_beam_search": True}, "use_beam_search"),
    (COMPLETIONS, {"logits_processors": ["os:system"]}, "logits_processors"),
    (COMPLETIONS, {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    (COMPLETIONS, {"suffix": "w9"}, "suffix"),
    (COMPLETIONS, {"best_of": 3}, "best_of"),
    (CHAT, {"functions": [TOOL["function"]]}, "functions"),
    (CHAT, {"chat_template": "{{ 1 }}"}, "chat_template"),
    (CHAT, {"messages": [{"role": "user", "content": "w3"}, {"role": "assistant",
                                                            "function_call": {"name": "f"}}]},
     "messages"),
])
def test_a_feature_the_server_lacks_is_refused_by_name(path, fields, param):
    (resp,) = post_all([(path, body_for(path, **fields))])
    err = assert_error(resp, 400, param)
    assert "not supported yet" in err["message"] and err["code"] == "unsupported_parameter"


def test_every_unsupported_field_is_refused_where_it_applies():
    cases = [(field.name, PATHS[ep]) for field in UNSUPPORTED_FIELDS for ep in field.endpoints]
    resps = post_all([(path, body_for(path, **{name: {"asks": "for it"}}))
                      for name, path in cases])
    for (name, _), resp in zip(cases, resps, strict=True):
        assert_error(resp, 400, name)


@pytest.mark.parametrize(("path", "fields"), [
    # Defaults and nulls ask for nothing; OpenAI's bookkeeping fields change nothing.
    (COMPLETIONS, {"guided_json": None, "prompt_logprobs": None, "use_beam_search": False,
                   "bad_words": [], "response_format": {"type": "text"}, "suffix": "",
                   "best_of": 1, "add_special_tokens": True, "user": "u-1",
                   "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}),
    (CHAT, {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
            "logprobs": None, "echo": False, "user": "u-1", "metadata": {"k": "v"},
            "store": False, "service_tier": "auto", "parallel_tool_calls": True,
            "safety_identifier": "s", "prompt_cache_key": "k", "modalities": ["text"]}),
])
def test_defaults_and_harmless_fields_are_accepted(path, fields):
    (resp,) = post_all([(path, body_for(path, **fields))])
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


def test_chat_logprobs_null_is_valid_openai():
    (resp,) = post_all([(CHAT, body_for(CHAT, logprobs=None))])
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["logprobs"] is None


def test_unknown_fields_are_ignored_with_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="pagellm")
    odd_name = "x\nFORGED LOG LINE"
    (resp,) = post_all([(COMPLETIONS, body_for(COMPLETIONS, some_new_option="secret text",
                                               **{odd_name: 1}))])
    assert resp.status_code == 200, resp.text
    assert "Ignored unknown request fields: some_new_option (and 1 more)" in caplog.text
    assert "secret text" not in caplog.text  # names only: values may be prompt text
    assert "FORGED" not in caplog.text  # and only names that cannot forge a log line


# ---- cache_salt and max_tokens ---------------------------------------------------------------
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_empty_cache_salt_is_refused(path):
    resp, ok = post_all([(path, body_for(path, cache_salt="")),
                         (path, body_for(path, cache_salt="tenant-a"))])
    assert "non-empty" in assert_error(resp, 400, "cache_salt")["message"]
    assert ok.status_code == 200, ok.text


def test_max_tokens_past_the_context_is_a_400_with_the_numbers():
    # Context 16, prompt 2 tokens: room for 14.
    resps = post_all([
        (COMPLETIONS, {"prompt": [3, 4], "max_tokens": 15}),
        (CHAT, {"messages": [{"role": "user", "content": "w3 w4"}],
                "max_completion_tokens": 15}),
        (CHAT, {"messages": [{"role": "user", "content": "w3 w4"}], "max_tokens": 15}),
        (COMPLETIONS, {"prompt": [3, 4], "max_tokens": 14}),
        (COMPLETIONS, {"prompt": [3, 4], "max_tokens": None}),
        (CHAT, {"messages": [{"role": "user", "content": "w3 w4"}]}),
        (COMPLETIONS, {"prompt": [3, 4]}),  # omitted: OpenAI's default 16, cut to the room
    ], max_model_len=16)
    err = assert_error(resps[0], 400, "max_tokens")
    assert re.search(r"\b15\b.*\b16\b.*\b2 input tokens", err["message"]), err
    assert_error(resps[1], 400, "max_completion_tokens")
    assert_error(resps[2], 400, "max_tokens")
    # What fits runs; null (or no max_tokens) means the rest of the context.
    assert [r.json()["usage"]["completion_tokens"] for r in resps[3:]] == [14, 14, 14, 14]


# ---- 500s say nothing of their cause ---------------------------------------------------------
def raise_value_error(*args, **kwargs):
    raise ValueError(f"cannot open {SECRET}")


def raise_engine_dead(*args, **kwargs):
    raise EngineDeadError(f"The engine core failed:\nTraceback ...\n  File {SECRET}")


@pytest.mark.parametrize("raiser", [raise_value_error, raise_engine_dead])
def test_an_internal_error_is_a_500_without_its_text(monkeypatch, caplog, raiser):
    caplog.set_level(logging.ERROR, logger="pagellm")
    monkeypatch.setattr(AsyncLLM, "add_request", raiser)
    (resp,) = post_all([(COMPLETIONS, body_for(COMPLETIONS))])
    err = assert_error(resp, 500)
    assert SECRET not in resp.text and err["type"] == "server_error"
    assert "server log" in err["message"]
    if raiser is raise_value_error:  # not the client's fault: a 500, logged under its id
        assert err["code"] == "internal_server_error"
        request_id = re.search(r"request (cmpl-\w+)", err["message"]).group(1)
        assert f"Unhandled error in OpenAIServingCompletion (request {request_id})" \
            in caplog.text and SECRET in caplog.text
    else:
        assert err["code"] == "engine_dead"


def test_an_internal_error_outside_generation_is_a_500_without_its_text(caplog):
    class BrokenTokenizer(GatedTokenizer):
        def __getattr__(self, name):
            return raise_value_error if name == "encode" else getattr(self.inner, name)

    caplog.set_level(logging.ERROR, logger="pagellm")
    resps = post_all([("/tokenize", {"prompt": "w3"}), (COMPLETIONS, {"prompt": "w3"})],
                     tokenizer=BrokenTokenizer("encode"))
    for resp in resps:
        assert_error(resp, 500)
        assert SECRET not in resp.text
    assert SECRET in caplog.text


def test_an_internal_error_in_a_stream_is_an_error_event_without_its_text(monkeypatch):
    monkeypatch.setattr(OpenAIServingCompletion, "_choice", raise_value_error)
    (resp,) = post_all([(COMPLETIONS, body_for(COMPLETIONS, stream=True))])
    assert resp.status_code == 200
    assert resp.text.rstrip().endswith("data: [DONE]")
    assert '"internal_server_error"' in resp.text and SECRET not in resp.text
