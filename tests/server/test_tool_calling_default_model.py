"""Structured output and tool calling with real clients on the real default model (SmolLM2,
whose own template knows no tools: the server runs the shipped chatml_tools template and the
hermes parser): the openai SDK's ``parse`` and streaming helpers, langchain-openai's
``with_structured_output`` and ``bind_tools``. Every answer under a schema is checked with
jsonschema."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_utils import TINY_ARGS, ServerProcess

pytestmark = pytest.mark.slow

MODEL = "smol"
# Compact JSON: a 135M model otherwise tends to loop on free whitespace.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


class Address(BaseModel):
    city: str = Field(max_length=24)
    country: Literal["France", "Italy", "Germany"]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int
    hobbies: list[Literal["chess", "music", "running"]] = Field(max_length=3)
    address: Address


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


PERSON_SCHEMA = Person.model_json_schema()
WEATHER_PARAMS = GetWeather.model_json_schema()
ASK_PERSON = [{"role": "user", "content": "Invent a person who lives in Paris, as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("tools-default") / "server.log"
    srv = ServerProcess([*TINY_ARGS, "--served-model-name", MODEL, "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes", "--chat-template", "chatml_tools"], log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                         timeout=300)


def test_sdk_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=ASK_PERSON, response_format=Person, max_tokens=150,
        temperature=0, extra_body=COMPACT)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)
    jsonschema.validate(json.loads(completion.choices[0].message.content), PERSON_SCHEMA)


def test_streamed_json_schema_answer_validates(client):
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    chunks = client.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, response_format=schema, max_tokens=150,
        temperature=0.7, seed=1, stream=True, extra_body=COMPACT)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_sdk_streaming_helper_assembles_a_required_call(client):
    tool = openai.pydantic_function_tool(GetWeather)
    with client.chat.completions.stream(model=MODEL, messages=ASK_WEATHER, tools=[tool],
                                        tool_choice="required", max_tokens=100,
                                        temperature=0, extra_body=COMPACT) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "GetWeather" and call.id
    assert isinstance(call.function.parsed_arguments, GetWeather)
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)


def test_a_whole_tool_exchange(client):
    """Forced call, then the tool's answer goes back in the history and the model replies."""
    tools = [openai.pydantic_function_tool(GetWeather)]
    first = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=tools, max_tokens=100, temperature=0,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, extra_body=COMPACT)
    message = first.choices[0].message
    (call,) = message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    history = [*ASK_WEATHER, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=tools,
                                            tool_choice="none", max_tokens=30, temperature=0)
    answer = second.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_langchain_structured_output_and_bound_tools(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.base_url}/v1", api_key="x",
                     temperature=0, max_tokens=150, max_retries=0, timeout=300,
                     extra_body=COMPACT)
    person = llm.with_structured_output(Person).invoke(ASK_PERSON[0]["content"])
    assert isinstance(person, Person)

    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    message = bound.invoke(ASK_WEATHER[0]["content"])
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather" and call["id"]
    jsonschema.validate(call["args"], WEATHER_PARAMS)
