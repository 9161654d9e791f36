"""Repetition / presence / frequency penalties vs a hand-written float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.penalties import PenaltyTensors, apply_penalties
from pagellm.sample.sampler import Sampler
from pagellm.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def ref_penalize(logits: np.ndarray, prompt: list[int], output: list[int],
                 p: SamplingParams) -> np.ndarray:
    """One row, token by token, straight from the definitions."""
    out = logits.astype(np.float64).copy()
    for tok in range(len(out)):
        if p.repetition_penalty != 1.0 and (tok in prompt or tok in output):
            if out[tok] > 0:
                out[tok] /= p.repetition_penalty
            else:
                out[tok] *= p.repetition_penalty
        count = output.count(tok)
        out[tok] -= p.frequency_penalty * count
        if count > 0:
            out[tok] -= p.presence_penalty
    return out


def _random_case(rng: np.random.Generator, rows: int, vocab: int):
    params, prompts, outputs = [], [], []
    for i in range(rows):
        kind = i % 5
        params.append(SamplingParams(
            temperature=0.0,
            repetition_penalty=[1.0, 1.3, 0.7, 2.0, 1.1][kind],
            presence_penalty=[0.0, 0.5, -0.4, 0.0, 1.5][kind] if i % 7 else 0.0,
            frequency_penalty=[0.0, 0.0, 0.3, -1.0, 2.0][kind] if i % 3 else 0.0,
        ))
        prompts.append(rng.integers(0, vocab, size=rng.integers(0, 12)).tolist())
        # Repeats on purpose so counts > 1 occur.
        out = rng.integers(0, vocab // 3, size=rng.integers(0, 15)).tolist()
        outputs.append(out)
    return params, prompts, outputs


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_reference(device: str) -> None:
    rng = np.random.default_rng(0)
    rows, vocab = 25, 60
    params, prompts, outputs = _random_case(rng, rows, vocab)
    logits = rng.normal(size=(rows, vocab)) * 3
    pen = PenaltyTensors.build(params, prompts, outputs, vocab, device)
    assert pen is not None
    got = apply_penalties(torch.tensor(logits, dtype=torch.float32, device=device), pen)
    for r in range(rows):
        want = ref_penalize(logits[r], prompts[r], outputs[r], params[r])
        np.testing.assert_allclose(got[r].cpu().numpy(), want, rtol=1e-5, atol=1e-5,
                                   err_msg=f"row {r}: {params[r]}")


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_with_penalties_picks_the_reference_argmax(device: str) -> None:
    rng = np.random.default_rng(1)
    rows, vocab = 200, 30
    params, prompts, outputs = _random_case(rng, rows, vocab)
    logits = rng.normal(size=(rows, vocab))
    # Make the penalized tokens the favourites so penalties flip many argmaxes.
    for r in range(rows):
        for tok in outputs[r]:
            logits[r, tok] += 1.5
    meta = SamplingMetadata.build(params, prompts, outputs, [None] * rows, [None] * rows, vocab,
                                  device)
    tokens = Sampler()(torch.tensor(logits, dtype=torch.float32, device=device),
                       meta).sampled_token_ids.tolist()
    want = [int(np.argmax(ref_penalize(logits[r], prompts[r], outputs[r], params[r])))
            for r in range(rows)]
    assert tokens == want
    flipped = sum(int(np.argmax(logits[r])) != want[r] for r in range(rows))
    assert flipped > 20  # the penalties did change decisions


def test_neutral_penalties_build_nothing() -> None:
    params = [SamplingParams(), SamplingParams(temperature=0.0)]
    assert PenaltyTensors.build(params, [[1, 2], [3]], [[4], [5, 5]], 10, "cpu") is None
    pen = PenaltyTensors.build([SamplingParams(presence_penalty=0.5)], [[1]], [[2, 2]], 10,
                               "cpu")
    assert pen is not None
    # Only what some row uses is built: no prompt mask without a repetition penalty.
    assert pen.prompt_token_mask is None and pen.repetition_penalties is None
    assert pen.frequency_penalties is None
    assert pen.output_token_counts[0].tolist() == [0, 0, 2, 0, 0, 0, 0, 0, 0, 0]


def test_rows_without_penalties_are_untouched() -> None:
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0)]
    logits = torch.randn(2, 20)
    pen = PenaltyTensors.build(params, [[1, 2, 3]] * 2, [[4, 4, 5]] * 2, 20, "cpu")
    assert pen is not None
    got = apply_penalties(logits.clone(), pen)
    assert torch.equal(got[0], logits[0])
    assert not torch.equal(got[1], logits[1])
