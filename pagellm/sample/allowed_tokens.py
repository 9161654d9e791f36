"""allowed_token_ids (vLLM's): only these token ids may be sampled on a row.

The mask is a bool [B, V] tensor (True: masked) built with one scatter from the rows' id
tensors, which are made once per request; a batch where no row restricts builds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def allowed_ids_tensor(ids: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """A request's allowed ids as a device tensor (made once, when it joins the batch)."""
    return torch.tensor(sorted(set(ids)), dtype=torch.long, device=device)


def allowed_tokens_mask(allowed: Sequence[torch.Tensor | None], vocab_size: int,
                        device: torch.device | str) -> torch.Tensor | None:
    """True where a row may not sample; rows whose entry is None are unrestricted. None when
    no row restricts."""
    restricted = [(i, ids) for i, ids in enumerate(allowed) if ids is not None]
    if not restricted:
        return None
    mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool, device=device)
    rows = torch.tensor([i for i, _ in restricted], dtype=torch.long, device=device)
    mask[rows] = True
    lengths = torch.tensor([len(ids) for _, ids in restricted], device=device)
    mask[rows.repeat_interleave(lengths), torch.cat([ids for _, ids in restricted])] = False
    return mask
