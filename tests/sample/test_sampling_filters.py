"""min-p / top-k / top-p filters and sampled frequencies vs an independent float64 numpy
reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagellm.sample.filters import apply_min_p, apply_top_k_top_p
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import Sampler
from pagellm.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def ref_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
              min_p: float) -> tuple[np.ndarray, float]:
    """Sampling distribution after temperature, min-p, top-k, top-p (float64), and the smallest
    distance of any token to a min-p / top-p decision boundary (to skip ambiguous rows)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones(len(z), dtype=bool)
    margin = math.inf
    if min_p > 0:
        ratio = p / p.max()
        keep &= ratio >= min_p
        margin = min(margin, float(np.abs(ratio - min_p).min()))
    if 0 < top_k < keep.sum():
        kth = np.sort(z[keep])[::-1][top_k - 1]
        keep &= z >= kth
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        mass_before = np.cumsum(q[order]) - q[order]
        survivors = np.zeros(len(z), dtype=bool)
        survivors[order[mass_before < top_p]] = True
        keep &= survivors
        margin = min(margin, float(np.abs(mass_before[q[order] > 0] - top_p).min()))
    out = np.where(keep, p, 0.0)
    return out / out.sum(), margin


def _chi2_threshold(df: int, z: float = 4.5) -> float:
    # Wilson-Hilferty approximation of the chi-square quantile at a standard-normal z.
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray, n: int) -> tuple[float, int]:
    support = probs > 0
    expected = probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


@pytest.mark.parametrize("device", DEVICES)
def test_filter_support_matches_reference(device: str) -> None:
    rng = np.random.default_rng(0)
    vocab = 40
    checked = 0
    for trial in range(300):
        rows = 8
        logits = rng.normal(size=(rows, vocab)) * rng.uniform(0.5, 4.0)
        temps = rng.uniform(0.3, 2.0, size=rows)
        top_k = rng.choice([0, 1, 3, 10, 39, 40, 100], size=rows)
        top_p = rng.choice([1.0, 0.95, 0.7, 0.3, 0.05], size=rows)
        min_p = rng.choice([0.0, 0.0, 0.02, 0.2, 0.6], size=rows)
        if trial % 3 == 0:
            top_p[:] = 1.0  # exercise the top-k-only (partial topk) path
        x = torch.tensor(logits, dtype=torch.float32, device=device)
        x = x / torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1)
        x = apply_min_p(x, torch.tensor(min_p, dtype=torch.float32, device=device))
        k_tensor = torch.tensor([vocab if k <= 0 or k >= vocab else k for k in top_k],
                                device=device)
        limited = [int(k) for k in k_tensor.tolist() if k < vocab]
        p_tensor = torch.tensor(top_p, dtype=torch.float32, device=device)
        x = apply_top_k_top_p(x, k_tensor if limited else None,
                              p_tensor if (top_p < 1).any() else None,
                              max(limited) if limited else 0)
        kept = torch.isfinite(x).cpu().numpy()
        for r in range(rows):
            probs, margin = ref_probs(logits[r], temps[r], int(top_k[r]), float(top_p[r]),
                                      float(min_p[r]))
            if margin < 1e-4:
                continue  # float32 vs float64 may legitimately disagree at a boundary
            checked += 1
            np.testing.assert_array_equal(kept[r], probs > 0, err_msg=f"trial {trial} row {r}")
    assert checked > 2000


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.0, top_k=5),
    dict(temperature=0.8, top_p=0.7),
    dict(temperature=1.3, min_p=0.1),
    dict(temperature=0.9, top_k=8, top_p=0.8, min_p=0.05),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampled_frequencies_match_reference(case: dict, device: str) -> None:
    torch.manual_seed(1)
    vocab, n = 16, 20_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    params = SamplingParams(**case)
    meta = SamplingMetadata.build([params] * n, [[]] * n, [[]] * n, [None] * n, [None] * n,
                                  vocab, device)
    batch = logits.to(device).unsqueeze(0).repeat(n, 1)
    tokens = Sampler()(batch, meta).sampled_token_ids.cpu().numpy()
    counts = np.bincount(tokens, minlength=vocab).astype(np.float64)

    probs, _ = ref_probs(logits.numpy(), params.temperature, params.top_k, params.top_p,
                         params.min_p)
    assert counts[probs == 0].sum() == 0, "sampled a token the filters remove"
    stat, df = _chi2(counts, probs, n)
    assert stat < _chi2_threshold(df), (stat, df)

    # The test has power: the plain softmax (no temperature / filters) is rejected.
    if params.temperature != 1.0 or params.top_k or params.top_p < 1 or params.min_p:
        plain, _ = ref_probs(logits.numpy(), 1.0, 0, 1.0, 0.0)
        wrong, _ = _chi2(counts, plain, n)
        assert wrong > _chi2_threshold(df) * 3


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_rows_follow_their_own_parameters(device: str) -> None:
    torch.manual_seed(2)
    vocab, reps = 12, 6000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3),
             SamplingParams(temperature=0.7, top_p=0.6)]
    params = kinds * reps
    n = len(params)
    meta = SamplingMetadata.build(params, [[]] * n, [[]] * n, [None] * n, [None] * n, vocab,
                                  device)
    tokens = Sampler()(logits.to(device).repeat(n, 1), meta).sampled_token_ids.cpu().numpy()
    per_kind = tokens.reshape(reps, len(kinds))
    assert (per_kind[:, 0] == int(logits.argmax())).all()
    for col, p in enumerate(kinds[1:], start=1):
        probs, _ = ref_probs(logits.numpy(), p.temperature, p.top_k, p.top_p, p.min_p)
        counts = np.bincount(per_kind[:, col], minlength=vocab).astype(np.float64)
        assert counts[probs == 0].sum() == 0
        stat, df = _chi2(counts, probs, reps)
        assert stat < _chi2_threshold(df), (p, stat, df)
