"""Rejection sampling of draft tokens: the emitted tokens follow the target's distribution exactly.

A verifying request with drafts x_1..x_d has d + 1 logits rows: row j (0-based) is the target's
distribution p_j after the request's known tokens and x_1..x_j; x_{j+1} is checked against it.
Drafts are deterministic (an n-gram match, a draft model's argmax), i.e. drawn from a one-hot q:

- greedy rows accept x_{j+1} while it equals argmax p_j; at the first mismatch the argmax is
  emitted instead, and after d accepts the argmax of the last row (the bonus token);
- random rows accept x_{j+1} with probability min(1, p_j(x)/q(x)) = p_j(x); on rejection they
  draw from the residual max(0, p_j - q), i.e. p_j without x, renormalized; after d accepts they
  draw the bonus token from p_d. The emitted token at each position is then distributed as p_j
  (Leviathan et al. 2023), so the output is distributed as without speculation.

p_j is the sampler's own processed distribution (temperature, min-p, top-k / top-p: see
``sample.sampler.sampling_probs``). Seeded requests draw their uniforms and noise from their
own generator, so a rerun gives the same tokens.
"""

from __future__ import annotations

import torch

from pagellm.sample.argmax import argmax_rows
from pagellm.sample.filters import exponential_sample
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import sampling_probs


def draft_layout(num_drafts: list[int], device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(req_of_row, pos_of_row)`` for rows laid out request after request, d + 1 each."""
    counts = torch.tensor([d + 1 for d in num_drafts], dtype=torch.long)
    req_of_row = torch.repeat_interleave(torch.arange(len(num_drafts)), counts)
    starts = torch.cumsum(counts, 0) - counts
    pos_of_row = torch.arange(int(counts.sum())) - starts[req_of_row]
    return req_of_row.to(device), pos_of_row.to(device)


def rejection_sample(logits: torch.Tensor, draft_token_ids: list[list[int]],
                     meta: SamplingMetadata, generators: list[torch.Generator | None],
                     default_generator: torch.Generator | None = None) -> torch.Tensor:
    """The tokens each request emits: int64 ``[N, K + 1]`` (K = the most drafts of any request),
    request n's accepted drafts then one target token, -1 after them.

    ``logits`` [R, V] holds request after request its ``len(drafts) + 1`` rows (R in all);
    ``meta`` has one row per logits row (the request's parameters repeated; no penalties, bias
    or min_tokens masking: requests needing those get no drafts); ``generators[n]``: request
    n's own (seeded requests, already seeded for this step) or None (``default_generator``).
    ``logits`` (float32) are modified in place."""
    device = logits.device
    num_drafts = [len(d) for d in draft_token_ids]
    num_reqs, width = len(num_drafts), max(num_drafts) + 1
    req_of_row, pos_of_row = draft_layout(num_drafts, device)
    # Each row's draft (the token its logits check); -1 on a request's last row (the bonus).
    padded = torch.full((num_reqs, width), -1, dtype=torch.long)
    for n, drafts in enumerate(draft_token_ids):
        padded[n, :len(drafts)] = torch.tensor(drafts, dtype=torch.long)
    padded = padded.to(device)
    row_draft = padded[req_of_row, pos_of_row]

    assert meta.penalties is None and meta.logit_bias is None and meta.min_tokens_mask is None
    assert meta.grammar_bitmask is None
    target = argmax_rows(logits) if not meta.all_random else None
    if meta.all_greedy:
        assert target is not None
        accepted = row_draft == target
        emitted_at_row = target
    else:
        probs = sampling_probs(logits, meta)
        is_draft = row_draft >= 0
        draft_col = row_draft.clamp(min=0).unsqueeze(1)
        p_draft = probs.gather(1, draft_col).squeeze(1)
        uniform = _uniform(num_drafts, generators, default_generator, device)
        # The residual distribution: p without the rejected draft (the bonus row keeps all).
        probs.scatter_(1, draft_col, torch.where(is_draft, 0.0, p_draft).unsqueeze(1))
        # A draft holding all the mass (up to rounding) has no residual to draw from: keep it.
        accepted = ((uniform < p_draft) | (probs.sum(dim=1) <= 0)) & is_draft
        row_generators = {r: generators[n] for r, n in enumerate(req_of_row.tolist())
                          if generators[n] is not None}
        recovered = exponential_sample(probs, row_generators, default_generator)
        if target is None:
            emitted_at_row = recovered
        else:
            greedy_row = meta.temperature == 0
            accepted = torch.where(greedy_row, row_draft == target, accepted)
            emitted_at_row = torch.where(greedy_row, target, recovered)
    accepted &= row_draft >= 0
    # Scatter rows into [N, K + 1]; padding counts as rejected, so every request stops by its
    # last row at the latest.
    acc = torch.zeros((num_reqs, width), dtype=torch.bool, device=device)
    acc[req_of_row, pos_of_row] = accepted
    final = torch.full((num_reqs, width), -1, dtype=torch.long, device=device)
    final[req_of_row, pos_of_row] = emitted_at_row
    num_accepted = (~acc).int().argmax(dim=1)  # the first rejected position
    cols = torch.arange(width, device=device).unsqueeze(0)
    stop = num_accepted.unsqueeze(1)
    out = torch.where(cols < stop, padded, -1)
    return torch.where(cols == stop, final, out)


def _uniform(num_drafts: list[int], generators: list[torch.Generator | None],
             default_generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """U[0, 1) per row; the rows of a seeded request from its own generator."""
    uniform = torch.rand(sum(num_drafts) + len(num_drafts), device=device,
                         generator=default_generator)
    start = 0
    for d, gen in zip(num_drafts, generators, strict=True):
        if gen is not None:
            uniform[start:start + d + 1] = torch.rand(d + 1, device=device, generator=gen)
        start += d + 1
    return uniform
