"""gated_delta_rule_varlen against transformers' torch gated delta rule, run per sequence with
batch 1 (chunked form for multi-token sequences, recurrent form for one-token ones)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.layers.gated_deltanet_ops import gated_delta_rule_varlen


def _hf():
    """transformers' module, imported when a test runs, not at collection: its kernel lookups
    import triton, which must come after tests/layers/test_triton_*.py set TRITON_INTERPRET."""
    from transformers.models.qwen3_next import modeling_qwen3_next as module

    return module

TOL = dict(atol=1e-5, rtol=1e-5)
HK, DK, DV, SLOTS = 2, 32, 16, 12


def qsl_of(lens: list[int]) -> list[int]:
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return qsl


def make_inputs(n_rows: int, hv: int, seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_rows, HK, DK, generator=gen)
    k = torch.randn(n_rows, HK, DK, generator=gen)
    v = torch.randn(n_rows, hv, DV, generator=gen)
    g = -F.softplus(torch.randn(n_rows, hv, generator=gen))  # log decay <= 0
    beta = torch.rand(n_rows, hv, generator=gen)
    q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))
    return q, k, v, g, beta


def random_states(hv: int, seed: int) -> torch.Tensor:
    return torch.randn(SLOTS, hv, DK, DV, generator=torch.Generator().manual_seed(seed)) * 0.1


def reference(inputs, start, end, init, chunk_size=64):
    """transformers on rows start:end as one batch-1 sequence; (out [L, Hv, Dv], state)."""
    q, k, v, g, beta = (t[None, start:end] for t in inputs)
    if end - start == 1:
        out, state = _hf().torch_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=init, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
    else:
        out, state = _hf().torch_chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size=chunk_size, initial_state=init,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], state[0]


def check_batch(inputs, lens, slots, has_initial, hv, seed=1, chunk_size=64):
    """Run one flat batch; compare every sequence's output and final state with transformers."""
    state = random_states(hv, seed)
    for slot, init in zip(slots, has_initial, strict=True):
        if not init:
            state[slot] = float("nan")  # a fresh sequence must not read its slot
    before = state.clone()
    qsl = qsl_of(lens)
    out = gated_delta_rule_varlen(*inputs, state, qsl, slots, has_initial, chunk_size=chunk_size)
    assert out.shape == inputs[2].shape and out.dtype == inputs[2].dtype
    for i, slot in enumerate(slots):
        init = before[slot][None] if has_initial[i] else None
        ref_out, ref_state = reference(inputs, qsl[i], qsl[i + 1], init, chunk_size)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref_out, **TOL)
        torch.testing.assert_close(state[slot], ref_state, **TOL)
    untouched = [s for s in range(SLOTS) if s not in slots]
    torch.testing.assert_close(state[untouched], before[untouched], equal_nan=True)


@pytest.mark.parametrize("hv", [HK, 2 * HK])
def test_mixed_lengths_in_one_flat_batch(hv: int) -> None:
    lens = [1, 2, 63, 64, 65, 200, 1]
    inputs = make_inputs(sum(lens), hv, seed=0)
    check_batch(inputs, lens, [5, 0, 3, 11, 7, 2, 9], [True, False, True, False, True, True, False],
                hv)


def test_other_chunk_size() -> None:
    lens = [17, 40, 1, 5]
    inputs = make_inputs(sum(lens), 2 * HK, seed=3)
    check_batch(inputs, lens, [4, 1, 8, 6], [True, False, True, True], 2 * HK, chunk_size=16)


@pytest.mark.parametrize("hv", [HK, 2 * HK])
def test_decode_only_batch(hv: int) -> None:
    lens = [1] * 6
    inputs = make_inputs(len(lens), hv, seed=4)
    check_batch(inputs, lens, [5, 0, 3, 10, 1, 7], [True, True, False, True, True, False], hv)


@pytest.mark.parametrize("hv", [HK, 2 * HK])
def test_continuation_across_calls_equals_one_call(hv: int) -> None:
    """Sequences split into 2-3 chunks over several steps give the output of one call."""
    lens = [200, 65, 3]
    splits = [[70, 1, 129], [64, 1], [1, 2]]  # per sequence, the new tokens of each step
    inputs = make_inputs(sum(lens), hv, seed=5)
    slots = [5, 0, 3]
    whole = random_states(hv, 6)
    one_call = gated_delta_rule_varlen(*inputs, whole, qsl_of(lens), slots, [False] * 3)

    state = random_states(hv, 6)
    starts, got = qsl_of(lens)[:-1], torch.empty_like(one_call)
    done = [0, 0, 0]
    for step in range(3):
        seqs = [i for i in range(3) if step < len(splits[i])]
        rows = [torch.arange(starts[i] + done[i], starts[i] + done[i] + splits[i][step])
                for i in seqs]
        idx = torch.cat(rows)
        step_inputs = [t[idx] for t in inputs]
        step_lens = [splits[i][step] for i in seqs]
        out = gated_delta_rule_varlen(*step_inputs, state, qsl_of(step_lens),
                                      [slots[i] for i in seqs], [step > 0] * len(seqs))
        got[idx] = out
        for i in seqs:
            done[i] += splits[i][step]
    torch.testing.assert_close(got, one_call, **TOL)
    torch.testing.assert_close(state[slots], whole[slots], **TOL)


def test_checkpoints_hold_the_state_after_n_tokens() -> None:
    hv = 2 * HK
    lens = [200, 1, 65, 7]
    ckpts = [[(1, 6), (64, 7), (100, 8), (200, 9)], [(1, 10)], [(30, 11)], []]
    slots, has_initial = [5, 0, 3, 4], [True, True, False, True]
    inputs = make_inputs(sum(lens), hv, seed=7)
    state = random_states(hv, 8)
    before = state.clone()
    qsl = qsl_of(lens)
    out = gated_delta_rule_varlen(*inputs, state, qsl, slots, has_initial, checkpoints=ckpts)
    for i, slot in enumerate(slots):
        init = before[slot][None] if has_initial[i] else None
        ref_out, ref_state = reference(inputs, qsl[i], qsl[i + 1], init)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref_out, **TOL)
        torch.testing.assert_close(state[slot], ref_state, **TOL)
        for n, ck_slot in ckpts[i]:
            _, ref_ck = reference(inputs, qsl[i], qsl[i] + n, init)
            torch.testing.assert_close(state[ck_slot], ref_ck, **TOL)


def test_bf16_inputs() -> None:
    hv = 2 * HK
    lens = [1, 90, 1, 33]
    inputs = make_inputs(sum(lens), hv, seed=9, dtype=torch.bfloat16)
    slots, has_initial = [2, 0, 5, 7], [True, False, True, True]
    state = random_states(hv, 10)
    before = state.clone()
    qsl = qsl_of(lens)
    out = gated_delta_rule_varlen(*inputs, state, qsl, slots, has_initial)
    assert out.dtype == torch.bfloat16
    fp32 = [t.float() for t in inputs]
    for i, slot in enumerate(slots):
        init = before[slot][None] if has_initial[i] else None
        ref_out, ref_state = reference(fp32, qsl[i], qsl[i + 1], init)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), ref_out, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(state[slot], ref_state, atol=1e-4, rtol=1e-4)


def test_strided_views_of_one_packed_projection() -> None:
    """q, k, v as the model passes them: reshaped column slices of one [T, q|k|v] tensor."""
    hv, lens = 2 * HK, [1, 70, 1]
    q, k, v, g, beta = make_inputs(sum(lens), hv, seed=11)
    packed = torch.cat([t.reshape(sum(lens), -1) for t in (q, k, v)], dim=-1)
    views = packed.split([HK * DK, HK * DK, hv * DV], dim=-1)
    strided = (views[0].reshape(-1, HK, DK), views[1].reshape(-1, HK, DK),
               views[2].reshape(-1, hv, DV), g, beta)
    assert not strided[0].is_contiguous()
    check_batch(strided, lens, [3, 0, 6], [True, False, True], hv)


def test_rejects_mismatched_batch_description() -> None:
    inputs = make_inputs(5, HK, seed=12)
    with pytest.raises(ValueError):
        gated_delta_rule_varlen(*inputs, random_states(HK, 0), [0, 3, 4], [0, 1], [True, True])
    with pytest.raises(ValueError, match="checkpoint"):
        gated_delta_rule_varlen(*inputs, random_states(HK, 0), [0, 5], [0], [True],
                                checkpoints=[[(0, 1)]])
