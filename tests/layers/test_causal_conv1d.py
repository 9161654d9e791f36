"""causal_conv1d_varlen against transformers' torch causal conv, run per sequence with batch 1
(``causal_conv1d_fn`` for sequences with no history, ``causal_conv1d_update`` otherwise)."""

from __future__ import annotations

import pytest
import torch

from pagellm.layers.causal_conv1d import causal_conv1d_varlen


def _hf():
    """transformers' module, imported when a test runs, not at collection: its kernel lookups
    import triton, which must come after tests/layers/test_triton_*.py set TRITON_INTERPRET."""
    from transformers.models.qwen3_next import modeling_qwen3_next as module

    return module

TOL = dict(atol=1e-5, rtol=1e-5)
C, K, SLOTS = 24, 4, 12


def qsl_of(lens: list[int]) -> list[int]:
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return qsl


def make_inputs(n_rows: int, seed: int, dtype: torch.dtype = torch.float32, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, C, generator=gen).to(dtype)
    weight = (torch.randn(C, K, generator=gen) * 0.5).to(dtype)
    b = torch.randn(C, generator=gen).to(dtype) if bias else None
    state = torch.randn(SLOTS, C, K - 1, generator=gen).to(dtype)
    return x, weight, b, state


def reference(x, weight, bias, init):
    """transformers on one sequence x [L, C]: (y [L, C], state after it [C, K-1])."""
    xs = x.t()[None]
    if init is None:
        y = _hf().causal_conv1d_fn(xs, weight, bias, activation="silu")
        state = torch.cat([x.new_zeros(C, K - 1), x.t()], dim=-1)[:, -(K - 1):]
    else:
        state = init.clone()[None]
        y = _hf().causal_conv1d_update(xs, state, weight, bias, activation="silu")
        state = state[0]
    return y[0].t(), state


def check_batch(lens, slots, has_initial, seed=0, bias=True, checkpoints=None):
    x, weight, b, state = make_inputs(sum(lens), seed, bias=bias)
    for slot, init in zip(slots, has_initial, strict=True):
        if not init:
            state[slot] = float("nan")  # a fresh sequence must not read its slot
    before = state.clone()
    qsl = qsl_of(lens)
    y = causal_conv1d_varlen(x, weight, b, state, qsl, slots, has_initial, checkpoints=checkpoints)
    assert y.shape == x.shape and y.dtype == x.dtype
    for i, slot in enumerate(slots):
        init = before[slot] if has_initial[i] else None
        xi = x[qsl[i]:qsl[i + 1]]
        ref_y, ref_state = reference(xi, weight, b, init)
        torch.testing.assert_close(y[qsl[i]:qsl[i + 1]], ref_y, **TOL)
        torch.testing.assert_close(state[slot], ref_state, **TOL)
        for n, ck_slot in (checkpoints or [[]] * len(lens))[i]:
            torch.testing.assert_close(state[ck_slot], reference(xi[:n], weight, b, init)[1], **TOL)
    used = set(slots) | {s for cks in checkpoints or () for _, s in cks}
    untouched = [s for s in range(SLOTS) if s not in used]
    torch.testing.assert_close(state[untouched], before[untouched], equal_nan=True)


@pytest.mark.parametrize("bias", [True, False])
def test_mixed_lengths_in_one_flat_batch(bias: bool) -> None:
    check_batch([1, 2, 63, 64, 65, 200, 1], [5, 0, 3, 11, 7, 2, 9],
                [True, False, True, False, True, True, False], bias=bias)


def test_decode_only_batch() -> None:
    check_batch([1] * 6, [5, 0, 3, 10, 1, 7], [True, True, False, True, True, False])


def test_checkpoints_hold_the_state_after_n_tokens() -> None:
    ckpts = [[(1, 6), (2, 7), (100, 8), (200, 9)], [(1, 10)], [(65, 11)]]
    check_batch([200, 1, 65], [5, 0, 3], [True, True, False], checkpoints=ckpts)


def test_decode_checkpoint_is_the_final_state() -> None:
    check_batch([1, 1, 1], [5, 0, 3], [True, False, True], checkpoints=[[(1, 8)], [], [(1, 11)]])


def test_continuation_across_calls_equals_one_call() -> None:
    lens = [200, 65, 3]
    splits = [[70, 1, 129], [64, 1], [1, 2]]
    x, weight, b, state = make_inputs(sum(lens), seed=3)
    slots = [5, 0, 3]
    whole = state.clone()
    one_call = causal_conv1d_varlen(x, weight, b, whole, qsl_of(lens), slots, [False] * 3)
    starts, got, done = qsl_of(lens)[:-1], torch.empty_like(one_call), [0, 0, 0]
    for step in range(3):
        seqs = [i for i in range(3) if step < len(splits[i])]
        idx = torch.cat([torch.arange(starts[i] + done[i], starts[i] + done[i] + splits[i][step])
                         for i in seqs])
        got[idx] = causal_conv1d_varlen(x[idx], weight, b, state,
                                        qsl_of([splits[i][step] for i in seqs]),
                                        [slots[i] for i in seqs], [step > 0] * len(seqs))
        for i in seqs:
            done[i] += splits[i][step]
    torch.testing.assert_close(got, one_call, **TOL)
    torch.testing.assert_close(state[slots], whole[slots], **TOL)


@pytest.mark.parametrize("lens", [[1, 90, 1, 2], [1, 1, 1, 1]])
def test_bf16_inputs(lens: list[int]) -> None:
    x, weight, b, state = make_inputs(sum(lens), seed=4, dtype=torch.bfloat16)
    slots, has_initial = [2, 0, 5, 7], [True, False, True, True]
    before, qsl = state.clone(), qsl_of(lens)
    y = causal_conv1d_varlen(x, weight, b, state, qsl, slots, has_initial)
    assert y.dtype == torch.bfloat16
    w32, b32 = weight.float(), b.float()
    for i, slot in enumerate(slots):
        init = before[slot].float() if has_initial[i] else None
        ref_y, ref_state = reference(x[qsl[i]:qsl[i + 1]].float(), w32, b32, init)
        torch.testing.assert_close(y[qsl[i]:qsl[i + 1]].float(), ref_y, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(state[slot].float(), ref_state)  # the inputs, copied exactly


def test_rejects_a_checkpoint_past_the_sequence() -> None:
    x, weight, b, state = make_inputs(5, seed=5)
    with pytest.raises(ValueError, match="checkpoint"):
        causal_conv1d_varlen(x, weight, b, state, [0, 5], [0], [False], checkpoints=[[(6, 1)]])


@pytest.mark.parametrize("lens", [[1, 70, 1], [1, 1]])
def test_strided_input_columns(lens: list[int]) -> None:
    """x as a column slice of a wider tensor (the model convs part of a packed projection)."""
    x, weight, b, state = make_inputs(sum(lens), seed=6)
    wide = torch.cat([x, torch.randn(sum(lens), 5)], dim=-1)[:, :C]
    assert not wide.is_contiguous()
    slots, has_initial, qsl = [3, 0, 6][:len(lens)], [True, False, True][:len(lens)], qsl_of(lens)
    ref_state = state.clone()
    expect = causal_conv1d_varlen(x, weight, b, ref_state, qsl, slots, has_initial)
    got = causal_conv1d_varlen(wide, weight, b, state, qsl, slots, has_initial)
    torch.testing.assert_close(got, expect, atol=0, rtol=0)
    torch.testing.assert_close(state, ref_state, atol=0, rtol=0)
