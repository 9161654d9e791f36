"""Specs and checks shared by the structured-output tests (independent references: jsonschema,
Python's re, json)."""

from __future__ import annotations

import json
import random
import re

import jsonschema

# Nested objects, arrays (of objects too), enums, required fields; every string and array is
# bounded, so a random-weight model must finish it within max_tokens. Strings are bounded with
# patterns: xgrammar 0.2.9 lets raw control characters (invalid JSON) into strings bounded with
# minLength/maxLength.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,4}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user"]},
        "addr": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                           "zip": {"type": "string", "pattern": "^[0-9]{2}$"}},
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "pets": {"type": "array", "maxItems": 1,
                 "items": {"type": "object",
                           "properties": {"kind": {"enum": ["cat", "dog"]}},
                           "required": ["kind"]}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "addr", "tags", "pets", "ok"],
}
EMAIL_REGEX = r"[a-z]{1,6}@[a-z]{2,5}\.(com|org)"
# Choices that need escaping in an EBNF literal: quotes, a backslash, non-ASCII, a newline.
CHOICES = ['say "yes"', "no\\way", "naïve", "two\nlines"]
# EBNF: a sum of small numbers in parentheses; SUM_REGEX is the same language.
SUM_GRAMMAR = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
SUM_REGEX = r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)"


_WORDS = ("the quick brown fox jumps over lazy dog paged attention stores keys and values in "
          "blocks hello world how are you today json name age city").split()


def prompts(n: int, vocab: int, seed: int, lo: int = 2, hi: int = 8) -> list[str]:
    """Random text prompts. Text, not random token ids: a prompt ending inside a UTF-8
    sequence would lend its stray bytes to the first characters of the output."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def check_json(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def check_regex(text: str, pattern: str) -> None:
    assert re.fullmatch(pattern, text), text
