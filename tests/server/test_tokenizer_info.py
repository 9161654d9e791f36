"""GET /tokenizer_info (vLLM's, --enable-tokenizer-info-endpoint) over the fake engine: absent
without the flag, behind the API key, strict JSON with the template chats are rendered with,
the special tokens and the tokenizer class, and no file paths. The real model's template is
checked against /tokenize in test_openai_server.py."""

from __future__ import annotations

import asyncio
import json
import math

from jinja2.sandbox import ImmutableSandboxedEnvironment
from server_fakes import FAKE_CHAT_TEMPLATE, fake_server, make_tokenizer

from pagellm.entrypoints.openai.cli_serve import add_serve_parser
from pagellm.entrypoints.openai.serving_tokenization import tokenizer_info

KEY = "info-key"
ENABLED = {"enable_tokenizer_info_endpoint": True}
MESSAGES = [{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w5"}]


def run(coro_fn, **server_kwargs):
    async def main():
        async with fake_server(**server_kwargs) as (client, engine):
            return await coro_fn(client, engine)

    return asyncio.run(main())


def eos_tokenizer():
    tok = make_tokenizer()
    tok.eos_token = "w1"
    return tok


def test_absent_without_the_flag():
    async def go(client, engine):
        return (await client.get("/tokenizer_info")).status_code

    assert run(go) == 404


def test_flag_parses_off_by_default():
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert not parser.parse_args(["serve"]).enable_tokenizer_info_endpoint
    assert parser.parse_args(["serve", "--enable-tokenizer-info-endpoint"]) \
        .enable_tokenizer_info_endpoint


def test_reports_the_template_chats_use_tokens_and_class():
    async def go(client, engine):
        r = await client.get("/tokenizer_info")
        assert r.status_code == 200
        ids = (await client.post("/tokenize", json={"messages": MESSAGES})).json()["tokens"]
        return json.loads(r.text), ids, type(engine.tokenizer).__name__

    info, chat_ids, cls = run(go, tokenizer=eos_tokenizer(), app_kwargs=ENABLED)
    # The --chat-template override, not the tokenizer's (it has none).
    assert info["chat_template"] == FAKE_CHAT_TEMPLATE
    assert info["eos_token"] == "w1" and info["tokenizer_class"] == cls
    assert isinstance(info["model_max_length"], int)
    # Rendered as lm-evaluation-harness does, then tokenized: the ids a chat request gets.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(info["chat_template"]).render(messages=MESSAGES,
                                                         add_generation_prompt=True)
    assert make_tokenizer().encode(text, add_special_tokens=False) == chat_ids


def test_behind_the_api_key():
    async def go(client, engine):
        bare = await client.get("/tokenizer_info")
        keyed = await client.get("/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"})
        return bare.status_code, keyed.status_code

    assert run(go, app_kwargs={**ENABLED, "api_key": KEY}) == (401, 200)


def test_no_paths_and_strict_json(tmp_path):
    tok = eos_tokenizer()
    tok.init_kwargs.update(vocab_file=str(tmp_path / "vocab.json"), name_or_path=str(tmp_path),
                           tokenizer_file=str(tmp_path / "tokenizer.json"),
                           odd_float=math.inf, odd_object=object(), odd_tuple=(1, "a"))
    info = tokenizer_info(tok, None)
    text = json.dumps(info, allow_nan=False)
    assert str(tmp_path) not in text and "tokenizer_object" not in info
    assert info["odd_float"] is None and info["odd_tuple"] == [1, "a"]
    assert "odd_object" not in info and "chat_template" not in info
