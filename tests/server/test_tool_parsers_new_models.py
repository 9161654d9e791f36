"""qwen3_coder, deepseek_v3, deepseek_v31, kimi_k2 and pythonic on answers built from known calls
(the reference): the whole answer and the same answer streamed in random pieces (and split at
every position around the markers) give the calls it was built from, the same content, and
the streamed argument fragments join up to the whole answer's arguments. The parse's work is
counted by the streamer (characters of the text read), never timed."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm.entrypoints.openai.chat_tools import ChatToolOptions, plan_tools
from pagellm.entrypoints.openai.protocol_tools import ChatTool
from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.deepseek_tool_parsers import (
    CALL_BEGIN as DS_CALL,
)
from pagellm.entrypoints.openai.tool_parsers.deepseek_tool_parsers import (
    CALL_END as DS_END,
)
from pagellm.entrypoints.openai.tool_parsers.deepseek_tool_parsers import (
    CALLS_BEGIN as DS_BEGIN,
)
from pagellm.entrypoints.openai.tool_parsers.deepseek_tool_parsers import (
    CALLS_END as DS_CLOSE,
)
from pagellm.entrypoints.openai.tool_parsers.deepseek_tool_parsers import SEP as DS_SEP
from pagellm.entrypoints.openai.tool_parsers.tool_call_streamer import (
    ToolCallStreamer,
    extract_tool_calls,
)

NEW = ["qwen3_coder", "deepseek_v3", "deepseek_v31", "kimi_k2", "pythonic"]
K_BEGIN, K_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARGS, K_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", \
    "<|tool_call_end|>"

# Work allowed per character and per piece (a piece may re-read a tail as long as the longest
# marker, <|tool_calls_section_begin|>, in each of two spellings): re-reading the answer so far
# at every piece breaks it.
WORK_PER_CHAR = 6
WORK_PER_DELTA = 3 * 28
LINEAR = 10

SETTINGS = settings(max_examples=120, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# The tools of the requests (qwen3_coder types its values by them).
PROPERTIES = {"city": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"},
              "flag": {"type": "boolean"}, "items": {"type": "array"},
              "obj": {"type": "object"}, "maybe": {"type": ["integer", "null"]}}
NAMES = ["get_weather", "f", "write_file"]
TOOLS = [ChatTool.model_validate({"type": "function", "function": {
    "name": n, "parameters": {"type": "object", "properties": PROPERTIES}}}) for n in NAMES]

# Prose around the calls: markers cut short (never whole), unicode, brackets, quotes.
PROSE = ["Sure", " ", "\n", "é", "日本語", "😀", "<", "a < b", "1 + 1", "{", "}", "[", "]", '"',
         "\\", ",", "<tool_", "</tool_cal", "<funct", "<｜tool▁call", "<｜tool▁calls▁be",
         "<|tool_calls_sec", "<|tool_call_begin", "[see", "[x "]
# Strings in arguments: quotes, escapes, brackets, unicode, and markers (JSON and Python
# strings may hold any marker whole; Qwen3-Coder's text values all but </parameter>).
PIECES = ["a", " ", '"', "'", "\\", "{", "}", "[", "]", "(", ")", ":", ",", "=", "\n", "é", "😀",
          "日本", "<", ">", "/", "</parame", "<parameter=", "</function>", "<tool_call>",
          "</tool_call>", "<｜tool▁call▁end｜>", "<|tool_call_end|>", "```", "'''", '"""']
STRINGS = st.lists(st.sampled_from(PIECES), max_size=6).map("".join).filter(
    lambda s: s.strip().lower() != "null")
JSONS = st.recursive(st.none() | st.booleans() | st.integers(-1000, 1000)
                     | st.floats(-1e3, 1e3) | STRINGS,
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(STRINGS, inner, max_size=3), max_leaves=8)
# Values by property, as the schema types them.
VALUES = {"city": STRINGS, "n": st.integers(-10**6, 10**6),
          "x": st.floats(-1e6, 1e6).filter(lambda v: not v.is_integer()),
          "flag": st.booleans(), "items": st.lists(JSONS, max_size=3),
          "obj": st.dictionaries(STRINGS, JSONS, max_size=3),
          "maybe": st.none() | st.integers(-5, 5)}


@st.composite
def arguments(draw) -> dict:
    keys = draw(st.lists(st.sampled_from(sorted(PROPERTIES)), unique=True, max_size=4))
    return {k: draw(VALUES[k]) for k in keys}


CALLS = st.lists(st.tuples(st.sampled_from(NAMES), arguments()), max_size=3)


def qwen3_value(value: object, draw) -> str:
    """A value as Qwen3-Coder's chat template writes it: strings as they are, the rest as JSON
    (or as Jinja's ``string`` filter writes a Python bool)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) and draw(st.booleans()):
        return str(value)
    return json.dumps(value, ensure_ascii=draw(st.booleans()))


def render(parser: str, calls: list[tuple[str, dict]], draw) -> str:
    """The calls in the parser's format."""
    ascii_only = draw(st.booleans())
    if parser == "qwen3_coder":
        blocks = []
        for name, args in calls:
            params = "".join(f"<parameter={k}>\n{qwen3_value(v, draw)}\n</parameter>\n"
                             for k, v in args.items())
            blocks.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
        return "".join(b + draw(st.sampled_from(["", "\n", " \n"])) for b in blocks[:-1]) \
            + blocks[-1]
    if parser == "deepseek_v3":
        return DS_BEGIN + "\n".join(
            f"{DS_CALL}function{DS_SEP}{n}\n```json\n{json.dumps(a, ensure_ascii=ascii_only)}"
            f"\n```{DS_END}" for n, a in calls) + DS_CLOSE
    if parser == "deepseek_v31":
        return DS_BEGIN + "".join(
            f"{DS_CALL}{n}{DS_SEP}{json.dumps(a, ensure_ascii=ascii_only)}{DS_END}"
            for n, a in calls) + DS_CLOSE
    if parser == "kimi_k2":
        return K_BEGIN + "".join(
            f"{K_CALL}functions.{n}:{i}{K_ARGS}{json.dumps(a, ensure_ascii=ascii_only)}"
            f"{K_CALL_END}" for i, (n, a) in enumerate(calls)) + K_END
    # pythonic: Python literals, as repr writes them
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
                           for n, a in calls) + "]"


def shown(prose: str) -> str:
    """Text outside the calls is content unless it is only whitespace."""
    return prose if prose.strip() else ""


@st.composite
def answers(draw, parsers: list[str] = NEW):
    """(parser, answer, content, calls)."""
    parser = draw(st.sampled_from(parsers))
    calls = draw(CALLS if parser != "pythonic" else CALLS.filter(bool))
    prose = st.lists(st.sampled_from(PROSE), max_size=6).map("".join)
    before, after = draw(prose), draw(prose)
    if not calls:
        return parser, before + after, before + after, []
    return (parser, before + render(parser, calls, draw) + after, shown(before) + shown(after),
            calls)


@st.composite
def cuts(draw, text: str) -> list[str]:
    """``text`` in pieces of 1 to 8 characters, as tokens arrive."""
    parts, i = [], 0
    while i < len(text):
        n = draw(st.integers(1, 8))
        parts.append(text[i:i + n])
        i += n
    return parts or [""]


def parser_for(name: str):
    return get_tool_parser(name).for_tools(TOOLS)


def stream(name: str, parts: list[str], max_calls: int | None = None):
    """(content, [(id, name, arguments)], work) of a stream of ``parts``."""
    streamer = ToolCallStreamer(parser_for(name), max_calls)
    content, calls = "", {}
    for i, part in enumerate(parts):
        c, deltas = streamer.feed(part, final=i == len(parts) - 1)
        content += c
        for d in deltas:
            if d.index not in calls:  # the first delta of a call: id, type and name
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = [d.id, d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None, d
            calls[d.index][2] += d.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], streamer.scanned_chars


def whole(name: str, text: str) -> tuple[str, list[tuple[str, str, str]]]:
    content, calls = extract_tool_calls(parser_for(name), text)
    return content or "", [(c.id, c.function.name, c.function.arguments) for c in calls]


def check_stream(name: str, text: str, parts: list[str], expected: tuple[str, list],
                 max_calls: tuple[int | None, ...] = (None, 1)) -> None:
    """The stream gives the whole answer's content, names and arguments (ids, when the model
    wrote them), reading each character a few times."""
    for limit in max_calls:
        content, calls, work = stream(name, parts, limit)
        want = expected[1][:limit]
        assert content == expected[0]
        assert [(n, a) for _, n, a in calls] == [(n, a) for _, n, a in want]
        if name == "kimi_k2":
            assert [i for i, _, _ in calls] == [i for i, _, _ in want]
        assert work <= WORK_PER_CHAR * len(text) + WORK_PER_DELTA * len(parts)


@SETTINGS
@given(st.data())
def test_whole_and_streamed_answers_give_the_calls_they_were_built_from(data):
    name, text, content, calls = data.draw(answers())
    got = whole(name, text)
    assert got[0] == content
    assert [(n, json.loads(a)) for _, n, a in got[1]] == calls
    check_stream(name, text, data.draw(cuts(text)), got)


# Short answers, cut in three pieces at every pair of positions up to 30 characters apart:
# every marker (the longest is 28 characters) is split at every place.
SHORT = [
    ("qwen3_coder", 'Hi <b>\n<tool_call>\n<function=f>\n<parameter=city>\nP "<"\n</parameter>\n'
                    "<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=g>\n</function>\n</tool_call> bye",
     "Hi <b>\n bye", [("f", {"city": 'P "<"', "n": 7}), ("g", {})]),
    ("qwen3_coder", "No call: <tool_ and <function= are text.",
     "No call: <tool_ and <function= are text.", []),
    ("deepseek_v3", f"ok{DS_BEGIN}{DS_CALL}function{DS_SEP}f\n```json\n" + '{"a": "]"}'
                    f"\n```{DS_END}\n{DS_CALL}function{DS_SEP}g\n```json\n{{}}\n```{DS_END}"
                    f"{DS_CLOSE}",
     "ok", [("f", {"a": "]"}), ("g", {})]),
    ("deepseek_v31", f"{DS_BEGIN}{DS_CALL}f{DS_SEP}" + '{"a": "' + DS_END + '"}'
                     f"{DS_END}{DS_CLOSE}\nThat's it.",
     "\nThat's it.", [("f", {"a": DS_END})]),
    ("kimi_k2", f"Let me look.{K_BEGIN}{K_CALL}functions.f:0{K_ARGS}" + '{"q": 1}'
                f"{K_CALL_END}{K_CALL}functions.g:1{K_ARGS}{{}}{K_CALL_END}{K_END}",
     "Let me look.", [("f", {"q": 1}), ("g", {})]),
    ("pythonic", "I'll call [see] [f(a=\"x'\", b=[1, (2, 3)], c={'k': None}), "
                 "g(s='''tri\"\"ple''', t=True,)] now",
     "I'll call [see]  now", [("f", {"a": "x'", "b": [1, [2, 3]], "c": {"k": None}}),
                              ("g", {"s": 'tri""ple', "t": True})]),
    ("pythonic", "[get_weather()]", "", [("get_weather", {})]),
]


def splits(text: str, span: int = 30) -> list[tuple[int, int]]:
    return [(i, j) for i in range(len(text) + 1) for j in range(i, min(i + span, len(text)) + 1)]


@pytest.mark.parametrize(("name", "text", "content", "calls"), SHORT)
def test_markers_split_at_every_position(name, text, content, calls):
    got = whole(name, text)
    assert got[0] == content
    assert [(n, json.loads(a)) for _, n, a in got[1]] == calls
    for i, j in splits(text):
        check_stream(name, text, [p for p in (text[:i], text[i:j], text[j:]) if p], got,
                     max_calls=(None,))


def test_qwen3_coder_types_values_by_the_request_tools():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
            "<parameter=n>\n42\n</parameter>\n<parameter=x>\n2.0\n</parameter>\n"
            "<parameter=flag>\nFalse\n</parameter>\n<parameter=items>\n[1, \"a\"]\n"
            "</parameter>\n<parameter=obj>\n{'k': (1, 2)}\n</parameter>\n"
            "<parameter=maybe>\nnull\n</parameter>\n<parameter=other>\n[1]\n</parameter>\n"
            "<parameter=n2>\nx\n</parameter>\n</function>\n</tool_call>")
    expected = {"city": "42", "n": 42, "x": 2, "flag": False, "items": [1, "a"],
                "obj": {"k": [1, 2]}, "maybe": None, "other": "[1]", "n2": "x"}
    # The parser the server makes for a request: plan_tools hands it the request's tools.
    plan = plan_tools(TOOLS, "auto", True, ChatToolOptions(
        enable_auto_tool_choice=True, tool_call_parser="qwen3_coder"))
    _, (call,) = extract_tool_calls(plan.parser, text)
    assert json.loads(call.function.arguments) == expected
    # Not a number where the schema wants one: the text stays a string.
    bad = text.replace("<parameter=n>\n42", "<parameter=n>\nmany")
    _, (call,) = extract_tool_calls(plan.parser, bad)
    assert json.loads(call.function.arguments)["n"] == "many"
    # Without the tools every value is a string.
    _, (call,) = extract_tool_calls(get_tool_parser("qwen3_coder"), text)
    assert json.loads(call.function.arguments)["n"] == "42"


def test_qwen3_coder_streams_one_fragment_per_parameter():
    text = SHORT[0][1]
    streamer = ToolCallStreamer(parser_for("qwen3_coder"))
    fragments = []
    for i, ch in enumerate(text):
        _, deltas = streamer.feed(ch, i == len(text) - 1)
        fragments += [(d.index, d.function.name, d.function.arguments) for d in deltas]
    assert fragments[:4] == [(0, "f", "{"), (0, None, '"city": "P \\"<\\""'),
                             (0, None, ', "n": 7'), (0, None, "}")]
    assert fragments[4:] == [(1, "g", "{"), (1, None, "}")]


def test_json_arguments_stream_as_they_are_written():
    """deepseek and kimi: the name is sent before the arguments, which come in pieces."""
    for name in ("deepseek_v3", "deepseek_v31", "kimi_k2"):
        args = json.dumps({"content": "x" * 200})
        text = {"deepseek_v3": f"{DS_BEGIN}{DS_CALL}function{DS_SEP}f\n```json\n{args}\n```"
                               f"{DS_END}{DS_CLOSE}",
                "deepseek_v31": f"{DS_BEGIN}{DS_CALL}f{DS_SEP}{args}{DS_END}{DS_CLOSE}",
                "kimi_k2": f"{K_BEGIN}{K_CALL}functions.f:3{K_ARGS}{args}{K_CALL_END}{K_END}",
                }[name]
        streamer = ToolCallStreamer(parser_for(name))
        parts = [text[i:i + 5] for i in range(0, len(text), 5)]
        deltas = [d for i, p in enumerate(parts) for d in streamer.feed(p, i == len(parts) - 1)[1]]
        assert deltas[0].function.name == "f"
        assert sum(1 for d in deltas if d.function.arguments) > 10
        assert "".join(d.function.arguments or "" for d in deltas) == args
        if name == "kimi_k2":
            assert deltas[0].id == "functions.f:3"
        # The arguments are all sent once their JSON closes, before the end markers come.
        streamer = ToolCallStreamer(parser_for(name))
        _, early = streamer.feed(text[:text.index(args) + len(args)], False)
        assert "".join(d.function.arguments or "" for d in early) == args


MALFORMED = [
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</tool_call>"),  # unclosed
    ("qwen3_coder", "<tool_call>\nnot a function\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=>\n</function>\n</tool_call>"),  # no name
    ("deepseek_v3", f"{DS_BEGIN}{DS_CALL}function{DS_SEP}f\n```json\n{{\"a\": 1\n```{DS_END}"),
    ("deepseek_v3", f"{DS_BEGIN}{DS_CALL}f\n```json\n{{}}\n```{DS_END}{DS_CLOSE}"),  # no sep
    ("deepseek_v31", f"{DS_BEGIN}{DS_CALL}f{DS_SEP}[1, 2]{DS_END}{DS_CLOSE}"),  # not an object
    ("deepseek_v31", f"{DS_BEGIN}{DS_CALL}f{DS_SEP}{{\"a\": 1}}"),  # cut short
    ("deepseek_v31", f"{DS_BEGIN}{DS_CALL}f{DS_SEP}{{\"a\" 1}}{DS_END}{DS_CLOSE}"),  # bad JSON
    ("kimi_k2", f"{K_BEGIN}{K_CALL}functions.f{K_ARGS}{{}}{K_CALL_END}{K_END}"),  # no index
    ("kimi_k2", f"{K_BEGIN}junk{K_END}"),
    ("pythonic", "[f(1, a=2)]"),  # positional
    ("pythonic", "[f(a=__import__('os').getcwd())]"),  # not a literal: never evaluated
    ("pythonic", "[f(a=1, a=2)]"),
    ("pythonic", "[f(a=1), 2]"),
    ("pythonic", "[f(a=1)"),
    ("pythonic", "[f(a={1, 2})]"),  # a set has no JSON form
    ("pythonic", "[f(a=float('nan'))]"),
    ("pythonic", "[f(a=1,,b=2)]"),
]


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_malformed_calls_leave_the_answer_as_content(name, text):
    assert extract_tool_calls(parser_for(name), text) == (text, [])
    content, calls, _ = stream(name, [text[i:i + 3] for i in range(0, len(text), 3)])
    if not calls:  # a stream that has sent no call gives the whole text as content
        assert content == text


@pytest.mark.parametrize("text", ["[1, 2, 3] are numbers", "See [docs](http://x) and [a] (b)",
                                  "   ", "[get weather(x=1)]", "f(a=1)"])
def test_pythonic_text_without_a_call_list_is_content(text):
    assert extract_tool_calls(parser_for("pythonic"), text) == (text, [])
    assert stream("pythonic", list(text))[:2] == (text, [])


def test_special_token_formats_keep_special_tokens():
    flags = {name: TOOL_PARSERS[name].needs_special_tokens for name in NEW}
    assert flags == {"qwen3_coder": False, "deepseek_v3": True, "deepseek_v31": True,
                     "kimi_k2": True, "pythonic": False}


# ~20,000 characters of code in one argument, and long prose: each character is read a few
# times however the answer is cut.
_rng = random.Random(0)
CODE = "".join(_rng.choice([
    "def f(x):\n", '    return {"a": [x, "b\\\\"]}\n', "# é 😀 a < b [i]\n", "s = '</tool'\n",
    "\tif x: y = [1, 2]\n", 'print("<｜tool▁call")\n', "x = '<|tool_call_end'\n"])
    for _ in range(1500))[:20000]
TRIPLE = CODE.replace("\\", "/").replace("'", '"')  # no escape, no quote to end the string
PROSE_20K = ("Here is the plan: < step > [one] {two} 😀.\n" * 500)[:20000]


def long_answers():
    args = {"path": "main.py", "content": CODE}
    js = json.dumps(args)
    return [
        ("qwen3_coder", f"<tool_call>\n<function=write_file>\n<parameter=city>\n{CODE}\n"
                        "</parameter>\n</function>\n</tool_call>", "",
         [("write_file", {"city": CODE})]),
        ("qwen3_coder", PROSE_20K, PROSE_20K, []),
        ("deepseek_v3", f"{DS_BEGIN}{DS_CALL}function{DS_SEP}write_file\n```json\n{js}\n```"
                        f"{DS_END}{DS_CLOSE}", "", [("write_file", args)]),
        ("deepseek_v31", f"{DS_BEGIN}{DS_CALL}write_file{DS_SEP}{js}{DS_END}{DS_CLOSE}", "",
         [("write_file", args)]),
        ("deepseek_v31", PROSE_20K, PROSE_20K, []),
        ("kimi_k2", f"{K_BEGIN}{K_CALL}functions.write_file:0{K_ARGS}{js}{K_CALL_END}{K_END}",
         "", [("write_file", args)]),
        ("kimi_k2", PROSE_20K, PROSE_20K, []),
        ("pythonic", f"[write_file(path='main.py', content={CODE!r})]", "",
         [("write_file", args)]),
        ("pythonic", f"[write_file(path='main.py', content='''{TRIPLE}''')]", "",
         [("write_file", {"path": "main.py", "content": TRIPLE})]),
        ("pythonic", PROSE_20K, PROSE_20K, []),
        ("pythonic", "[" + ", ".join(f"f(i={i})" for i in range(400)) + "]", "",
         [("f", {"i": i}) for i in range(400)]),
    ]


@pytest.mark.parametrize(("name", "text", "content", "calls"), long_answers(),
                         ids=[f"{a[0]}-{i}" for i, a in enumerate(long_answers())])
def test_a_long_stream_reads_each_character_a_few_times(name, text, content, calls):
    rng = random.Random(1)
    parts, i = [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        parts.append(text[i:i + n])
        i += n
    got_content, streamed, work = stream(name, parts)
    assert got_content == content
    assert [(n, json.loads(a)) for _, n, a in streamed] == calls
    assert work <= LINEAR * len(text)
