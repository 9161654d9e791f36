"""Structural tags through a real ``pagellm serve`` (tiny random-weight model, openai SDK):
forced tool calls under --tool-call-parser hermes are generated in hermes' own format and read
back as calls that validate against the tool's schema (jsonschema), in every one of ten seeded
sampled runs, streamed and not; ``response_format: structural_tag`` output matches its tags;
a strict ``auto`` request stays free text read by the reasoning parser."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from server_utils import TOOLS_KEY, post

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
BEGIN = '<tool_call>\n{"name": "get_weather", "arguments": '
END = "}\n</tool_call>"


@pytest.fixture(scope="module")
def server(tools_server):
    return tools_server  # TOOLS_ARGS: hermes, deepseek_r1, chatml_tools, 2048 positions


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=TOOLS_KEY, max_retries=0,
                         timeout=120)


def streamed_calls(chunks) -> tuple[dict[int, list], str | None]:
    calls: dict[int, list] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, [None, ""])
                entry[0] = call.function.name or entry[0]
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish


def test_named_call_is_schema_valid_in_ten_sampled_runs(client, tiny_tokenizer):
    def plain(seed: int):
        return client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=400,
            temperature=1.0, seed=seed, extra_body={"return_token_ids": True}).choices[0]

    def streamed(seed: int):
        return streamed_calls(client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=400,
            temperature=1.0, seed=seed, stream=True))

    # Sent at once, so the engine batches them (each still has its own seed).
    with ThreadPoolExecutor(20) as pool:
        plains = list(pool.map(plain, range(10)))
        streams = list(pool.map(streamed, range(10)))
    for seed, choice in enumerate(plains):
        assert choice.finish_reason == "tool_calls", (seed, choice)
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        # What the model wrote is hermes' own call block, as the chat template writes it.
        text = tiny_tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
        assert text.startswith(BEGIN) and text.endswith(END), text
    for seed, (calls, finish) in enumerate(streams):
        ((name, arguments),) = calls.values()
        assert name == "get_weather" and finish == "tool_calls", seed
        jsonschema.validate(json.loads(arguments), WEATHER)


def test_required_calls_are_read_by_the_hermes_parser(client):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    def run(seed: int):
        return client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=600,
            temperature=1.0, seed=seed, parallel_tool_calls=False).choices[0]

    with ThreadPoolExecutor(3) as pool:
        choices = list(pool.map(run, range(3)))
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_response_format_structural_tag_output_matches_the_tags(client):
    fmt = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "tag", "begin": "<w>", "end": "</w>",
         "content": {"type": "json_schema", "json_schema": WEATHER}}]}}
    resp = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=300,
                                          temperature=1.0, seed=1, response_format=fmt)
    text = resp.choices[0].message.content
    match = re.fullmatch(r"Answer: <w>(.*)</w>", text, re.S)
    assert match, text
    jsonschema.validate(json.loads(match.group(1)), WEATHER)
    # The legacy shape on /v1/completions: free text, and any <w> block holds the schema.
    legacy = {"type": "structural_tag", "triggers": ["<w>"],
              "structures": [{"begin": "<w>", "schema": WEATHER, "end": "</w>"}]}
    out = client.completions.create(model="m", prompt="The weather:", max_tokens=60,
                                    temperature=1.0, seed=2,
                                    extra_body={"response_format": legacy}).choices[0].text
    for block in re.findall(r"<w>(.*?)</w>", out, re.S):
        jsonschema.validate(json.loads(block), WEATHER)


def test_strict_auto_is_free_text_read_with_the_reasoning_parser(client):
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    resp = client.chat.completions.create(model="m", messages=MESSAGES, tools=strict,
                                          max_tokens=16, temperature=1.0, seed=3,
                                          extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    # deepseek_r1 reads an answer that never closes </think> as all reasoning: the reasoning
    # parser still applies under this constraint (it allows free text first).
    assert choice.finish_reason == "length" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"]
    # A response_format of the request's own wins: its JSON is the content, never reasoning.
    resp = client.chat.completions.create(model="m", messages=MESSAGES, tools=strict,
                                          max_tokens=300, temperature=1.0, seed=3,
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "w", "schema": WEATHER}})
    jsonschema.validate(json.loads(resp.choices[0].message.content), WEATHER)


@pytest.mark.parametrize(("fmt", "needle"), [
    ({"type": "structural_tag", "format": {"type": "nope"}},
     "response_format: invalid structural tag: "),
    ({"type": "structural_tag", "triggers": ["<a"]}, "structural_tag"),
])
def test_bad_structural_tags_are_a_400_naming_the_field(server, fmt, needle):
    resp = post(server, "/v1/chat/completions", {
        "model": "m", "messages": MESSAGES, "max_tokens": 4, "response_format": fmt})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert "response_format" in (err["param"] or "") and needle in err["message"], err
