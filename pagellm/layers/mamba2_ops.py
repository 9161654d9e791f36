"""Mamba-2 selective scan (SSD) over pagellm's flat, unpadded batch.

Decode tokens (sequences with one new token) take the recurrent form, batched over all of them;
prefill chunks take the chunked SSD form, with every sequence cut into its own chunks so no chunk
mixes two sequences. The math is float32 like transformers' torch path; dt's bias and softplus
too (transformers does them in dt's dtype; the mamba_ssm kernels in float32). The dt_limit clamp
applies to both forms (transformers clamps in the chunked one only) so decode and prefill agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

Checkpoints = Sequence[Sequence[tuple[int, int]] | None] | None


def _as_list(v: Sequence | torch.Tensor) -> list:
    return v.tolist() if isinstance(v, torch.Tensor) else list(v)


def _decay_matrix(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: exp(sum(a[j+1..i])) for j <= i, else 0.

    Cumsum of masked copies instead of differences of one cumsum (transformers' segment_sum):
    stable for long chunks. In place after the cumsum: these are the largest tensors here."""
    n = a.size(-1)
    strict = torch.tril(torch.ones(n, n, device=a.device, dtype=torch.bool), diagonal=-1)
    out = torch.cumsum(a[..., None].expand(*a.shape, n).masked_fill(~strict, 0), dim=-2)
    upper = torch.triu(torch.ones(n, n, device=a.device, dtype=torch.bool), diagonal=1)
    return out.masked_fill_(upper, -torch.inf).exp_()


def _prep_dt(dt, dt_bias, dt_softplus, dt_limit) -> torch.Tensor:
    dt = dt.float() + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit[0] > 0.0 or dt_limit[1] < float("inf"):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _initial_states(ssm_state, slots, init, device) -> torch.Tensor:
    """Copies of the slots' states, zero where the sequence starts fresh."""
    idx = torch.tensor(slots, device=device)
    h = ssm_state.index_select(0, idx).float()
    if not all(init):
        fresh = torch.tensor([not b for b in init], device=device)
        h.masked_fill_(fresh[:, None, None, None], 0.0)
    return h


def _decode(x, dt, A, B, C, D, h) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step for b sequences: x [b,H,P], dt [b,H], B/C [b,G,N], h [b,H,P,N] (a
    copy, updated in place: the state is the big tensor here, so two passes over it)."""
    b, nh, p = x.shape
    g, n = B.shape[1], B.shape[2]
    x = x.float()
    h.mul_(torch.exp(dt * A)[..., None, None])
    dtx = (x * dt[..., None]).view(b, g, nh // g, p, 1)
    hg = h.view(b, g, nh // g, p, n)
    hg.addcmul_(dtx, B.float()[:, :, None, None, :])
    y = torch.einsum("bgjpn,bgn->bgjp", hg, C.float())
    return y.reshape(b, nh, p) + x * D.float()[:, None], h


def _chunk_layout(starts, lens, cs):
    """Chunks of all prefill sequences, ordered chunk-index-major over sequences sorted by
    chunk count, so the chunks at step c of the inter-chunk recurrence are one contiguous range
    and belong to the first k_c sorted sequences."""
    nchunks = [-(-n // cs) for n in lens]
    order = sorted(range(len(lens)), key=lambda j: -nchunks[j])
    steps, chunk_of, base, ends = [], {}, [], []
    for c in range(nchunks[order[0]]):
        k = sum(1 for j in order if nchunks[j] > c)
        steps.append((len(base), k))
        for j in order[:k]:
            chunk_of[(j, c)] = len(base)
            base.append(starts[j] + c * cs)
            ends.append(starts[j] + lens[j])
    rows = torch.tensor(base)[:, None] + torch.arange(cs)
    return order, steps, chunk_of, rows, rows < torch.tensor(ends)[:, None]


def _prefill(x, dt, A, B, C, D, h0, starts, lens, cs):
    """Chunked SSD for the prefill sequences. Returns (rows, y rows, final states in sorted
    order, order, a function giving the state after the first n tokens of sequence j)."""
    dev, nh, p = x.device, x.shape[1], x.shape[2]
    g, n = B.shape[1], B.shape[2]
    hpg = nh // g
    order, steps, chunk_of, rows, valid = _chunk_layout(starts, lens, cs)
    nc = rows.shape[0]
    flat = rows.clamp(max=x.shape[0] - 1).view(-1).to(dev)
    valid_d = valid.to(dev)
    # Padding positions get dt = 0: no decay and no input, so they leave the state untouched.
    dtc = dt.index_select(0, flat).view(nc, cs, nh).masked_fill(~valid_d[..., None], 0.0)
    xc = x.index_select(0, flat).float().view(nc, cs, nh, p)
    Bc = B.index_select(0, flat).float().view(nc, cs, g, n)
    Cc = C.index_select(0, flat).float().view(nc, cs, g, n)
    xdt = xc * dtc[..., None]
    Adt = (dtc * A).transpose(1, 2)  # [nc, H, cs]
    Acs = torch.cumsum(Adt, dim=-1)
    # intra-chunk (diagonal blocks)
    M = _decay_matrix(Adt).view(nc, g, hpg, cs, cs)
    M.mul_(torch.einsum("klgn,ksgn->kgls", Cc, Bc)[:, :, None])
    M = M.view(nc, nh, cs, cs)
    y = torch.einsum("khls,kshp->klhp", M, xdt)
    # each chunk's own contribution to the state at its end
    decay = torch.exp(Acs[..., -1:] - Acs).transpose(1, 2)  # [nc, cs, H]
    wx = (xdt * decay[..., None]).view(nc, cs, g, hpg, p)
    chunk_states = torch.einsum("klgn,klgjp->kgjpn", Bc, wx).reshape(nc, nh, p, n)
    # inter-chunk recurrence, batched over sequences
    chunk_decay = torch.exp(Acs[..., -1])  # [nc, H]
    start = torch.empty_like(chunk_states)
    run = h0.index_select(0, torch.tensor(order, device=dev))
    for off, k in steps:
        start[off:off + k] = run[:k]
        run[:k] = run[:k] * chunk_decay[off:off + k, :, None, None] + chunk_states[off:off + k]
    # state -> output per chunk (off-diagonal blocks)
    y_off = torch.einsum("klgn,kgjpn->klgjp", Cc, start.view(nc, g, hpg, p, n))
    y = y + y_off.reshape(nc, cs, nh, p) * torch.exp(Acs).transpose(1, 2)[..., None]
    y = y + xc * D.float()[:, None]
    pos = valid.view(-1).nonzero().squeeze(1)
    out_rows = rows.view(-1)[pos].to(dev)
    y = y.reshape(nc * cs, nh, p).index_select(0, pos.to(dev))
    sorted_pos = {j: r for r, j in enumerate(order)}

    def state_after(j: int, m: int) -> torch.Tensor:
        if m == lens[j]:
            return run[sorted_pos[j]]
        k = chunk_of[(j, m // cs)]
        r = m % cs
        if r == 0:
            return start[k]
        w = torch.exp(Acs[k, :, r - 1:r] - Acs[k, :, :r]).t()  # [r, H]
        part = torch.einsum("lgn,lgjp->gjpn", Bc[k, :r], (xdt[k, :r] * w[..., None])
                            .view(r, g, hpg, p)).reshape(nh, p, n)
        return start[k] * torch.exp(Acs[k, :, r - 1])[:, None, None] + part

    return out_rows, y, run, order, state_after


def ssd_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
               qsl: Sequence[int], state_slots: Sequence[int] | torch.Tensor,
               has_initial: Sequence[bool] | torch.Tensor, chunk_size: int,
               dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, float("inf")),
               checkpoints: Checkpoints = None) -> torch.Tensor:
    """Mamba-2 scan of a flat batch: x [T,H,P], dt [T,H], A [H] (= -exp(A_log)), B/C [T,G,N],
    D/dt_bias [H]. Sequence i is rows qsl[i]:qsl[i+1] with state slot state_slots[i]; its slot
    is updated in place to the state after its last token. checkpoints[i]: (n, slot) pairs that
    also get the state after the sequence's first n new tokens. Returns y [T,H,P] in x's dtype."""
    qsl, slots = _as_list(qsl), _as_list(state_slots)
    init = [bool(b) for b in _as_list(has_initial)]
    dev = x.device
    dt = _prep_dt(dt, dt_bias, dt_softplus, dt_limit)
    A = A.float()
    out = torch.empty(x.shape, dtype=x.dtype, device=dev)
    lens = [qsl[i + 1] - qsl[i] for i in range(len(slots))]
    cks = [list(checkpoints[i] or ()) if checkpoints else [] for i in range(len(lens))]
    for i, pairs in enumerate(cks):
        if any(not 0 < m <= lens[i] for m, _ in pairs):
            raise ValueError(f"checkpoints {pairs} outside sequence {i}'s {lens[i]} tokens")
    dec = [i for i, m in enumerate(lens) if m == 1]
    pre = [i for i, m in enumerate(lens) if m > 1]
    dst: list[int] = []  # slots to write, in the order of the rows of `states`
    states: list[torch.Tensor] = []
    if dec:
        h0 = _initial_states(ssm_state, [slots[i] for i in dec], [init[i] for i in dec], dev)
        if len(dec) == x.shape[0]:
            y, h = _decode(x, dt, A, B, C, D, h0)
            out.copy_(y)
        else:
            r = torch.tensor([qsl[i] for i in dec], device=dev)
            y, h = _decode(x[r], dt[r], A, B[r], C[r], D, h0)
            out.index_copy_(0, r, y.to(x.dtype))
        ck = [(r, s) for r, i in enumerate(dec) for _, s in cks[i]]  # n can only be 1
        dst += [slots[i] for i in dec] + [s for _, s in ck]
        states.append(h)
        if ck:
            states.append(h.index_select(0, torch.tensor([r for r, _ in ck], device=dev)))
    if pre:
        h0 = _initial_states(ssm_state, [slots[i] for i in pre], [init[i] for i in pre], dev)
        rows, y, h, order, state_after = _prefill(
            x, dt, A, B, C, D, h0, [qsl[i] for i in pre], [lens[i] for i in pre], chunk_size)
        out.index_copy_(0, rows, y.to(x.dtype))
        dst += [slots[pre[j]] for j in order]
        states.append(h)
        for j, i in enumerate(pre):
            for m, s in cks[i]:
                dst.append(s)
                states.append(state_after(j, m)[None])
    # All reads happened above (index_select copies), so writes cannot clobber an input state.
    if dst:
        ssm_state.index_copy_(0, torch.tensor(dst, device=dev),
                              torch.cat(states).to(ssm_state.dtype))
    return out
