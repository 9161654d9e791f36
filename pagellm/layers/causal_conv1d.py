"""Depthwise causal conv1d over pagellm's flat, unpadded batch, with per-sequence state slots.

Gated DeltaNet (Qwen3-Next / Qwen3.5) and Mamba-2 run a short causal conv (kernel K, one filter
per channel) before their recurrence. The engine keeps, per sequence, the last K-1 inputs in
``conv_state[slot]`` so that the next prefill chunk or decode token continues where the last
one stopped. The math is that of transformers' torch ``causal_conv1d_fn`` (zero history) and
``causal_conv1d_update`` (history from the state), accumulated in float32 as the CUDA kernels
do. Nothing here is specific to Gated DeltaNet: the channel count C is free.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# Per sequence, (n, slot) pairs: also save the conv state after the first n new tokens in slot.
Checkpoints = Sequence[Sequence[tuple[int, int]]]


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y, inplace=True)  # y is always a fresh tensor here
    raise ValueError(f"unsupported conv activation {activation!r}")


def query_lens(qsl: Sequence[int], n_rows: int, n_slots: int, n_init: int) -> list[int]:
    """Per-sequence new-token counts, checking the batch description once in Python."""
    lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
    if qsl[0] != 0 or qsl[-1] != n_rows:
        raise ValueError(f"query_start_loc must run from 0 to {n_rows}, got {qsl[0]}..{qsl[-1]}")
    if any(n < 1 for n in lens):
        raise ValueError("every sequence needs at least one new token")
    if not len(lens) == n_slots == n_init:
        raise ValueError("qsl, state_slots and has_initial describe different batch sizes")
    return lens


def flat_checkpoints(
    checkpoints: Checkpoints | None, lens: list[int]
) -> list[tuple[int, int, int]]:
    """(sequence, n, slot) for every checkpoint, each n checked against its sequence's length."""
    if checkpoints is None:
        return []
    if len(checkpoints) != len(lens):
        raise ValueError("checkpoints needs one (possibly empty) list per sequence")
    out = []
    for i, cks in enumerate(checkpoints):
        for n, slot in cks:
            if not 1 <= n <= lens[i]:
                raise ValueError(f"checkpoint after {n} tokens of a {lens[i]}-token sequence")
            out.append((i, n, slot))
    return out


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    qsl: Sequence[int],
    state_slots: Sequence[int],
    has_initial: Sequence[bool],
    activation: str | None = "silu",
    checkpoints: Checkpoints | None = None,
) -> torch.Tensor:
    """Causal depthwise conv of every sequence's new rows of ``x`` [T, C], then ``activation``.

    weight [C, K], bias [C] or None. ``conv_state`` [S, C, K-1] holds each slot's last K-1
    inputs; sequence i reads ``conv_state[state_slots[i]]`` when ``has_initial[i]`` (zeros
    otherwise, whatever the slot holds) and leaves there the state after its last new token.
    ``checkpoints[i]`` lists (n, slot): the state after the first n new tokens also goes to
    ``conv_state[slot]`` (slots that no sequence of the batch reads). Returns [T, C] in x's dtype.
    """
    n_rows, channels = x.shape
    width = weight.shape[-1]
    pad = width - 1
    if weight.shape[0] != channels or tuple(conv_state.shape[1:]) != (channels, pad):
        raise ValueError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and conv_state "
            f"{tuple(conv_state.shape)} disagree"
        )
    lens = query_lens(qsl, n_rows, len(state_slots), len(has_initial))
    batch = len(lens)
    if batch == 0:
        return x.new_empty((0, channels))
    dev = x.device
    slots = torch.tensor(list(state_slots), dtype=torch.long, device=dev)
    fresh = torch.tensor([not h for h in has_initial], dtype=torch.bool, device=dev)
    # [B, C, K-1] in float32; fresh sequences start from zeros even if their slot holds NaNs.
    # (Advanced indexing rather than index_select: the same on CUDA, much faster on CPU.)
    prev = conv_state[slots].float().masked_fill_(fresh[:, None, None], 0.0)
    w = weight.float()
    b = bias.float() if bias is not None else None
    cks = flat_checkpoints(checkpoints, lens)

    if n_rows == batch:
        # Decode: every sequence has one new token, so its window is [state, token] of width K.
        window = torch.cat([prev, x.float().unsqueeze(-1)], dim=-1)  # [B, C, K]
        y = (window * w).sum(-1)
        if b is not None:
            y = y + b
        new_state = window[:, :, 1:]
        if cks:  # n can only be 1 here: the checkpoint is the final state
            rows = torch.tensor([i for i, _, _ in cks], dtype=torch.long, device=dev)
            ck_slots = torch.tensor([s for _, _, s in cks], dtype=torch.long, device=dev)
            conv_state.index_copy_(0, ck_slots, new_state[rows].to(conv_state))
        conv_state.index_copy_(0, slots, new_state.to(conv_state))
        return _activate(y, activation).to(x.dtype)

    # General case, no loop over sequences: lay the rows out as [prev_0, x_0, prev_1, x_1, ...]
    # so that every token's K-wide window is contiguous, conv the whole buffer with K shifted
    # slices and keep the outputs whose window ends on a real token. Indices are built on the
    # host and sent over once (no device syncs).
    seq_of_row = torch.repeat_interleave(torch.arange(batch), torch.tensor(lens))
    row_pos = torch.arange(n_rows) + pad * (seq_of_row + 1)
    first_pos = torch.tensor(qsl[:-1], dtype=torch.long) + pad * torch.arange(1, batch + 1)
    hist = torch.arange(pad)
    prev_pos = ((first_pos - pad)[:, None] + hist).reshape(-1)
    # States after n new tokens: the K-1 buffer rows ending just before first_pos + n.
    seq_idx = torch.tensor([i for i, _, _ in cks] + list(range(batch)), dtype=torch.long)
    counts = torch.tensor([n for _, n, _ in cks] + lens, dtype=torch.long)
    state_rows = (first_pos[seq_idx] + counts - pad)[:, None] + hist  # [M, K-1]
    dst = torch.tensor([s for _, _, s in cks] + list(state_slots), dtype=torch.long)
    row_pos, prev_pos, state_rows, dst = (t.to(dev) for t in (row_pos, prev_pos, state_rows, dst))

    buf = torch.empty((n_rows + batch * pad, channels), dtype=torch.float32, device=dev)
    buf.index_copy_(0, row_pos, x.float())
    buf.index_copy_(0, prev_pos, prev.transpose(1, 2).reshape(-1, channels))
    n_out = buf.shape[0] - pad
    z = buf[0:n_out] * w[:, 0]
    for j in range(1, width):
        z.addcmul_(buf[j : j + n_out], w[:, j])
    if b is not None:
        z.add_(b)
    y = z[row_pos - pad]  # output p is the window ending at buffer row p + pad
    del z
    conv_state.index_copy_(0, dst, buf[state_rows].transpose(1, 2).to(conv_state))
    return _activate(y, activation).to(x.dtype)
