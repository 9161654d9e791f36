"""Gated delta rule (Gated DeltaNet linear attention) over pagellm's flat, unpadded batch.

Per value head the recurrent state S [Dk, Dv] evolves, for each token, as
    S <- exp(g) * S;  S <- S + k (beta * (v - k^T S))^T;  o = q^T S
with q, k L2-normalized and q scaled by Dk**-0.5, all in float32: transformers'
``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule`` with
``use_qk_l2norm_in_kernel=True``. Decode tokens (sequences with one new token) take the
recurrent form, batched over the whole step. Prefill chunks take the chunked UT-transform form:
every sequence is cut into chunk_size-token chunks (padded with zero tokens, which leave the
state unchanged), the intra-chunk part runs for all chunks of all sequences at once, and the scan
over chunks is batched across sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagellm.layers.causal_conv1d import Checkpoints, flat_checkpoints, query_lens

# (q, k, v, g, beta) in float32, q/k normalized, scaled and repeated to the v heads.
Inputs = tuple[torch.Tensor, ...]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As transformers' (and FLA's) l2norm: eps inside the square root."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long, device=device)


def _initial_states(ssm_state: torch.Tensor, slots: Sequence[int], fresh: Sequence[bool],
                    device: torch.device) -> torch.Tensor:
    """A float32 copy of the slots' states, zero for sequences that start fresh (even on NaN).

    Advanced indexing rather than index_select: the same on CUDA, several times faster on CPU.
    """
    state = ssm_state[_long(slots, device)].float()
    return state.masked_fill_(torch.tensor(fresh, device=device)[:, None, None, None], 0.0)


def _decode(tensors: Inputs, rows: list[int], ssm_state: torch.Tensor, slots: list[int],
            fresh: list[bool], cks: list[tuple[int, int]], out: torch.Tensor) -> None:
    """One recurrent step for every one-token sequence at once (gather, update, scatter).

    ``cks`` holds (position in ``rows``, slot) pairs: a one-token sequence's checkpoint is its
    final state.
    With d = exp(g): S' = d S + k delta^T, delta = beta (v - d k^T S), o = q^T S'
    = d q^T S + (q . k) delta, so both reads of S are one matmul on the gathered old state.
    """
    dev = out.device
    rows_t = _long(rows, dev)
    q, k, v, g, beta = (t[rows_t] for t in tensors)
    state = _initial_states(ssm_state, slots, fresh, dev)  # [B, Hv, Dk, Dv]
    b, hv, dk, dv = state.shape
    decay = g.exp().unsqueeze(-1)  # [B, Hv, 1]
    reads = (torch.stack([q, k], dim=2) @ state) * decay.unsqueeze(-1)  # [B, Hv, 2, Dv]
    delta = (v - reads[:, :, 1]) * beta.unsqueeze(-1)
    out.index_copy_(0, rows_t, reads[:, :, 0] + (q * k).sum(-1, keepdim=True) * delta)
    state.mul_(decay.unsqueeze(-1))
    state.view(b * hv, dk, dv).baddbmm_(k.reshape(b * hv, dk, 1), delta.reshape(b * hv, 1, dv))
    if cks:
        idx = _long([r for r, _ in cks], dev)
        ssm_state.index_copy_(0, _long([s for _, s in cks], dev), state[idx].to(ssm_state))
    ssm_state.index_copy_(0, _long(slots, dev), state.to(ssm_state))


def _layout(seqs: list[int], lens: list[int], cks: list[tuple[int, int, int]], chunk: int):
    """Where each prefill token goes in the chunked buffer, and the scan's schedule.

    Checkpoint points split a sequence into segments, each padded to whole chunks (zero tokens:
    no decay, no update), so that a checkpoint's state is the state after some chunk. Sequences
    are ranked by chunk count, longest first, and chunks are stored step-major: the chunks the
    scan handles at step j are the j-th chunks of ranks 0..active[j]-1, one contiguous block.
    """
    n_chunks, local, ck_chunk = {}, {}, {}
    for i in seqs:
        pos, start, c0 = [], 0, 0
        for cut in sorted({n for j, n, _ in cks if j == i and n < lens[i]}) + [lens[i]]:
            pos.append(torch.arange(cut - start) + c0 * chunk)
            c0 += -(-(cut - start) // chunk)
            ck_chunk[(i, cut)] = c0 - 1  # the state after `cut` tokens: after chunk c0-1
            start = cut
        n_chunks[i], local[i] = c0, torch.cat(pos)
    order = sorted(seqs, key=lambda i: -n_chunks[i])
    rank = {i: r for r, i in enumerate(order)}
    active = [sum(n_chunks[i] > j for i in order) for j in range(n_chunks[order[0]])]
    offset = [0]
    for n in active:
        offset.append(offset[-1] + n)
    offs = torch.tensor(offset)
    dst = torch.cat([(offs[local[i] // chunk] + rank[i]) * chunk + local[i] % chunk
                     for i in seqs])  # flat token order
    pad_rows = torch.ones(offset[-1] * chunk, dtype=torch.bool)
    pad_rows[dst] = False
    pad_rows = pad_rows.nonzero().squeeze(1)  # built on the host: no device sync
    ck_at: dict[int, list[tuple[int, int]]] = {}
    for i, n, slot in cks:
        ck_at.setdefault(ck_chunk[(i, n)], []).append((rank[i], slot))
    return order, active, offset, dst, pad_rows, ck_at


def _prefill(tensors: Inputs, seqs: list[int], qsl: Sequence[int], lens: list[int],
             cks: list[tuple[int, int, int]], chunk: int, ssm_state: torch.Tensor,
             slots: list[int], fresh: list[bool], out: torch.Tensor) -> None:
    """Chunked (UT-transform) form for the multi-token sequences ``seqs``, all at once."""
    dev = out.device
    order, active, offset, dst, pad_rows, ck_at = _layout(seqs, lens, cks, chunk)
    total = offset[-1]
    dst, pad_rows = dst.to(dev), pad_rows.to(dev)
    src = None
    if len(dst) < out.shape[0]:  # some rows are decode tokens: pick the prefill ones
        src = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in seqs]).to(dev)

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [N, H, chunk, ...]
        buf = t.new_empty((total * chunk,) + t.shape[1:])
        buf.index_copy_(0, dst, t if src is None else t[src])
        buf.index_fill_(0, pad_rows, 0.0)
        return buf.view(total, chunk, *t.shape[1:]).transpose(1, 2).contiguous()

    q, k, v, g, beta = (chunked(t) for t in tensors)
    g = g.cumsum(-1)  # log decay from the chunk start, [N, Hv, chunk]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    kt = k.transpose(-1, -2)
    ut_system = (k_beta @ kt) * decay
    attn = (q @ kt) * decay
    # (I + strict_lower(ut_system))^-1 once, then matmuls: much faster than a solve with the
    # Dk + Dv right-hand sides (batched triangular solves of 64x64 systems are slow).
    eye = torch.eye(chunk, dtype=q.dtype, device=dev).expand_as(ut_system)
    inv = torch.linalg.solve_triangular(ut_system, eye, upper=False, unitriangular=True)
    new_v = inv @ (v * beta.unsqueeze(-1))
    k_cumdecay = inv @ (k_beta * g.exp().unsqueeze(-1))
    q = q * g.exp().unsqueeze(-1)
    k_tail = (k * (g[..., -1:] - g).exp().unsqueeze(-1)).transpose(-1, -2)
    chunk_decay = g[..., -1].exp()[..., None, None]
    del decay, ut_system, inv, kt, k_beta, eye

    pos = {i: p for p, i in enumerate(seqs)}
    sorted_slots = [slots[pos[i]] for i in order]
    state = _initial_states(ssm_state, sorted_slots, [fresh[pos[i]] for i in order], dev)
    o = torch.empty_like(new_v)
    for j, n_act in enumerate(active):
        c = slice(offset[j], offset[j] + n_act)
        s = state[:n_act]
        v_new = new_v[c] - k_cumdecay[c] @ s
        o[c] = q[c] @ s + attn[c] @ v_new
        s.mul_(chunk_decay[c]).add_(k_tail[c] @ v_new)
        if j in ck_at:
            ranks = _long([r for r, _ in ck_at[j]], dev)
            ck_slots = _long([slot for _, slot in ck_at[j]], dev)
            ssm_state.index_copy_(0, ck_slots, state[ranks].to(ssm_state))
    ssm_state.index_copy_(0, _long(sorted_slots, dev), state.to(ssm_state))
    o = o.transpose(1, 2).reshape(total * chunk, o.shape[1], o.shape[-1])[dst]
    if src is None:
        out.copy_(o)
    else:
        out.index_copy_(0, src, o)


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    qsl: Sequence[int],
    state_slots: Sequence[int],
    has_initial: Sequence[bool],
    chunk_size: int = 64,
    checkpoints: Checkpoints | None = None,
) -> torch.Tensor:
    """Gated delta rule for every sequence of the flat batch; returns [T, Hv, Dv] in v's dtype.

    q, k [T, Hk, Dk]; v [T, Hv, Dv] with each q/k head serving Hv/Hk consecutive v heads;
    g [T, Hv] log decay (<= 0); beta [T, Hv]. ``ssm_state`` [S, Hv, Dk, Dv] (float32): sequence i
    starts from ``ssm_state[state_slots[i]]`` when ``has_initial[i]`` (else zeros) and leaves
    there its state after its last new token. ``checkpoints[i]`` lists (n, slot): the state after
    the first n new tokens also goes to ``ssm_state[slot]`` (a slot no sequence of the batch uses).
    """
    n_rows, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != n_rows or hv % hk:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if g.shape != (n_rows, hv) or beta.shape != (n_rows, hv):
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [T, {hv}]")
    if tuple(ssm_state.shape[1:]) != (hv, dk, dv):
        raise ValueError(f"ssm_state {tuple(ssm_state.shape)} is not [S, {hv}, {dk}, {dv}]")
    lens = query_lens(qsl, n_rows, len(state_slots), len(has_initial))
    cks = flat_checkpoints(checkpoints, lens)
    out = torch.empty((n_rows, hv, dv), dtype=torch.float32, device=v.device)
    if not lens:
        return out.to(v.dtype)

    q = _l2norm(q.float()) * dk**-0.5
    k = _l2norm(k.float())
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=1)
        k = k.repeat_interleave(hv // hk, dim=1)
    tensors = (q, k, v.float(), g.float(), beta.float())

    decode = [i for i, n in enumerate(lens) if n == 1]
    if decode:
        pos = {i: r for r, i in enumerate(decode)}
        _decode(tensors, [qsl[i] for i in decode], ssm_state,
                [state_slots[i] for i in decode], [not has_initial[i] for i in decode],
                [(pos[i], s) for i, _, s in cks if i in pos], out)
    prefill = [i for i, n in enumerate(lens) if n > 1]
    if prefill:
        _prefill(tensors, prefill, qsl, lens, [c for c in cks if lens[c[0]] > 1], chunk_size,
                 ssm_state, [state_slots[i] for i in prefill],
                 [not has_initial[i] for i in prefill], out)
    return out.to(v.dtype)
