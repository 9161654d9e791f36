"""Structured outputs on the real default model (SmolLM2-135M-Instruct): a chat answer under a
JSON schema validates with jsonschema, and a choice answer is one of the choices."""

from __future__ import annotations

import json

import jsonschema

from pagellm import SamplingParams, StructuredOutputsParams

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                   "population_millions": {"type": "number"},
                   "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["city", "country", "population_millions", "landmarks"],
}


def test_json_schema_and_choice_on_the_default_model(default_llm) -> None:
    ask = "Describe Paris as JSON with city, country, population_millions and landmarks."
    json_params = SamplingParams(temperature=0.0, max_tokens=100,
                                 structured_outputs=StructuredOutputsParams(json=CITY_SCHEMA))
    choice_params = SamplingParams(temperature=0.0, max_tokens=10,
                                   structured_outputs=StructuredOutputsParams(
                                       choice=["yes", "no"]))
    outs = default_llm.chat([[{"role": "user", "content": ask}],
                             [{"role": "user", "content": "Is Paris in France? yes or no."}]],
                            [json_params, choice_params], use_tqdm=False)
    answer = outs[0].outputs[0]
    assert answer.finish_reason == "stop", answer.text
    value = json.loads(answer.text)
    jsonschema.validate(value, CITY_SCHEMA)
    assert value["city"] == "Paris" and value["country"] == "France"
    assert outs[1].outputs[0].text in ("yes", "no")
