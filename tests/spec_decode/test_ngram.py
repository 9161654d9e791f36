"""The n-gram proposer against a brute-force reference over random token rows."""

from __future__ import annotations

import random

import pytest

from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode.config import parse_speculative_config
from pagellm.spec_decode.ngram import NgramProposer
from pagellm.worker.input_batch import InputBatch


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first, then its most recent earlier occurrence; what followed it, repeated
    with its period when it runs into the end."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        for end in range(size - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                follow = tokens[end + 1:]
                return [follow[i % len(follow)] for i in range(k)] if k > 0 else []
    return []


def _propose(rows: list[list[int]], min_n: int, max_n: int, k: int,
             max_model_len: int = 128) -> list[list[int]]:
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": k,
                                     "prompt_lookup_min": min_n, "prompt_lookup_max": max_n})
    batch = InputBatch(len(rows), max_model_len, 16, 100, samples=False)
    states = [batch.add_request(f"r{i}", row, [], SamplingParams(), [], 0, None)
              for i, row in enumerate(rows)]
    # Leftovers past a row's end (rejected drafts) must not matter.
    for state in states:
        batch.token_ids[state.row, state.num_tokens:] = 99
    return NgramProposer(spec, max_model_len).propose(batch, states, k)


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 2), (2, 5), (3, 4)])
def test_matches_brute_force(min_n: int, max_n: int) -> None:
    rng = random.Random(min_n * 10 + max_n)
    for trial in range(30):
        vocab = rng.choice([2, 3, 5, 20])
        rows = [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
                for _ in range(rng.randint(1, 8))]
        k = rng.randint(1, 6)
        got = _propose(rows, min_n, max_n, k)
        assert got == [reference(r, min_n, max_n, k) for r in rows], trial


def test_hand_examples() -> None:
    # "1 2 3" occurred before, followed by 4 5: those come first, then (running into the
    # end) the continuation repeats.
    assert _propose([[1, 2, 3, 4, 5, 1, 2, 3]], 1, 3, 4) == [[4, 5, 1, 2]]
    # The longest match wins over a more recent shorter one.
    assert _propose([[7, 8, 9, 1, 6, 9, 2, 7, 8, 9]], 1, 3, 2) == [[1, 6]]
    # Among equally long matches, the most recent.
    assert _propose([[5, 1, 2, 5, 3, 4, 5]], 1, 2, 2) == [[3, 4]]
    # A loop of period 1.
    assert _propose([[3, 3, 3]], 2, 2, 4) == [[3, 3, 3, 3]]
    # No earlier occurrence, or shorter than min_n.
    assert _propose([[1, 2, 3, 4], [1, 2, 9, 2]], 2, 3, 3) == [[], []]
    # Never past max_model_len.
    assert _propose([[1, 2, 1, 2, 1]], 1, 2, 5, max_model_len=7) == [[2, 1]]
