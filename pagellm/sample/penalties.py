"""Repetition, presence and frequency penalties: their per-step tensors and how they apply."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from pagellm.sampling_params import SamplingParams


@dataclass(slots=True)
class PenaltyTensors:
    """Penalty inputs for one step. A tensor is None when no row of the batch needs it.

    ``output_token_counts[i, t]`` counts token t in row i's output; ``prompt_token_mask[i, t]``
    says whether t occurs in row i's prompt (only the repetition penalty looks at the prompt).
    """

    presence_penalties: torch.Tensor | None  # float32 [B]
    frequency_penalties: torch.Tensor | None  # float32 [B]
    repetition_penalties: torch.Tensor | None  # float32 [B]
    output_token_counts: torch.Tensor  # float32 [B, V]
    prompt_token_mask: torch.Tensor | None  # bool [B, V]

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> PenaltyTensors | None:
        """None when every row has neutral penalties (the common case: no work at all)."""
        use_presence = any(p.presence_penalty != 0.0 for p in params)
        use_frequency = any(p.frequency_penalty != 0.0 for p in params)
        use_repetition = any(p.repetition_penalty != 1.0 for p in params)
        if not (use_presence or use_frequency or use_repetition):
            return None

        def row_tensor(values: list[float], used: bool) -> torch.Tensor | None:
            return torch.tensor(values, dtype=torch.float32, device=device) if used else None

        def penalized(p: SamplingParams) -> bool:
            return (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                    or p.repetition_penalty != 1.0)

        # Rows without penalties contribute no ids: their counts stay zero and nothing applies.
        outputs = [ids if penalized(p) else [] for p, ids in zip(params, output_token_ids,
                                                                 strict=True)]
        counts = _token_counts(outputs, vocab_size, device)
        prompt_mask = None
        if use_repetition:
            prompts = [ids if p.repetition_penalty != 1.0 else []
                       for p, ids in zip(params, prompt_token_ids, strict=True)]
            prompt_mask = _token_counts(prompts, vocab_size, device) > 0
        return cls(
            presence_penalties=row_tensor([p.presence_penalty for p in params], use_presence),
            frequency_penalties=row_tensor([p.frequency_penalty for p in params], use_frequency),
            repetition_penalties=row_tensor([p.repetition_penalty for p in params],
                                            use_repetition),
            output_token_counts=counts,
            prompt_token_mask=prompt_mask,
        )


def _token_counts(rows: list[list[int]], vocab_size: int,
                  device: torch.device | str) -> torch.Tensor:
    """float32 [B, V] histogram of each row's token ids (ids outside the vocabulary dropped)."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    if int(lengths.sum()) == 0:
        return counts
    row_idx = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    token_ids = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.long)
    keep = (token_ids >= 0) & (token_ids < vocab_size)
    row_idx, token_ids = row_idx[keep].to(device), token_ids[keep].to(device)
    counts.index_put_((row_idx, token_ids), torch.ones_like(token_ids, dtype=torch.float32),
                      accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> torch.Tensor:
    """Penalize ``logits`` [B, V] in place and return them.

    Repetition (CTRL / HF style): a token seen in the prompt or the output has its logit divided
    by the penalty when positive, multiplied when negative. Then OpenAI's formula over the output:
    ``logit -= frequency * count + presence * (count > 0)``.
    """
    counts = pen.output_token_counts
    if pen.repetition_penalties is not None:
        assert pen.prompt_token_mask is not None
        seen = pen.prompt_token_mask | (counts > 0)
        rep = pen.repetition_penalties.unsqueeze(1)
        # NOTE: rep is 1.0 on rows without the penalty, so applying it batch-wide is a no-op there.
        factor = torch.where(logits > 0, 1.0 / rep, rep)
        logits.mul_(torch.where(seen, factor, 1.0))
    if pen.frequency_penalties is not None:
        logits.sub_(pen.frequency_penalties.unsqueeze(1) * counts)
    if pen.presence_penalties is not None:
        logits.sub_(pen.presence_penalties.unsqueeze(1) * (counts > 0))
    return logits
