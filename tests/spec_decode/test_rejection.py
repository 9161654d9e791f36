"""The rejection sampler alone: emitted tokens follow the target's processed distribution
(statistically, seeded), greedy rows take the argmax, seeded requests reproduce."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.sample.metadata import SamplingMetadata
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode.rejection import rejection_sample

VOCAB = 8


def expected_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Independent reference of the sampler's order: temperature, min-p, top-k, top-p."""
    z = logits.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if p.min_p > 0:
        probs[probs < p.min_p * probs.max()] = 0
    order = np.argsort(-probs, kind="stable")
    if p.top_k > 0:
        probs[order[p.top_k:]] = 0
    probs /= probs.sum()
    if p.top_p < 1:
        kept, mass = [], 0.0
        for t in order:
            if mass >= p.top_p or probs[t] == 0:
                break
            kept.append(t)
            mass += probs[t]
        mask = np.zeros_like(probs, dtype=bool)
        mask[kept] = True
        probs[~mask] = 0
    return probs / probs.sum()


def _sample(row_logits: torch.Tensor, drafts: list[int], params: SamplingParams, copies: int,
            generator: torch.Generator) -> np.ndarray:
    """``copies`` identical requests with the same logits rows and drafts, in one call."""
    logits = row_logits.repeat(copies, 1)
    rows = len(drafts) + 1
    meta = SamplingMetadata.assemble(
        params=[params] * (rows * copies), num_output_tokens=[0] * (rows * copies),
        generators=[None] * (rows * copies), eos_token_ids=[None] * (rows * copies),
        vocab_size=VOCAB, device="cpu", penalties=None, logit_bias=None)
    out = rejection_sample(logits, [drafts] * copies, meta, [None] * copies, generator)
    return out.numpy()


def _tv(samples: np.ndarray, probs: np.ndarray) -> float:
    freq = np.bincount(samples, minlength=VOCAB) / len(samples)
    return 0.5 * float(np.abs(freq - probs).sum())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05),
], ids=["plain", "top_k", "top_p", "all"])
def test_emitted_tokens_follow_the_target_distribution(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(1234)
    row_logits = torch.randn(3, VOCAB, generator=gen) * 1.5
    p = [expected_probs(row_logits[j].numpy(), params) for j in range(3)]
    # Draft 1: a likely token; draft 2: the least likely token still allowed (often rejected).
    x1 = int(np.argsort(-p[0])[1])
    allowed = np.nonzero(p[1])[0]
    x2 = int(allowed[np.argmin(p[1][allowed])])
    copies = 40_000
    out = _sample(row_logits, [x1, x2], params, copies, gen)
    assert (out[:, 0] >= 0).all()
    # Position 0: every request emits a token distributed as p_0.
    assert _tv(out[:, 0], p[0]) < 0.02
    # Position 1: given draft 1 was emitted (accepted), the next token is distributed as p_1.
    first_accepted = out[:, 0] == x1
    assert first_accepted.sum() > 0.1 * copies
    assert (out[~first_accepted, 1] == -1).all()  # a rejection ends the run
    assert _tv(out[first_accepted, 1], p[1]) < 0.03
    # Position 2 (the bonus token) after both drafts: distributed as p_2.
    both = first_accepted & (out[:, 1] == x2)
    if both.sum() > 2000:
        assert _tv(out[both, 2], p[2]) < 0.05
    # A filtered-out token is never emitted.
    for j in range(2):
        assert not np.isin(out[:, j][out[:, j] >= 0], np.nonzero(p[j] == 0)[0]).any()


def test_a_draft_the_filters_remove_is_always_rejected() -> None:
    gen = torch.Generator().manual_seed(7)
    row_logits = torch.randn(2, VOCAB, generator=gen)
    params = SamplingParams(temperature=1.0, top_k=2)
    p0 = expected_probs(row_logits[0].numpy(), params)
    x = int(np.argmin(p0))
    out = _sample(row_logits, [x], params, 5000, gen)
    assert (out[:, 0] != x).all() and (out[:, 1] == -1).all()
    assert _tv(out[:, 0], p0) < 0.03


def test_greedy_accepts_while_drafts_equal_the_argmax() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, VOCAB, generator=gen)
    argmax = logits.argmax(dim=-1).tolist()
    # Request 0: 3 drafts, the first two right. Request 1: 2 drafts, both right (bonus).
    # Request 2: 1 draft, wrong.
    drafts = [[argmax[0], argmax[1], (argmax[2] + 1) % VOCAB], [argmax[4], argmax[5]],
              [(argmax[7] + 1) % VOCAB]]
    greedy = SamplingParams(temperature=0.0)
    meta = SamplingMetadata.assemble(
        params=[greedy] * 9, num_output_tokens=[0] * 9, generators=[None] * 9,
        eos_token_ids=[None] * 9, vocab_size=VOCAB, device="cpu", penalties=None,
        logit_bias=None)
    out = rejection_sample(logits.clone(), drafts, meta, [None] * 3).tolist()
    assert out[0] == [argmax[0], argmax[1], argmax[2], -1]
    assert out[1] == [argmax[4], argmax[5], argmax[6], -1]
    assert out[2] == [argmax[7], -1, -1, -1]


def test_mixed_greedy_and_random_rows_and_seeded_reproducibility() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(5, VOCAB, generator=gen)
    greedy, random_p = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)
    params = [greedy] * 2 + [random_p] * 3
    drafts = [[int(logits[0].argmax())], [1, 2]]

    def run(seed_state: int) -> list[list[int]]:
        meta = SamplingMetadata.assemble(
            params=params, num_output_tokens=[0] * 5, generators=[None] * 5,
            eos_token_ids=[None] * 5, vocab_size=VOCAB, device="cpu", penalties=None,
            logit_bias=None)
        seeded = torch.Generator().manual_seed(seed_state)
        other = torch.Generator().manual_seed(seed_state + 1000)  # the engine's noise
        return rejection_sample(logits.clone(), drafts, meta, [None, seeded], other).tolist()

    first = run(42)
    assert first[0][:2] == [int(logits[0].argmax()), int(logits[1].argmax())]
    assert first == run(42)
    # The seeded request's tokens depend on its own generator only.
    runs = {tuple(run(s)[1]) for s in range(40)}
    assert len(runs) > 1
