"""Hypothesis over SamplingParams: any values of the field types (extremes, NaN, infinities,
huge integers, empty strings) either construct valid params or raise ValueError naming the
field, never another exception; and what constructs satisfies every documented bound."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.sampling_params import SamplingParams

INTS = st.integers(-2**70, 2**70) | st.integers(-3, 30)
FLOATS = st.floats() | st.floats(-3, 3) | st.integers(-3, 3)
FIELDS = {
    "n": INTS, "temperature": FLOATS, "top_p": FLOATS, "top_k": INTS, "min_p": FLOATS,
    "seed": st.none() | INTS, "max_tokens": st.none() | INTS, "min_tokens": INTS,
    "stop": st.none() | st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3),
    "stop_token_ids": st.none() | st.lists(INTS, max_size=3), "ignore_eos": st.booleans(),
    "presence_penalty": FLOATS, "frequency_penalty": FLOATS, "repetition_penalty": FLOATS,
    "logprobs": st.none() | INTS, "prompt_logprobs": st.none() | INTS,
    "logit_bias": st.none() | st.dictionaries(INTS, FLOATS, max_size=3),
}
KWARGS = st.fixed_dictionaries({}, optional=FIELDS)


@settings(max_examples=400, derandomize=True, deadline=None, database=None)
@given(kwargs=KWARGS)
def test_constructs_or_value_error(kwargs):
    try:
        p = SamplingParams(**kwargs)
    except ValueError as e:
        field = str(e).split()[0].removeprefix("SamplingParams.")
        assert field in FIELDS, e
        return
    assert p.n >= 1 and 0 < p.top_p <= 1 and 0 <= p.min_p <= 1 and p.temperature >= 0
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        assert math.isfinite(getattr(p, name)), name
    assert p.seed is None or -2**63 <= p.seed < 2**63
    assert p.max_tokens is None or p.max_tokens >= max(1, p.min_tokens)
    assert p.logprobs is None or 0 <= p.logprobs <= 20
    assert p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= 20
    assert all(isinstance(s, str) and s for s in p.stop_strs)
    assert all(t >= 0 for t in p.stop_token_ids)
    assert all(k >= 0 and -100 <= v <= 100 for k, v in (p.logit_bias or {}).items())


@pytest.mark.parametrize("kwargs", [{"temperature": math.nan}, {"top_p": math.nan},
                                    {"repetition_penalty": math.inf}, {"seed": 2**63},
                                    {"seed": -2**63 - 1}, {"min_p": -math.inf}])
def test_non_finite_and_out_of_range(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
