"""Logprobs: raw log_softmax values, top-K columns, ranks and Logprobs records."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.sample.metadata import SamplingMetadata, make_generator
from pagellm.sample.sampler import Sampler, logprobs_record
from pagellm.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def ref_log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_with_ranks(device: str) -> None:
    torch.manual_seed(0)
    vocab = 80
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=10, logprobs=5, repetition_penalty=1.8),
        SamplingParams(temperature=0.0, logprobs=2, logit_bias={7: 100.0}),
        SamplingParams(temperature=2.0, top_p=0.9, logprobs=1, seed=3),
    ]
    n = len(params)
    logits = torch.randn(n, vocab) * 2
    gens = [make_generator(p.seed, device) if p.seed is not None else None for p in params]
    meta = SamplingMetadata.build(params, [[1, 2, 3]] * n, [[4, 5]] * n, gens, [None] * n,
                                  vocab, device)
    assert meta.max_num_logprobs == 5
    out = Sampler()(logits.clone().to(device), meta)
    assert out.logprobs is not None and out.logprobs_token_ids is not None
    assert out.sampled_token_ranks is not None
    assert out.logprobs.shape == (n, 6) and out.logprobs_token_ids.shape == (n, 6)

    ref = ref_log_softmax(logits.numpy())
    sampled = out.sampled_token_ids.cpu().tolist()
    ids = out.logprobs_token_ids.cpu().numpy()
    lps = out.logprobs.cpu().numpy()
    ranks = out.sampled_token_ranks.cpu().tolist()
    assert sampled[4] == 7  # the bias decided the token, but its logprob stays the raw one
    for r in range(n):
        assert ids[r, 0] == sampled[r]
        np.testing.assert_allclose(lps[r, 0], ref[r, sampled[r]], atol=1e-5)
        assert ranks[r] == 1 + int((ref[r] > ref[r, sampled[r]]).sum())
        order = np.argsort(-ref[r])[:5]
        assert ids[r, 1:].tolist() == order.tolist()
        np.testing.assert_allclose(lps[r, 1:], ref[r, order], atol=1e-5)
    assert ranks[0] == 1  # greedy on raw logits is the most likely token

    records = out.logprobs_records(meta.num_logprobs)
    assert records[2] is None
    for r, p in enumerate(params):
        if p.logprobs is None:
            continue
        rec = records[r]
        assert rec is not None and rec == logprobs_record(out, r, p.logprobs)
        assert rec.sampled_token_id == sampled[r] and rec.sampled_rank == ranks[r]
        assert len(rec.top_token_ids) == len(rec.top_logprobs) == p.logprobs
        assert rec.top_token_ids == np.argsort(-ref[r])[:p.logprobs].tolist()
        assert rec.sampled_logprob == pytest.approx(ref[r, sampled[r]], abs=1e-5)


def test_no_logprobs_requested_returns_none() -> None:
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    meta = SamplingMetadata.build(params, [[]] * 2, [[]] * 2, [None] * 2, [None] * 2, 10, "cpu")
    assert meta.max_num_logprobs is None
    out = Sampler()(torch.randn(2, 10), meta)
    assert out.logprobs is None and out.sampled_token_ranks is None
    assert out.logprobs_records(meta.num_logprobs) == [None, None]
