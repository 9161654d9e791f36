"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5, on the flat batch.

Per token: project to q, k, v (and the output gate z, the write strength b, the decay a), run
q/k/v through a short depthwise causal conv (its window kept per request), then the gated delta
rule over the request's recurrent state (layers/gated_deltanet_ops.py), a gated RMSNorm per head
and the output projection. The state lives in the request's state slot (core/state_slots.py,
worker/state_cache.py); the forward context says which slot each sequence of the batch uses.

Checkpoint layouts: Qwen3-Next fuses the projections per key head (``in_proj_qkvz`` rows are
``[q, k, v, z]`` of key head 0, then of key head 1, ...; ``in_proj_ba`` alike); Qwen3.5 keeps
``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``. Tensor
parallelism splits key heads (and the value heads each serves) over ranks; the conv channels
(q | k | v) and the per-value-head ``A_log``/``dt_bias`` follow.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.state_metadata import StateMetadata
from pagellm.distributed.parallel_state import get_tp_rank, get_tp_size
from pagellm.forward_context import get_forward_context
from pagellm.layers.causal_conv1d import causal_conv1d_varlen
from pagellm.layers.gated_deltanet_ops import gated_delta_rule_varlen
from pagellm.layers.linear import ColumnParallelLinear, RowParallelLinear


def gdn_dims(config: Any, tp_size: int) -> tuple[int, int, int, int]:
    """(key heads, value heads, key head dim, value head dim) on one rank."""
    hk, hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    if hk % tp_size or hv % hk:
        raise ValueError(f"linear_num_key_heads ({hk}) must be divisible by "
                         f"tensor_parallel_size ({tp_size}), and linear_num_value_heads ({hv}) "
                         f"by linear_num_key_heads")
    return (hk // tp_size, hv // tp_size, int(config.linear_key_head_dim),
            int(config.linear_value_head_dim))


def gdn_state_shapes(config: Any, tp_size: int) -> tuple[tuple[tuple[int, ...], bool], ...]:
    """One slot of a layer: the conv window (model dtype) and the recurrent state (float32)."""
    hk, hv, dk, dv = gdn_dims(config, tp_size)
    conv_dim = 2 * hk * dk + hv * dv
    kernel = int(config.linear_conv_kernel_dim)
    return (((conv_dim, kernel - 1), False), ((hv, dk, dv), True))


class _HeadSharded(nn.Module):
    """A parameter split over ranks by segments of its first dim: ``segments`` are the full
    sizes of consecutive parts (q | k | v conv channels; one part for per-head vectors), each
    cut into ``tp_size`` contiguous pieces."""

    def __init__(self, segments: list[int], rest: tuple[int, ...]) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.segments = segments
        local = sum(s // self.tp_size for s in segments)
        self.weight = nn.Parameter(torch.empty(local, *rest), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: Any = None) -> None:
        copy_rank_segments(param, loaded, self.segments, self.tp_rank, self.tp_size)


def copy_rank_segments(param: nn.Parameter, loaded: torch.Tensor, segments: list[int],
                       tp_rank: int, tp_size: int) -> None:
    """Copy this rank's piece of each consecutive part (``segments``: full sizes along dim 0)
    of a whole checkpoint tensor into ``param``, pieces side by side."""
    full = sum(segments)
    if loaded.shape[0] != full or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                         f"({full}, {', '.join(map(str, param.shape[1:]))})")
    dst, src = 0, 0
    for size in segments:
        part = size // tp_size
        param.data[dst:dst + part].copy_(loaded[src + tp_rank * part:][:part])
        dst, src = dst + part, src + size


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values, then times SiLU(gate) (transformers'
    Qwen3NextRMSNormGated: the weight is applied before the cast back, the gate in float32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.weight.weight_loader = _copy_whole  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


def _copy_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Any, layer_idx: int, fused_projections: bool) -> None:
        """``fused_projections``: Qwen3-Next's ``in_proj_qkvz``/``in_proj_ba`` (else Qwen3.5's
        four projections)."""
        super().__init__()
        tp = get_tp_size()
        self.layer_idx = layer_idx
        self.hk, self.hv, self.dk, self.dv = gdn_dims(config, tp)
        total_hk, total_hv = self.hk * tp, self.hv * tp
        key_dim, value_dim = total_hk * self.dk, total_hv * self.dv
        hidden = int(config.hidden_size)
        self.kernel = int(config.linear_conv_kernel_dim)
        self.fused_projections = fused_projections
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        if fused_projections:
            self.in_proj_qkvz = ColumnParallelLinear(hidden, 2 * key_dim + 2 * value_dim)
            self.in_proj_ba = ColumnParallelLinear(hidden, 2 * total_hv)
        else:
            self.in_proj_qkv = _SegmentedColumnLinear(hidden, [key_dim, key_dim, value_dim])
            self.in_proj_z = ColumnParallelLinear(hidden, value_dim)
            self.in_proj_b = ColumnParallelLinear(hidden, total_hv)
            self.in_proj_a = ColumnParallelLinear(hidden, total_hv)
        self.conv1d = _HeadSharded([key_dim, key_dim, value_dim], (1, self.kernel))
        self.dt_bias = _HeadSharded([total_hv], ()).weight
        self.A_log = _HeadSharded([total_hv], ()).weight
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, hidden)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(mixed_qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv])`` on this rank."""
        t = x.shape[0]
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        if not self.fused_projections:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, hv, dv), self.in_proj_b(x),
                    self.in_proj_a(x))
        ratio = hv // hk
        qkvz = self.in_proj_qkvz(x).view(t, hk, 2 * dk + 2 * ratio * dv)
        q, k, v, z = qkvz.split([dk, dk, ratio * dv, ratio * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, hk, 2 * ratio).split([ratio, ratio], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, hv, dv), b.reshape(t, hv), a.reshape(t, hv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        ctx = get_forward_context()
        meta = ctx.state_metadata
        if ctx.state_caches is not None and meta is not None:
            conv_state, ssm_state = ctx.state_caches[self.layer_idx]
        else:  # profiling / warm-up: one sequence from zero state, no slot of anyone's
            meta = StateMetadata.one_sequence(t, 0)
            conv_state = mixed.new_zeros(1, mixed.shape[1], self.kernel - 1)
            ssm_state = torch.zeros(1, self.hv, self.dk, self.dv, dtype=torch.float32,
                                    device=x.device)
        qsl, slots, init = meta.query_start_loc_cpu, meta.state_slots, meta.has_initial_state
        mixed = causal_conv1d_varlen(mixed, self.conv1d.weight[:, 0], None, conv_state, qsl,
                                     slots, init, checkpoints=meta.checkpoints)
        key_dim = self.hk * self.dk
        q, k, v = mixed.split([key_dim, key_dim, self.hv * self.dv], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = gated_delta_rule_varlen(
            q.reshape(t, self.hk, self.dk), k.reshape(t, self.hk, self.dk),
            v.reshape(t, self.hv, self.dv), g, beta, ssm_state, qsl, slots, init,
            checkpoints=meta.checkpoints)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(t, -1))


class _SegmentedColumnLinear(ColumnParallelLinear):
    """A column-parallel linear whose checkpoint tensor stacks parts split over ranks apart
    (Qwen3.5's ``in_proj_qkv``: each rank takes its heads of q, of k and of v)."""

    def __init__(self, input_size: int, segments: list[int]) -> None:
        self.segments = list(segments)
        super().__init__(input_size, sum(segments))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        copy_rank_segments(param, loaded, self.segments, self.tp_rank, self.tp_size)
