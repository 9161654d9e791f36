"""Streamed tool calls and reasoning, however the text is cut: the deltas join up to the
non-streaming answer (and to the calls the answer was made of), and the parse reads each new
piece once, plus a marker's length of lookback, so a stream costs time linear in its length.
The work is counted by the streamers themselves (``scanned_chars``: every character of the text
handed to the parse, to scan or to send), not timed."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm.entrypoints.openai.chat_output import ChoiceDeltas, read_message
from pagellm.entrypoints.openai.reasoning_parsers import (
    ReasoningStreamer,
    extract_reasoning,
    get_reasoning_parser,
)
from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.forced_tool_parsers import (
    NamedFunctionParser,
    RequiredToolsParser,
)
from pagellm.entrypoints.openai.tool_parsers.tool_call_streamer import (
    ToolCallStreamer,
    extract_tool_calls,
)

# Reading allowed per character of text and per delta (a delta may re-read a tail as long as
# the longest marker, <|python_tag|>): re-reading the text so far at each delta breaks it.
WORK_PER_CHAR = 6
WORK_PER_DELTA = 3 * 14
LINEAR = 10  # a 4,000-token stream may read at most this many characters per character

SETTINGS = settings(max_examples=150, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Prose around the calls: markers cut short (never whole), unicode, JSON-looking characters.
PROSE = ["Sure", " ", "\n", "\t", "é", "日本語", "😀", "<", "<b>", "a < b", "1 + 1", "{", "}", "[",
         "]", '"', "\\", ";", ",", "<tool_", "</tool_cal", "<|python", "[TOOL_CALL", "[ARG",
         "<thin", "</thin"]
NAMES = ["get_weather", "f", "é_tool", "write_file"]
# Argument strings: quotes, escapes, braces, unicode and markers cut short (a whole end marker
# inside an argument ends the call early in every vLLM parser too).
ARG_STRINGS = st.lists(st.sampled_from(
    ["a", " ", '"', "\\", "{", "}", "[", "]", ":", ",", "\n", "é", "😀", "日本", "<", ">", "/",
     "</tool_cal", "[TOOL_CALL", "<|python_ta", "</thin"]), max_size=6).map("".join)
ARGS = st.dictionaries(st.sampled_from(["city", "q", "n", "items", "é"]), st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(-1e3, 1e3) | ARG_STRINGS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ARG_STRINGS, inner, max_size=3),
    max_leaves=8), max_size=4)
CALLS = st.lists(st.tuples(st.sampled_from(NAMES), ARGS), max_size=3)


def dumps(value: object, ascii_only: bool) -> str:
    return json.dumps(value, ensure_ascii=ascii_only)


FORMATS = ["hermes", "llama3_json", "mistral", "mistral_named", "required", "named"]


@st.composite
def answers(draw, formats: list[str] = FORMATS) -> tuple[str, str, list[tuple[str, dict]]]:
    """(parser, a well-formed answer, its calls): calls in each parser's format, with text
    before them, between and after them where the format allows it."""
    parser = draw(st.sampled_from(formats))
    calls = draw(CALLS)
    ascii_only = draw(st.booleans())
    prose = draw(st.lists(st.sampled_from(PROSE), max_size=8).map("".join))
    if parser == "hermes":
        blocks = [f"<tool_call>\n{dumps({'name': n, 'arguments': a}, ascii_only)}\n</tool_call>"
                  + draw(st.sampled_from(["", "\n", " "])) for n, a in calls]
        return parser, prose + "".join(blocks), calls
    if parser == "llama3_json":
        objects = "; ".join(dumps({"name": n, "parameters": a}, ascii_only) for n, a in calls)
        if calls and draw(st.booleans()):
            return parser, draw(st.sampled_from(["", " ", "\n"])) + objects, calls
        return parser, prose + "<|python_tag|>" + objects, calls
    if parser == "mistral":
        return parser, prose + "[TOOL_CALLS]" + dumps(
            [{"name": n, "arguments": a} for n, a in calls], ascii_only), calls
    if parser == "mistral_named":
        return "mistral", prose + "".join(f"[TOOL_CALLS]{n}[ARGS]{dumps(a, ascii_only)}"
                                          for n, a in calls), calls
    if parser == "required":
        calls = calls or [("f", {})]
        return parser, dumps([{"name": n, "parameters": a} for n, a in calls], ascii_only), calls
    calls = [("fixed", calls[0][1] if calls else {})]
    return parser, draw(st.sampled_from(["", " "])) + dumps(calls[0][1], ascii_only), calls


def make_parser(name: str):
    if name == "required":
        return RequiredToolsParser()
    if name == "named":
        return NamedFunctionParser("fixed")
    return get_tool_parser(name)


@st.composite
def cuts(draw, text: str) -> list[str]:
    """``text`` in pieces of 1 to 8 characters, as tokens arrive."""
    parts, i = [], 0
    while i < len(text):
        n = draw(st.integers(1, 8))
        parts.append(text[i:i + n])
        i += n
    return parts or [""]


def stream_tools(parser, parts: list[str], max_calls: int | None = None):
    """(content, [(name, arguments)], work) of a stream of ``parts``."""
    streamer = ToolCallStreamer(parser, max_calls)
    content, calls = "", {}
    for i, part in enumerate(parts):
        c, deltas = streamer.feed(part, final=i == len(parts) - 1)
        content += c
        for d in deltas:
            if d.index not in calls:  # the first delta of a call: id, type and name
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None, d
            calls[d.index][1] += d.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], streamer.scanned_chars


def whole_answer(parser_name: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    """The non-streaming (content, [(name, arguments)])."""
    content, calls = extract_tool_calls(make_parser(parser_name), text)
    return content or "", [(c.function.name, c.function.arguments) for c in calls]


def assert_streams_like(parser_name: str, text: str, parts: list[str],
                        whole: tuple[str, list[tuple[str, str]]],
                        max_calls: tuple[int | None, ...] = (None, 1)) -> None:
    for limit in max_calls:
        content, calls, work = stream_tools(make_parser(parser_name), parts, limit)
        assert (content, calls) == (whole[0], whole[1][:limit])
        assert work <= WORK_PER_CHAR * len(text) + WORK_PER_DELTA * len(parts)


@SETTINGS
@given(st.data())
def test_tool_call_streams_join_up_however_cut(data):
    parser, text, calls = data.draw(answers())
    whole = whole_answer(parser, text)
    # The non-streaming answer is the calls the text was made of.
    assert [(n, json.loads(a)) for n, a in whole[1]] == calls
    assert_streams_like(parser, text, data.draw(cuts(text)), whole)


# Short answers with markers, streamed in three pieces: cut at every position, and again up to
# a marker's length further on, so that every marker is split at every place.
SHORT_ANSWERS = [
    ("hermes", 'Hi <b>\n<tool_call>\n{"name": "f", "arguments": {"a": "<\\"é"}}\n</tool_call>'
               '<tool_call>{"arguments": {}, "name": "g"}</tool_call>'),
    ("hermes", "No call: 1 < 2 and <tool_ is not a marker."),
    ("llama3_json", 'Hi<|python_tag|>{"name": "f", "parameters": {"a": [1]}};{"name": "g", '
                    '"parameters": {}}'),
    ("llama3_json", ' {"name": "f", "parameters": {"s": "😀"}}'),
    ("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": "]"}}, {"name": "g", '
                '"arguments": {}}]'),
    ("mistral", 'ok[TOOL_CALLS]f[ARGS]{"a": "[TOOL_CALLS"}[TOOL_CALLS]g[ARGS]{"b": 2}'),
    ("required", '[{"name": "f", "parameters": {"a": "\\\\"}}, {"name": "g", "parameters": {}}]'),
    ("named", ' {"a": {"b": ["}", "\\""]}}'),
]


def splits(text: str, span: int = 16) -> list[tuple[int, int]]:
    """Cut points (i, j): i anywhere, j up to ``span`` characters further on."""
    return [(i, j) for i in range(len(text) + 1) for j in range(i, min(i + span, len(text)) + 1)]


@pytest.mark.parametrize(("parser", "text"), SHORT_ANSWERS)
def test_markers_split_at_every_position(parser, text):
    whole = whole_answer(parser, text)
    for i, j in splits(text):
        assert_streams_like(parser, text, [p for p in (text[:i], text[i:j], text[j:]) if p],
                            whole, max_calls=(None,))


# Never "</think>" when joined: a thought is all reasoning.
THOUGHT = ["I", " think", "\n", "é", "😀", "<", "/", "</thin", "<thin", ">", " a < b"]
REASONING_TEXTS = st.lists(st.sampled_from(THOUGHT + ["<think>", "</think>", " ", "\u2003"]),
                           max_size=20).map("".join)


@st.composite
def reasoning_answers(draw) -> tuple[str, str, str | None, str | None]:
    """(parser, answer, reasoning_content, content) of answers whose split is known."""
    thought = draw(st.lists(st.sampled_from(THOUGHT), min_size=1, max_size=12).map("".join))
    answer = draw(st.lists(st.sampled_from(THOUGHT + ["</think>"]), min_size=1,
                           max_size=8).map("".join))
    lead = draw(st.sampled_from(["", " ", "\n\n"]))
    form = draw(st.sampled_from(["block", "open", "plain", "r1"]))
    if form == "block":
        return (draw(st.sampled_from(["qwen3", "deepseek_r1"])),
                f"{lead}<think>{thought}</think>{answer}", thought, answer)
    if form == "open":  # cut short while thinking
        return draw(st.sampled_from(["qwen3", "deepseek_r1"])), f"<think>{thought}", thought, None
    if form == "plain":  # Qwen3 without thinking
        text = "x" + answer
        return "qwen3", text, None, text
    return "deepseek_r1", f"{thought}</think>{answer}", thought, answer  # R1: no <think>


def stream_reasoning(name: str, parts: list[str]) -> tuple[str, str, int]:
    streamer = ReasoningStreamer(get_reasoning_parser(name))
    reasoning = content = ""
    for i, part in enumerate(parts):
        r, c = streamer.feed(part, final=i == len(parts) - 1)
        reasoning += r
        content += c
    return reasoning, content, streamer.scanned_chars


@SETTINGS
@given(st.data())
def test_reasoning_streams_join_up_however_cut(data):
    name, text, reasoning, content = data.draw(reasoning_answers())
    assert extract_reasoning(get_reasoning_parser(name), text) == (reasoning, content)
    parts = data.draw(cuts(text))
    got_reasoning, got_content, work = stream_reasoning(name, parts)
    assert (got_reasoning, got_content) == (reasoning or "", content or "")
    assert work <= WORK_PER_CHAR * len(text) + WORK_PER_DELTA * len(parts)


@SETTINGS
@given(st.data())
def test_any_text_streams_like_the_whole_text(data):
    """Even answers that are not well formed: the reasoning split, streamed, is the whole
    text's."""
    text = data.draw(REASONING_TEXTS)
    parts = data.draw(cuts(text))
    for name in ("qwen3", "deepseek_r1"):
        reasoning, content = extract_reasoning(get_reasoning_parser(name), text)
        got = stream_reasoning(name, parts)
        assert got[:2] == (reasoning or "", content or "")


@pytest.mark.parametrize("text", ["  <think>ab</thi</think>cd</think>", "<thin", " x</think>y"])
@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_think_tags_split_at_every_position(name, text):
    whole = extract_reasoning(get_reasoning_parser(name), text)
    for i, j in splits(text):
        parts = [p for p in (text[:i], text[i:j], text[j:]) if p] or [""]
        assert stream_reasoning(name, parts)[:2] == (whole[0] or "", whole[1] or "")


@SETTINGS
@given(st.data())
def test_reasoning_then_calls_stream_like_the_whole_message(data):
    """Qwen3 thinks, then calls tools (hermes): the deltas join up to the message."""
    _, text, calls = data.draw(answers(["hermes"]))
    thought = data.draw(st.lists(st.sampled_from(THOUGHT), max_size=6).map("".join))
    text = f"<think>{thought}</think>\n\n{text}"
    hermes, qwen3 = get_tool_parser("hermes"), get_reasoning_parser("qwen3")
    message, finish = read_message(text, "stop", hermes, None, qwen3)
    deltas = ChoiceDeltas(hermes, None, qwen3)
    parts = data.draw(cuts(text))
    reasoning, content, arguments, got_finish = "", "", {}, None
    for i, part in enumerate(parts):
        delta, got_finish = deltas.feed(part, "stop" if i == len(parts) - 1 else None)
        if delta is None:
            continue
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    assert reasoning == (message.reasoning_content or "")
    assert content == (message.content or "")
    assert [arguments[i] for i in sorted(arguments)] == \
        [c.function.arguments for c in message.tool_calls]
    assert [json.loads(a) for a in arguments.values()] == [a for _, a in calls]
    assert got_finish == finish


# ~20,000 characters of source code (about 4,000 tokens): quotes, escapes, braces, unicode and
# characters that start markers ("<", "[").
_rng = random.Random(0)
CODE = "".join(_rng.choice([
    "def f(x):\n", '    return {"a": [x, "b\\\\"]}\n', "# é 😀 a < b [i]\n", "s = '</tool'\n",
    "\tif x: y = [1, 2]\n", 'print("<|python")\n']) for _ in range(1500))[:20000]
LONG_ARGS = {"path": "main.py", "content": CODE}
PROSE_20K = ("Here is the plan: < step > [one] {two} 😀.\n" * 500)[:20000]


def long_answers() -> list[tuple[str, str, str, list[tuple[str, dict]]]]:
    """(parser, answer, content, calls) of some 20,000 characters."""
    call = {"name": "write_file", "arguments": LONG_ARGS}
    many = "".join(f"<tool_call>\n{json.dumps({'name': 'f', 'arguments': {'i': i}})}\n"
                   "</tool_call>\n" for i in range(400))
    small = "<tool_call>\n" + json.dumps({"name": "f", "arguments": {"a": 1}}) + "\n</tool_call>"
    return [
        ("hermes", "I'll write it.\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>",
         "I'll write it.\n", [("write_file", LONG_ARGS)]),
        ("hermes", PROSE_20K + small, PROSE_20K, [("f", {"a": 1})]),
        ("hermes", PROSE_20K, PROSE_20K, []),
        ("hermes", many, "", [("f", {"i": i}) for i in range(400)]),
        ("llama3_json", "<|python_tag|>" + json.dumps({"name": "write_file",
                                                        "parameters": LONG_ARGS})
         + '; {"name": "f", "parameters": {}}', "", [("write_file", LONG_ARGS), ("f", {})]),
        ("llama3_json", json.dumps({"name": "write_file", "parameters": LONG_ARGS}), "",
         [("write_file", LONG_ARGS)]),
        ("llama3_json", PROSE_20K, PROSE_20K, []),
        ("mistral", "[TOOL_CALLS]" + json.dumps([call]), "", [("write_file", LONG_ARGS)]),
        ("mistral", "[TOOL_CALLS]write_file[ARGS]" + json.dumps(LONG_ARGS), "",
         [("write_file", LONG_ARGS)]),
        ("mistral", PROSE_20K, PROSE_20K, []),
        ("required", json.dumps([{"name": "write_file", "parameters": LONG_ARGS}]), "",
         [("write_file", LONG_ARGS)]),
        ("named", json.dumps(LONG_ARGS), "", [("fixed", LONG_ARGS)]),
    ]


def token_pieces(text: str, seed: int = 0) -> list[str]:
    """``text`` in pieces of 1 to 5 characters."""
    rng = random.Random(seed)
    parts, i = [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        parts.append(text[i:i + n])
        i += n
    return parts


@pytest.mark.parametrize(("parser", "text", "content", "calls"), long_answers(),
                         ids=[f"{a[0]}-{i}" for i, a in enumerate(long_answers())])
def test_a_long_tool_call_stream_reads_each_character_a_few_times(parser, text, content, calls):
    got_content, streamed, work = stream_tools(make_parser(parser), token_pieces(text))
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in streamed] == calls
    assert work <= LINEAR * len(text)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_a_long_reasoning_stream_reads_each_character_a_few_times(name):
    text = "<think>" + CODE + "</think>" + PROSE_20K
    reasoning, content, work = stream_reasoning(name, token_pieces(text))
    assert (reasoning, content) == (CODE, PROSE_20K)
    assert work <= LINEAR * len(text)


def test_a_long_message_with_reasoning_and_a_call_reads_each_character_a_few_times():
    text = ("<think>" + CODE + "</think>\n\n<tool_call>\n"
            + json.dumps({"name": "write_file", "arguments": LONG_ARGS}) + "\n</tool_call>")
    deltas = ChoiceDeltas(get_tool_parser("hermes"), None, get_reasoning_parser("qwen3"))
    parts = token_pieces(text)
    arguments = ""
    for i, part in enumerate(parts):
        delta, _ = deltas.feed(part, "stop" if i == len(parts) - 1 else None)
        for call in (delta.tool_calls or []) if delta else []:
            arguments += call.function.arguments or ""
    assert json.loads(arguments) == LONG_ARGS
    assert deltas.reasoning.scanned_chars + deltas.tools.scanned_chars <= LINEAR * len(text)
