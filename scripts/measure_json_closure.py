"""How often a JSON-constrained chat answer closes within max_tokens, per whitespace mode.

Against a running `pagellm serve` (the default model, SmolLM2-135M-Instruct, is what it is
meant for):

    pagellm serve --port 8011 &
    python scripts/measure_json_closure.py --base-url http://127.0.0.1:8011/v1

1. json_schema - 20 schemas (flat, nested, arrays, enums, numbers, optional fields) x 3 prompts,
   chat with response_format json_schema, temperature 0, max_tokens 64 (--max-tokens). An
   answer counts when json.loads parses it and jsonschema.validate accepts it.
2. tool call  - 10 tools x 2 prompts, tool_choice naming the tool, max_tokens 60
   (--tool-max-tokens). A call counts when the answer has exactly one call, of that tool, whose
   arguments parse and validate against its parameters.

Each case runs once per mode, a request's structured_outputs.max_whitespace_cnt choosing it:
"unbounded" (null: the old behaviour, xgrammar's and vLLM's default), "default" (the field
left out: the server's --structured-outputs-max-whitespace-cnt), "compact"
(disable_any_whitespace), and "cap=N" for any --caps given. Prints one line per mode and
section: answers that validate, finish reasons, mean completion tokens, and the share of
whitespace in the answers; --json-out writes every answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import jsonschema
import openai

_S = {"type": "string"}
_I = {"type": "integer"}
_N = {"type": "number"}
_B = {"type": "boolean"}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required}


# (name, schema, three prompts): flat objects, nested objects, arrays, enums, numbers, optional
# fields (a "required" shorter than the properties).
SCHEMAS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("city", _obj({"city": _S, "country": _S}),
     ["Give the capital of France as JSON.", "Name a big city in Japan as JSON.",
      "Which city is the Colosseum in? Answer in JSON."]),
    ("person", _obj({"name": _S, "age": _I}),
     ["Invent a person and give their name and age as JSON.",
      "Describe Albert Einstein's name and age at death as JSON.",
      "Make up a user profile with a name and an age."]),
    ("book", _obj({"title": _S, "author": _S, "year": _I}),
     ["Describe the book 1984 as JSON.", "Tell me about a famous novel as JSON.",
      "Give a children's book with its author and year."]),
    ("weather", _obj({"city": _S, "temperature_c": _N, "sunny": _B}),
     ["What is the weather like in Paris today? JSON please.",
      "Report the weather in London as JSON.", "Make up a weather report for Tokyo."]),
    ("product", _obj({"name": _S, "price": _N, "in_stock": _B}),
     ["Describe a laptop for sale as JSON.", "Give a product from a grocery store as JSON.",
      "Invent a phone listing with a price."]),
    ("sentiment", _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
                        "confidence": _N}),
     ["Classify the sentiment of 'I love this movie!' as JSON.",
      "What is the sentiment of 'The food was cold and bland'?",
      "Rate the sentiment of 'It is a Tuesday.'"]),
    ("color", _obj({"color": {"enum": ["red", "green", "blue", "yellow"]}, "hex": _S}),
     ["What color is the sky? Answer as JSON.", "What color is grass?",
      "Pick a color for a fire truck and give its hex code."]),
    ("point", _obj({"x": _N, "y": _N}),
     ["Give the point (3, 4) as JSON.", "Give a point on the unit circle as JSON.",
      "Where is the origin? JSON with x and y."]),
    ("math", _obj({"expression": _S, "result": _I}),
     ["What is 7 times 8? Give the expression and result as JSON.",
      "Compute 12 plus 30 as JSON.", "What is 100 divided by 4?"]),
    ("tags", _obj({"tags": {"type": "array", "items": _S, "maxItems": 4}}),
     ["List some tags for a blog post about cooking pasta.",
      "Give keywords for a video about space travel as JSON.",
      "Tag a photo of a dog on a beach."]),
    ("numbers", _obj({"numbers": {"type": "array", "items": _I, "maxItems": 6}}),
     ["List the first five prime numbers as JSON.", "Give the first four even numbers.",
      "List some odd numbers below ten."]),
    ("address", _obj({"name": _S, "address": _obj({"street": _S, "city": _S, "zip": _S})}),
     ["Give the address of the White House as JSON.",
      "Invent an address for a bakery in Berlin.", "Where does Sherlock Holmes live? JSON."]),
    ("order", _obj({"order_id": _I, "customer": _obj({"name": _S, "email": _S})}),
     ["Create an example order with a customer as JSON.",
      "Make up an online order for Alice.", "Invent an order record for a shop."]),
    ("recipe", _obj({"dish": _S, "ingredients": {"type": "array", "items": _S, "maxItems": 5},
                     "minutes": _I}),
     ["Give a simple pancake recipe as JSON.", "Describe how to make a salad as JSON.",
      "Share a quick recipe for an omelette."]),
    ("team", _obj({"team": _S, "members": {"type": "array", "maxItems": 3,
                                          "items": _obj({"name": _S, "role": _S})}}),
     ["Describe a small software team as JSON.", "List a band and its members as JSON.",
      "Invent a soccer team with a few players."]),
    ("event", _obj({"title": _S, "date": _S, "location": _S, "online": _B}, ["title", "date"]),
     ["Describe a conference as JSON.", "Plan a birthday party as JSON.",
      "Invent a webinar announcement."]),
    ("movie", _obj({"title": _S, "year": _I, "rating": _N, "genres": {
        "type": "array", "items": {"enum": ["action", "comedy", "drama", "scifi"]},
        "maxItems": 3}}, ["title", "year"]),
     ["Describe the movie Star Wars as JSON.", "Tell me about a comedy film as JSON.",
      "Recommend a drama movie."]),
    ("task", _obj({"task": _S, "priority": {"enum": ["low", "medium", "high"]}, "done": _B,
                   "notes": _S}, ["task", "priority"]),
     ["Add a to-do item to buy milk as JSON.", "Create a high priority task to fix a bug.",
      "Note a task to call mom."]),
    ("planet", _obj({"name": _S, "moons": _I, "radius_km": _N, "has_rings": _B}),
     ["Describe Saturn as JSON.", "Give facts about Mars as JSON.",
      "Describe the Earth as JSON."]),
    ("matrix", _obj({"rows": {"type": "array", "maxItems": 3,
                              "items": {"type": "array", "items": _I, "maxItems": 3}}}),
     ["Give the 2x2 identity matrix as JSON.", "Write a small matrix of numbers as JSON.",
      "Give a 3x3 matrix of zeros."]),
]

# (tool name, description, parameters, two prompts) for tool_choice naming the tool.
TOOLS: list[tuple[str, str, dict[str, Any], list[str]]] = [
    ("get_weather", "Get the current weather in a city",
     _obj({"city": _S, "unit": {"enum": ["celsius", "fahrenheit"]}}),
     ["What's the weather in Paris?", "Is it cold in Oslo right now?"]),
    ("send_email", "Send an email", _obj({"to": _S, "subject": _S}),
     ["Email bob@example.com about the meeting.", "Send Alice a note saying hello."]),
    ("search_web", "Search the web", _obj({"query": _S}),
     ["Find recent news about electric cars.", "Look up the height of Mount Everest."]),
    ("add_numbers", "Add two numbers", _obj({"a": _N, "b": _N}),
     ["What is 2 plus 3?", "Add 10 and 32."]),
    ("set_timer", "Set a timer", _obj({"minutes": _I, "label": _S}, ["minutes"]),
     ["Set a timer for 10 minutes.", "Remind me in 5 minutes to check the oven."]),
    ("book_flight", "Book a flight",
     _obj({"origin": _S, "destination": _S, "date": _S}),
     ["Book a flight from London to New York on May 3.", "I need to fly from Rome to Paris."]),
    ("translate", "Translate text",
     _obj({"text": _S, "target_language": {"enum": ["fr", "de", "es", "it"]}}),
     ["Translate 'good morning' to French.", "How do you say 'thank you' in German?"]),
    ("create_event", "Create a calendar event",
     _obj({"title": _S, "day": _S, "attendees": {"type": "array", "items": _S, "maxItems": 3}}),
     ["Schedule lunch with Sam on Friday.", "Create a team meeting on Monday."]),
    ("convert_currency", "Convert money between currencies",
     _obj({"amount": _N, "from": _S, "to": _S}),
     ["Convert 100 dollars to euros.", "How many yen is 50 pounds?"]),
    ("lookup_order", "Look up an order", _obj({"order_id": _I}),
     ["Where is my order 12345?", "Check the status of order 987."]),
]


@dataclass
class Answer:
    section: str  # "json_schema" or "tool"
    mode: str
    case: str
    prompt: str
    ok: bool
    finish_reason: str | None
    completion_tokens: int
    text: str
    error: str = ""


def mode_body(mode: str) -> dict[str, Any]:
    """The extra request fields of a mode."""
    if mode == "default":
        return {}
    if mode == "unbounded":
        return {"structured_outputs": {"max_whitespace_cnt": None}}
    if mode == "compact":
        return {"structured_outputs": {"disable_any_whitespace": True}}
    assert mode.startswith("cap="), mode
    return {"structured_outputs": {"max_whitespace_cnt": int(mode[4:])}}


def run_schema_case(client: openai.OpenAI, model: str, mode: str, name: str,
                    schema: dict[str, Any], prompt: str, max_tokens: int) -> Answer:
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], response_format=fmt,
        max_tokens=max_tokens, temperature=0, extra_body=mode_body(mode))
    choice = r.choices[0]
    text = choice.message.content or ""
    ok, error = True, ""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        ok, error = False, type(e).__name__
    return Answer("json_schema", mode, name, prompt, ok, choice.finish_reason,
                  r.usage.completion_tokens, text, error)


def run_tool_case(client: openai.OpenAI, model: str, mode: str, name: str, description: str,
                  params: dict[str, Any], prompt: str, max_tokens: int) -> Answer:
    tool = {"type": "function",
            "function": {"name": name, "description": description, "parameters": params}}
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], tools=[tool],
        tool_choice={"type": "function", "function": {"name": name}},
        max_tokens=max_tokens, temperature=0, extra_body=mode_body(mode))
    choice = r.choices[0]
    calls = choice.message.tool_calls or []
    text = json.dumps([c.function.model_dump() for c in calls]) if calls else (
        choice.message.content or "")
    ok, error = False, "no tool call"
    if len(calls) == 1 and calls[0].function.name == name:
        try:
            jsonschema.validate(json.loads(calls[0].function.arguments), params)
            ok, error = True, ""
        except (ValueError, jsonschema.ValidationError) as e:
            error = type(e).__name__
    return Answer("tool", mode, name, prompt, ok, choice.finish_reason,
                  r.usage.completion_tokens, text, error)


def whitespace_share(texts: list[str]) -> float:
    chars = sum(len(t) for t in texts)
    return sum(c.isspace() for t in texts for c in t) / chars if chars else 0.0


def summarize(answers: list[Answer], section: str, mode: str) -> str:
    mine = [a for a in answers if a.section == section and a.mode == mode]
    ok = sum(a.ok for a in mine)
    reasons = Counter(a.finish_reason for a in mine)
    tokens = sum(a.completion_tokens for a in mine) / max(len(mine), 1)
    return (f"{section:<12} {mode:<10} valid {ok:>3}/{len(mine):<3} ({ok / len(mine):6.1%})  "
            f"finish {dict(reasons)}  mean tokens {tokens:5.1f}  "
            f"whitespace {whitespace_share([a.text for a in mine]):5.1%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tool-max-tokens", type=int, default=60)
    ap.add_argument("--modes", default="unbounded,default",
                    help="comma-separated: unbounded, default, compact, cap=N")
    ap.add_argument("--sections", default="json_schema,tool",
                    help="comma-separated: json_schema, tool (a server without a tool parser, "
                         "e.g. vLLM's default, refuses named tool_choice)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json-out", default=None, help="write every answer here")
    args = ap.parse_args(argv)

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=600)
    model = args.model or client.models.list().data[0].id
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        mode_body(mode)  # a bad mode fails here, before any request
    print(f"model {model}; json_schema: {len(SCHEMAS)} schemas x 3 prompts, max_tokens "
          f"{args.max_tokens}; tool: {len(TOOLS)} tools x 2 prompts, tool_choice named, "
          f"max_tokens {args.tool_max_tokens}; temperature 0", flush=True)
    answers: list[Answer] = []
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    assert set(sections) <= {"json_schema", "tool"}, sections
    for mode in modes:  # one mode at a time: its lines print as soon as it is done
        jobs = []
        if "json_schema" in sections:
            jobs += [(run_schema_case, (mode, name, schema, p, args.max_tokens))
                     for name, schema, prompts in SCHEMAS for p in prompts]
        if "tool" in sections:
            jobs += [(run_tool_case, (mode, name, description, params, p,
                                      args.tool_max_tokens))
                     for name, description, params, prompts in TOOLS for p in prompts]
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers += pool.map(lambda job: job[0](client, model, *job[1]), jobs)
        for section in sections:
            print(summarize(answers, section, mode), flush=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump([asdict(a) for a in answers], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
