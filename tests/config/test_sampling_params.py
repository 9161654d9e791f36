"""SamplingParams validation: every bad value raises ValueError naming the field."""

from __future__ import annotations

import pytest

from pagellm import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("max_tokens", 0), ("min_tokens", -1), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("logprobs", 21),
    ("stop", [""]), ("stop_token_ids", [-1]), ("logit_bias", {5: 200.0}),
])
def test_invalid_values_name_the_field(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.stop_strs == [] and p.stop_token_ids == [] and not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="x").stop_strs == ["x"]


def test_clone_revalidates() -> None:
    p = SamplingParams(seed=3, n=2, stop=["a"])
    q = p.clone(n=1, seed=4)
    assert (q.n, q.seed, q.stop_strs) == (1, 4, ["a"])
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=0)


@pytest.mark.parametrize("k", [0, 1, 20])
def test_prompt_logprobs_in_range_are_accepted(k) -> None:
    assert SamplingParams(prompt_logprobs=k).prompt_logprobs == k
    assert SamplingParams(prompt_logprobs=None).prompt_logprobs is None


@pytest.mark.parametrize("k", [-1, 21, 1.5, "2"])
def test_prompt_logprobs_out_of_range_name_the_field(k) -> None:
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=k)
