"""Reasoning parsers on realistic answers (Qwen3, DeepSeek-R1), whole and streamed, and with a
tool call after the thinking (Qwen3 with the hermes parser)."""

from __future__ import annotations

import json
import random

import pytest

from pagellm.entrypoints.openai.chat_output import ChoiceDeltas, read_message
from pagellm.entrypoints.openai.reasoning_parsers import (
    ReasoningStreamer,
    extract_reasoning,
    get_reasoning_parser,
)
from pagellm.entrypoints.openai.tool_parsers import get_tool_parser

THOUGHT = "\nThe user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.\n"
# (parser, answer, reasoning_content, content)
CASES = [
    ("qwen3", f"<think>{THOUGHT}</think>\n\n17 * 23 = 391.", THOUGHT, "\n\n17 * 23 = 391."),
    ("qwen3", "17 * 23 = 391.", None, "17 * 23 = 391."),  # enable_thinking off: no block
    ("qwen3", "<think>\n\n</think>\n\nHi!", "\n\n", "\n\nHi!"),  # an empty block
    ("qwen3", f"<think>{THOUGHT}", THOUGHT, None),  # cut short while thinking
    ("deepseek_r1", f"{THOUGHT}</think>\n\n391", THOUGHT, "\n\n391"),  # R1: no <think>
    ("deepseek_r1", f"<think>{THOUGHT}</think>391", THOUGHT, "391"),  # R1-0528
    ("deepseek_r1", f"{THOUGHT}", THOUGHT, None),  # cut short while thinking
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_answer(name, text, reasoning, content):
    assert extract_reasoning(get_reasoning_parser(name), text) == (reasoning, content)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_streamed_answer_joins_up(name, text, reasoning, content, seed):
    rng = random.Random(seed)
    streamer = ReasoningStreamer(get_reasoning_parser(name))
    got_reasoning = got_content = ""
    i = 0
    while i < len(text):
        n = rng.randint(1, 5)
        r, c = streamer.feed(text[i:i + n], final=i + n >= len(text))
        assert "<think>" not in r + c and "</think>" not in r + c
        got_reasoning += r
        got_content += c
        i += n
    assert got_reasoning == (reasoning or "") and got_content == (content or "")


def test_reasoning_then_a_tool_call():
    """Qwen3 thinks, then calls a tool: reasoning, no content, one call."""
    args = {"city": "Paris"}
    text = (f"<think>{THOUGHT}</think>\n\n<tool_call>\n"
            f'{{"name": "get_weather", "arguments": {json.dumps(args)}}}\n</tool_call>')
    hermes, qwen3 = get_tool_parser("hermes"), get_reasoning_parser("qwen3")
    message, finish = read_message(text, "stop", hermes, None, qwen3)
    assert message.reasoning_content == THOUGHT and message.content == "\n\n"
    assert finish == "tool_calls"
    assert json.loads(message.tool_calls[0].function.arguments) == args

    deltas = ChoiceDeltas(hermes, None, qwen3)
    reasoning, content, arguments, finish = "", "", "", None
    for i in range(0, len(text), 3):
        delta, finish = deltas.feed(text[i:i + 3], "stop" if i + 3 >= len(text) else None)
        if delta is None:
            continue
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            arguments += call.function.arguments or ""
    assert reasoning == THOUGHT and content == "\n\n" and json.loads(arguments) == args
    assert finish == "tool_calls"
