"""The request-limits middleware's pre-parse scan (limits.scan_json): the nesting depth it finds
equals the parser's on any JSON, brackets in strings and escapes never fool it, and its work is
linear in the body on the inputs that made the old regex quadratic (counted, not timed)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.entrypoints.openai.limits import json_depth_exceeds, scan_json

SETTINGS = settings(max_examples=300, derandomize=True, deadline=None, database=None)
# Characters that matter to a JSON scanner, plus some that do not.
NASTY_TEXT = st.text(st.sampled_from('"\\[]{}/\n\tabcé\u2028\U0001f600'), max_size=12)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | NASTY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NASTY_TEXT, inner, max_size=4),
    max_leaves=30)


def parsed_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max((parsed_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((parsed_depth(v) for v in value.values()), default=0)
    return 0


def reference_depth(body: bytes) -> int:
    """A byte-at-a-time tokenizer (states: in string, escape; a depth counter): what scan_json
    must agree with, at a cost nobody would pay on the event loop."""
    depth = best = 0
    in_string = escape = False
    for c in body:
        if escape:
            escape = False
        elif in_string:
            if c == ord("\\"):
                escape = True
            elif c == ord('"'):
                in_string = False
        elif c == ord('"'):
            in_string = True
        elif c in b"[{":
            depth += 1
            best = max(best, depth)
        elif c in b"]}":
            depth -= 1
    return best


@SETTINGS
@given(value=JSON_VALUES, ascii_only=st.booleans())
def test_depth_equals_the_parsers_on_any_json(value, ascii_only):
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert scan_json(body).max_depth == parsed_depth(value) == reference_depth(body)


# Pieces of lexically valid JSON text, not always well-formed (unbalanced, unterminated).
TOKENS = st.sampled_from(["[", "]", "{", "}", ",", ":", " ", "1"]) | \
    NASTY_TEXT.map(lambda s: json.dumps(s))


@SETTINGS
@given(tokens=st.lists(TOKENS, max_size=40), tail=NASTY_TEXT)
def test_depth_equals_a_byte_tokenizer_on_broken_json(tokens, tail):
    # An unterminated string at the end (what the old regex retried at every quote).
    body = ("".join(tokens) + json.dumps(tail)[:-1]).encode()
    assert scan_json(body).max_depth == reference_depth(body)


def unterminated_escaped_quotes(n: int) -> bytes:
    return b'{"prompt": "' + b'\\"' * (n // 2)


@pytest.mark.parametrize("size", [24 * 1024, 2**20])
def test_unterminated_escaped_quote_strings(size):
    body = unterminated_escaped_quotes(size)
    assert scan_json(body).max_depth == 1
    # Brackets after the opening quote are text in that (never closed) string.
    assert scan_json(body + b"[[[[[[" * 1000).max_depth == 1
    assert not json_depth_exceeds(body + b"[[[[[[" * 1000, 16)
    deep_first = b'{"x": ' + b"[" * 40 + b"]" * 40 + b', "p": "' + body[12:]
    assert scan_json(deep_first).max_depth == 41 and json_depth_exceeds(deep_first, 40)


def test_escapes_decide_where_strings_end():
    # An escaped backslash, then a real closing quote: the brackets after it count.
    assert scan_json(b'["a\\\\", [[[]]]]').max_depth == 4
    # An escaped quote: still inside the string.
    assert scan_json(b'["a\\", [[[]]]]"]').max_depth == 1
    # Three backslashes: an escaped backslash, then an escaped quote.
    assert scan_json(b'["a\\\\\\"[[[["]').max_depth == 1
    many = b'{"p": "' + b'\\\\\\"\\n\\u005b[{' * 20_000 + b'", "x": [[1]]}'
    assert scan_json(many).max_depth == 3


def test_deep_nesting_and_the_exact_limit():
    assert scan_json(b"[" * 100_000 + b"]" * 100_000).max_depth == 100_000
    # Stops early once past the limit.
    assert 16 < scan_json(b"[" * 100_000, stop_above=16).max_depth < 100_000
    for limit in (1, 16, 32):
        at = b'{"a": ' + b"[" * (limit - 1) + b"]" * (limit - 1) + b"}"
        assert not json_depth_exceeds(at, limit)
        assert json_depth_exceeds(b"[" + at + b"]", limit)
    # Few opening brackets: no scan needed, same answer.
    assert not json_depth_exceeds(b'{"a": "]]]]]]]]]]"}', 1)


PATHOLOGICAL = {
    "unterminated escaped quotes": unterminated_escaped_quotes,
    "escaped backslashes": lambda n: b'{"p": "' + b"\\\\" * (n // 2) + b'"}',
    "many tiny strings": lambda n: b"[" + b'"",' * (n // 3) + b'""]',
    "strings of brackets": lambda n: b"[" + b'"[{",' * (n // 5) + b'""]',
    "empty arrays": lambda n: b"[" + b"[]," * (n // 3) + b"[]]",
    "deep": lambda n: b"[" * (n // 2) + b"]" * (n // 2),
}


@pytest.mark.parametrize("make", PATHOLOGICAL.values(), ids=PATHOLOGICAL.keys())
def test_work_is_linear(make):
    small, large = make(64 * 1024), make(4 * 64 * 1024)
    work_small, work_large = scan_json(small).work, scan_json(large).work
    # A fixed number of passes (4 over the body, 9 over its quotes and brackets), so at most
    # 13 reads of a byte; 4x the body is 4x the work.
    assert work_small <= 13 * len(small) and work_large <= 13 * len(large)
    assert work_large <= 4 * work_small + 64
