"""Stop conditions end to end on the default model (greedy, so every run is reproducible)."""

from __future__ import annotations

import pytest

from pagellm import SamplingParams

PROMPT = "Once upon a time, in a small village,"


@pytest.fixture(scope="module")
def reference(default_llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return default_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def test_max_tokens_and_ignore_eos(default_llm, reference) -> None:
    assert len(reference.token_ids) == 40
    assert reference.finish_reason == "length"
    short = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7,
                                                        ignore_eos=True), use_tqdm=False)[0]
    assert short.outputs[0].token_ids == reference.token_ids[:7]


def test_stop_string_truncates_text(default_llm, reference) -> None:
    text = reference.text
    stop = text[len(text) // 2: len(text) // 2 + 4]
    assert stop.strip(), text
    cut = text.index(stop)
    out = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                               use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=stop,
                                                       include_stop_str_in_output=True),
                                use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:cut + len(stop)]


def test_stop_token_ids(default_llm, reference) -> None:
    stop_id = reference.token_ids[5]
    first = reference.token_ids.index(stop_id)
    out = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40,
                                                      stop_token_ids=[stop_id]),
                               use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_and_min_tokens(default_llm) -> None:
    msgs = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    natural = default_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64),
                               use_tqdm=False)[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.stop_reason is None
    n = len(natural.token_ids)
    eos = default_llm.get_tokenizer().eos_token_id
    assert natural.token_ids[-1] == eos  # like vLLM: EOS is in token_ids, not in the text
    forced = default_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64,
                                                   min_tokens=n + 5),
                              use_tqdm=False)[0].outputs[0]
    assert len(forced.token_ids) >= n + 5
    assert eos not in forced.token_ids[: n + 5]
