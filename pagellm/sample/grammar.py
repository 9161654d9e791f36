"""Structured outputs in the sampler: a step's grammar bitmask on the sampling rows' logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class GrammarMask:
    """``bitmask`` int32 [B, ceil(V / 32)] on the logits' device, one row per sampling row (rows
    not in ``rows`` are left alone); ``rows``: the constrained sampling rows."""

    bitmask: torch.Tensor
    rows: list[int]


def grammar_rows(grammar_bitmask: Any, sample_states: Sequence[Any],
                 device: torch.device) -> GrammarMask | None:
    """The step's GrammarBitmask (rows by request id) laid out by sampling row: one host->device
    copy, and the rows of unconstrained requests all ones."""
    position = {s.req_id: j for j, s in enumerate(sample_states)}
    pairs = [(position[r], i) for i, r in enumerate(grammar_bitmask.req_ids) if r in position]
    if not pairs:
        return None
    host = torch.from_numpy(grammar_bitmask.bitmask)
    rows = [j for j, _ in pairs]
    if rows != list(range(len(sample_states))) or len(pairs) != host.shape[0]:
        full = torch.full((len(sample_states), host.shape[1]), -1, dtype=torch.int32)
        full[rows] = host[[i for _, i in pairs]]
        host = full
    return GrammarMask(host.to(device, non_blocking=True), rows)


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """Set the logits of tokens the grammar does not allow to -inf, in place (xgrammar's CPU
    kernel on CPU tensors, its CUDA/Triton kernel on GPU ones)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, mask.bitmask, vocab_size=logits.shape[-1],
                                    indices=mask.rows)
