"""Mamba-2 mixer of GraniteMoeHybrid (Granite 4) and Nemotron-H over a flat, unpadded batch.

Both models' mixers compute the same thing (in_proj -> causal conv over xBC -> SSD scan ->
gated RMSNorm with one group per B/C group, gate applied before the norm -> out_proj); they
differ only in config names, which ``Mamba2Spec.from_config`` maps. Parameter names match the
checkpoints so a layer's state dict loads by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.state_metadata import StateMetadata
from pagellm.forward_context import get_forward_context
from pagellm.layers.causal_conv1d import causal_conv1d_varlen
from pagellm.layers.mamba2_ops import Checkpoints, ssd_varlen


@dataclass(frozen=True)
class Mamba2Spec:
    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    chunk_size: int
    proj_bias: bool
    conv_bias: bool
    eps: float
    activation: str
    dt_limit: tuple[float, float]

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    @classmethod
    def from_config(cls, config) -> Mamba2Spec:
        """Granite 4 and Nemotron-H name the same fields differently; note Nemotron-H's mixer
        takes its projection bias from ``use_bias`` (not ``mamba_proj_bias``)."""
        limit = tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf")))
        if hasattr(config, "mamba_n_heads"):  # GraniteMoeHybrid
            return cls(config.hidden_size, config.mamba_n_heads, config.mamba_d_head,
                       config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv,
                       config.mamba_chunk_size, config.mamba_proj_bias, config.mamba_conv_bias,
                       config.rms_norm_eps, config.hidden_act, limit)
        if hasattr(config, "mamba_num_heads"):  # NemotronH
            return cls(config.hidden_size, config.mamba_num_heads, config.mamba_head_dim,
                       config.n_groups, config.ssm_state_size, config.conv_kernel,
                       config.chunk_size, config.use_bias, config.use_conv_bias,
                       config.layer_norm_epsilon, config.mamba_hidden_act, limit)
        raise ValueError(f"no Mamba-2 mixer fields in {type(config).__name__}")


def mamba2_state_shapes(config) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """Per-layer, per-slot state shapes: conv (C, K-1) and ssm (nheads, head_dim, d_state)."""
    s = Mamba2Spec.from_config(config)
    return (s.conv_dim, s.conv_kernel - 1), (s.num_heads, s.head_dim, s.d_state)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x * silu(gate), over groups of ``group_size`` channels (norm after gate)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, spec: Mamba2Spec) -> None:
        super().__init__()
        self.spec = s = spec
        self.in_proj = nn.Linear(s.hidden_size, s.intermediate_size + s.conv_dim + s.num_heads,
                                 bias=s.proj_bias)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim,
                                padding=s.conv_kernel - 1, bias=s.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(s.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, s.num_heads + 1).float()))
        self.D = nn.Parameter(torch.ones(s.num_heads))
        self.norm = GatedRMSNorm(s.intermediate_size, s.intermediate_size // s.n_groups, s.eps)
        self.out_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=s.proj_bias)

    @classmethod
    def from_config(cls, config) -> Mamba2Mixer:
        return cls(Mamba2Spec.from_config(config))

    def forward(self, hidden: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                qsl: Sequence[int], state_slots: Sequence[int] | torch.Tensor,
                has_initial: Sequence[bool] | torch.Tensor,
                checkpoints: Checkpoints = None) -> torch.Tensor:
        """hidden [T, H] flat batch -> [T, H]; conv_state [S, C, K-1] and ssm_state
        [S, nheads, head_dim, d_state] are this layer's, updated in place per slot."""
        s = self.spec
        t = hidden.shape[0]
        gate, xbc, dt = self.in_proj(hidden).split(
            [s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)
        xbc = causal_conv1d_varlen(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                   conv_state, qsl, state_slots, has_initial,
                                   activation=s.activation, checkpoints=checkpoints)
        gn = s.n_groups * s.d_state
        x, B, C = xbc.split([s.intermediate_size, gn, gn], dim=-1)
        y = ssd_varlen(x.reshape(t, s.num_heads, s.head_dim), dt,
                       -torch.exp(self.A_log.float()), B.reshape(t, s.n_groups, s.d_state),
                       C.reshape(t, s.n_groups, s.d_state), self.D, self.dt_bias, ssm_state,
                       qsl, state_slots, has_initial, s.chunk_size, dt_softplus=True,
                       dt_limit=s.dt_limit, checkpoints=checkpoints)
        y = self.norm(y.view(t, s.intermediate_size), gate)
        return self.out_proj(y.to(hidden.dtype))


class Mamba2Layer(Mamba2Mixer):
    """A model's Mamba-2 layer: the mixer with its state taken from the forward context (this
    layer's ``state_caches`` entry and the step's ``state_metadata``), so it runs inside a
    decoder stack like an attention layer. ``layer_idx`` is the model's index for its caches."""

    def __init__(self, spec: Mamba2Spec, layer_idx: int) -> None:
        super().__init__(spec)
        self.layer_idx = layer_idx

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx = get_forward_context()
        meta = ctx.state_metadata
        if ctx.state_caches is not None and meta is not None:
            conv_state, ssm_state = ctx.state_caches[self.layer_idx]
        else:  # profiling / warm-up: one sequence from zero state, no slot of anyone's
            s = self.spec
            meta = StateMetadata.one_sequence(hidden.shape[0], 0)
            conv_state = hidden.new_zeros(1, s.conv_dim, s.conv_kernel - 1)
            ssm_state = torch.zeros(1, s.num_heads, s.head_dim, s.d_state,
                                    dtype=torch.float32, device=hidden.device)
        return super().forward(hidden, conv_state, ssm_state, meta.query_start_loc_cpu,
                               meta.state_slots, meta.has_initial_state,
                               checkpoints=meta.checkpoints)
