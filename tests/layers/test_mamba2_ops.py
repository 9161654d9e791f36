"""ssd_varlen and Mamba2Mixer over a flat batch against transformers' torch Mamba-2 path, run
one sequence at a time with batch 1 (float32, seeded). Small chunk_size so multi-chunk runs."""

from __future__ import annotations

import pytest
import torch

from pagellm.layers.mamba2_ops import ssd_varlen


def _hf():
    """transformers' module, imported when a test runs, not at collection: its kernel lookups
    import triton, which must come after tests/layers/test_triton_*.py set TRITON_INTERPRET."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as module

    return module

H, P, N, CS, S = 4, 8, 16, 16, 24
LENS = [1, 2, CS - 1, CS, CS + 1, 200, 1, 3]
SLOTS = [7, 2, 19, 0, 5, 11, 3, 14]  # not contiguous, not sorted
INIT = [False, True, True, False, True, True, True, False]
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)  # states and passengers use the global generator


def _qsl(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _inputs(t: int, g: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(t, H, P), dt=r(t, H), A=-torch.rand(H, generator=gen) * 2 - 0.2,
                B=r(t, g, N), C=r(t, g, N), D=r(H), dt_bias=r(H) * 0.5)


TOKEN_KEYS = ("x", "dt", "B", "C")


def _take(inp, a: int, b: int) -> dict[str, torch.Tensor]:
    return {k: v[a:b] if k in TOKEN_KEYS else v for k, v in inp.items()}


def _cat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([p[k] for p in parts]) if k in TOKEN_KEYS else parts[0][k]
            for k in parts[0]}


def _ref(inp, a: int, b: int, h0: torch.Tensor | None, dt_limit=(0.0, float("inf"))):
    """transformers' chunked scan of rows a:b alone: (y [b-a,H,P], final state [H,P,N])."""
    y, h = _hf().mamba2_chunk_scan(
        inp["x"][None, a:b], inp["dt"][None, a:b], inp["A"], inp["B"][None, a:b],
        inp["C"][None, a:b], CS, D=inp["D"], dt_bias=inp["dt_bias"],
        initial_states=None if h0 is None else h0[None], dt_softplus=True, dt_limit=dt_limit,
        return_final_states=True)
    return y[0], h[0]


def _run(inp, state, qsl, slots, init, **kw) -> torch.Tensor:
    return ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"],
                      inp["dt_bias"], state, qsl, slots, init, CS, **kw)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 2.0)])
def test_mixed_lengths_match_reference(groups: int, dt_limit) -> None:
    qsl = _qsl(LENS)
    inp = _inputs(qsl[-1], groups)
    state = torch.randn(S, H, P, N)
    before = state.clone()
    y = _run(inp, state, qsl, SLOTS, INIT, dt_limit=dt_limit)
    for i, slot in enumerate(SLOTS):
        h0 = before[slot] if INIT[i] else None
        y_ref, h_ref = _ref(inp, qsl[i], qsl[i + 1], h0, dt_limit)
        torch.testing.assert_close(y[qsl[i]:qsl[i + 1]], y_ref, **TOL)
        torch.testing.assert_close(state[slot], h_ref, **TOL)
    untouched = [s for s in range(S) if s not in SLOTS]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("groups", [1, 2])
def test_decode_only_matches_selective_state_update(groups: int) -> None:
    b = 5
    inp = _inputs(b, groups, seed=1)
    state = torch.randn(S, H, P, N)
    slots, init = [9, 1, 22, 4, 13], [True, True, False, True, True]
    h_ref = state[slots].clone()
    h_ref[2] = 0
    y = _run(inp, state, list(range(b + 1)), slots, init)
    # transformers' recurrent step takes per-(head, head_dim) dt / A / D / dt_bias
    y_ref = _hf().mamba2_selective_state_update(
        h_ref, inp["x"], inp["dt"][..., None].expand(-1, -1, P),
        inp["A"][:, None, None].expand(-1, P, N), inp["B"], inp["C"],
        inp["D"][:, None].expand(-1, P), dt_bias=inp["dt_bias"][:, None].expand(-1, P),
        dt_softplus=True)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(state[slots], h_ref, **TOL)


@pytest.mark.parametrize("groups", [1, 2])
def test_continuation_over_calls_matches_whole_run(groups: int) -> None:
    """Two sequences, each fed over three steps (prefill chunk, chunk or decode, chunk), next
    to a third sequence that runs whole in the first step."""
    splits = {0: [37, 1, 162], 1: [16, 33, 5]}  # sequence -> tokens per step
    total = {j: sum(v) for j, v in splits.items()}
    inp = _inputs(total[0] + total[1], groups, seed=2)
    off = {0: 0, 1: total[0]}
    slots = {0: 6, 1: 17}
    state = torch.randn(S, H, P, N)
    ys = {0: [], 1: []}
    done = {0: 0, 1: 0}
    for step in range(3):
        other = _inputs(40, groups, seed=10 + step) if step == 0 else None
        parts, qsl, sl, init = [], [0], [], []
        for j in (0, 1):
            n = splits[j][step]
            a = off[j] + done[j]
            parts.append(_take(inp, a, a + n))
            qsl.append(qsl[-1] + n)
            sl.append(slots[j])
            init.append(step > 0)
        if other is not None:
            parts.append(other)  # its A, D, dt_bias are ignored: _cat takes the first
            qsl.append(qsl[-1] + 40)
            sl.append(1)
            init.append(False)
        y = _run(_cat(parts), state, qsl, sl, init)
        for j in (0, 1):
            ys[j].append(y[qsl[j]:qsl[j + 1]])
            done[j] += splits[j][step]
    for j in (0, 1):
        y_ref, h_ref = _ref(inp, off[j], off[j] + total[j], None)
        torch.testing.assert_close(torch.cat(ys[j]), y_ref, **TOL)
        torch.testing.assert_close(state[slots[j]], h_ref, **TOL)


@pytest.mark.parametrize("groups", [1, 2])
def test_checkpoints_store_prefix_states(groups: int) -> None:
    qsl = _qsl(LENS)
    inp = _inputs(qsl[-1], groups, seed=3)
    state = torch.randn(S + 8, H, P, N)
    before = state.clone()
    # sequence 5 (200 tokens): inside a chunk, on chunk boundaries, and its last token;
    # sequence 0 (a decode token) and sequence 4 (chunk + 1) at their ends and just before.
    ckpt = [None] * len(LENS)
    ckpt[5] = [(1, S), (CS, S + 1), (CS + 5, S + 2), (3 * CS, S + 3), (200, S + 4)]
    ckpt[0] = [(1, S + 5)]
    ckpt[4] = [(CS, S + 6), (CS + 1, S + 7)]
    y = _run(inp, state, qsl, SLOTS, INIT, checkpoints=ckpt)
    y_plain = _run(inp, before.clone(), qsl, SLOTS, INIT)
    torch.testing.assert_close(y, y_plain, atol=0, rtol=0)
    for i, pairs in enumerate(ckpt):
        for n, slot in pairs or ():
            h0 = before[SLOTS[i]] if INIT[i] else None
            _, h_ref = _ref(inp, qsl[i], qsl[i] + n, h0)
            torch.testing.assert_close(state[slot], h_ref, **TOL)
    assert torch.equal(state[SLOTS[5]], state[S + 4])


def test_bf16_inputs_keep_float32_state() -> None:
    qsl = _qsl([1, 40])
    inp = _inputs(qsl[-1], 2, seed=4)
    low = {k: v.bfloat16() if k in TOKEN_KEYS else v for k, v in inp.items()}
    s32, s16 = torch.zeros(4, H, P, N), torch.zeros(4, H, P, N)
    y32 = _run({k: v.float() for k, v in low.items()}, s32, qsl, [0, 2], [False, False])
    y16 = _run(low, s16, qsl, [0, 2], [False, False])
    assert y16.dtype == torch.bfloat16 and s16.dtype == torch.float32
    torch.testing.assert_close(y16, y32.bfloat16())  # the math ran in float32 either way
    torch.testing.assert_close(s16, s32)


def test_bad_checkpoint_is_rejected() -> None:
    inp = _inputs(5, 1)
    state = torch.zeros(4, H, P, N)
    with pytest.raises(ValueError):
        _run(inp, state, [0, 5], [0], [False], checkpoints=[[(6, 1)]])


# --- the whole mixer against transformers' Granite 4 / Nemotron-H layers ---------------------


def _hf_layer(arch: str, groups: int):
    from transformers import GraniteMoeHybridConfig, NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    if arch == "granite":
        cfg = GraniteMoeHybridConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=4, mamba_n_heads=H,
            mamba_d_head=16, mamba_n_groups=groups, mamba_d_state=N, mamba_chunk_size=CS)
        layer = _hf().GraniteMoeHybridMambaLayer(cfg, 0)
    else:
        cfg = NemotronHConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=4, mamba_num_heads=H,
            mamba_head_dim=16, n_groups=groups, ssm_state_size=N, chunk_size=CS,
            layers_block_type=["mamba"], use_bias=True)
        layer = NemotronHMamba2Mixer(cfg, 0)
    gen = torch.Generator().manual_seed(groups)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return cfg, layer.eval()


@pytest.mark.parametrize("arch", ["granite", "nemotron_h"])
@pytest.mark.parametrize("groups", [1, 2])
def test_mixer_matches_transformers_layer(arch: str, groups: int) -> None:
    from pagellm.layers.mamba2_mixer import Mamba2Mixer, mamba2_state_shapes

    cfg, ref = _hf_layer(arch, groups)
    mixer = Mamba2Mixer.from_config(cfg)
    mixer.load_state_dict(ref.state_dict())
    conv_shape, ssm_shape = mamba2_state_shapes(cfg)
    assert conv_shape == (16 * H + 2 * groups * N, 3) and ssm_shape == (H, 16, N)
    qsl = _qsl(LENS)
    hidden = torch.randn(qsl[-1], 32, generator=torch.Generator().manual_seed(5))
    conv, ssm = torch.randn(S, *conv_shape), torch.randn(S, *ssm_shape)
    with torch.no_grad():
        y = mixer(hidden, conv, ssm, qsl, SLOTS, [False] * len(LENS))
        for i in range(len(LENS)):
            y_ref = ref(hidden[None, qsl[i]:qsl[i + 1]])[0]
            torch.testing.assert_close(y[qsl[i]:qsl[i + 1]], y_ref, **TOL)


@pytest.mark.parametrize("groups", [1, 2])
def test_mixer_continuation_and_checkpoint_resume(groups: int) -> None:
    """A 100-token prompt fed as 30 + 1 + 69 tokens, next to a decode-only step, gives the whole
    run's output; a checkpoint after 50 tokens resumes (conv + ssm state) to the same tail."""
    from pagellm.layers.mamba2_mixer import Mamba2Mixer, mamba2_state_shapes

    cfg, ref = _hf_layer("granite", groups)
    mixer = Mamba2Mixer.from_config(cfg)
    mixer.load_state_dict(ref.state_dict())
    conv_shape, ssm_shape = mamba2_state_shapes(cfg)
    conv, ssm = torch.randn(S, *conv_shape), torch.randn(S, *ssm_shape)
    hidden = torch.randn(100, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y_ref = ref(hidden[None])[0]
        a = mixer(hidden[:30], conv, ssm, [0, 30], [8], [False])
        b = mixer(hidden[30:31], conv, ssm, [0, 1], [8], [True])  # decode-only step
        other = torch.randn(19, 32)  # a fresh passenger sequence in the same step
        c = mixer(torch.cat([hidden[31:], other]), conv, ssm, [0, 69, 88], [8, 4],
                  [True, False], checkpoints=[[], [(10, 12)]])
        torch.testing.assert_close(torch.cat([a, b, c[:69]]), y_ref, **TOL)
        mixer(hidden[:60], conv, ssm, [0, 60], [2], [False], checkpoints=[[(50, 3)]])
        tail = mixer(hidden[50:], conv, ssm, [0, 50], [3], [True])
        torch.testing.assert_close(tail, y_ref[50:], **TOL)
