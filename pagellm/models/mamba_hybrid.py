"""Shared by the Mamba-2 hybrids (Granite 4 ``GraniteMoeHybridForCausalLM``, Nemotron-H): layer
kinds, the tensor-parallel refusal, a plain q/k/v attention block and a weight copier for the
parameters the parallel layers do not own (the Mamba-2 mixer's plain ``nn.Linear``s)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.distributed.parallel_state import get_tp_size
from pagellm.layers.attention import Attention
from pagellm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagellm.layers.mamba2_mixer import mamba2_state_shapes
from pagellm.layers.rotary import RotaryEmbedding
from pagellm.models.llama import get_head_dim

MAMBA, ATTENTION = "mamba", "attention"
# transformers 5 names (and the legacy names configs on the Hub still carry) -> our kind.
_KINDS = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION,
          "attention": ATTENTION}


def mixer_kind(layer_type: str, field: str) -> str:
    """``mamba`` or ``attention`` for a layer type of the config's ``field``."""
    kind = _KINDS.get(layer_type)
    if kind is None:
        raise ValueError(f"{field} entry {layer_type!r} is not supported (Mamba-2 or attention "
                         f"layers: {', '.join(sorted(_KINDS))})")
    return kind


def mamba2_state_specs(config: Any) -> tuple[tuple[tuple[int, ...], bool], ...]:
    """``recurrent_state_shapes`` of a Mamba-2 layer: conv window (model dtype), then the SSM
    state (float32)."""
    conv, ssm = mamba2_state_shapes(config)
    return ((conv, False), (ssm, True))


def mamba2_layer_params(config: Any) -> int:
    """Parameters of one Mamba-2 mixer (pagellm plan's weight count): in_proj to gate, xBC and
    dt; the conv; A_log, D and dt_bias; the gated norm; out_proj."""
    from pagellm.layers.mamba2_mixer import Mamba2Spec

    m = Mamba2Spec.from_config(config)
    inner = m.intermediate_size
    in_proj = m.hidden_size * (inner + m.conv_dim + m.num_heads)
    return in_proj + m.conv_dim * m.conv_kernel + 3 * m.num_heads + inner + inner * m.hidden_size


class Mamba2StateMixin:
    """What the engine asks a Mamba-2 hybrid about its recurrent layers (see
    LlamaForCausalLM.recurrent_layers); ``layer_kinds(config)``, each cache layer's kind, is
    the family's own."""

    @staticmethod
    def layer_kinds(config: Any) -> list[str]:
        raise NotImplementedError

    @classmethod
    def recurrent_layers(cls, config: Any) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(cls.layer_kinds(config)) if kind == MAMBA)

    @staticmethod
    def recurrent_state_shapes(config: Any, tp_size: int) -> tuple[tuple[tuple[int, ...], bool],
                                                                    ...]:
        return mamba2_state_specs(config)

    @staticmethod
    def recurrent_layer_params(config: Any) -> int:
        return mamba2_layer_params(config)


def refuse_tensor_parallel(arch: str) -> None:
    """The Mamba-2 mixer keeps whole (unsharded) projections: one rank only."""
    tp = get_tp_size()
    if tp > 1:
        raise ValueError(f"{arch} does not support --tensor-parallel-size {tp}: its Mamba-2 "
                         f"layers are not sharded; use --tensor-parallel-size 1")


def copy_param(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Weight loader of a parameter without one (a plain module's): the whole tensor."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


def give_weight_loaders(module: nn.Module) -> None:
    """``copy_param`` on every parameter of ``module`` that has no ``weight_loader``, so the
    Llama loader can fill them (the Mamba-2 mixer's ``nn.Linear``/``nn.Conv1d``/vectors)."""
    for p in module.parameters():
        if not hasattr(p, "weight_loader"):
            p.requires_grad_(False)
            p.weight_loader = copy_param  # type: ignore[attr-defined]


class HybridAttention(nn.Module):
    """q/k/v/o attention with its own scale and optional rotary (None: no position encoding,
    Nemotron-H's and Granite 4's ``nope``). ``cache_idx``: its index in the KV layout."""

    def __init__(self, config: Any, cache_idx: int, rotary_emb: RotaryEmbedding | None,
                 scale: float, bias: bool) -> None:
        super().__init__()
        head_dim = get_head_dim(config)
        heads = config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads,
                                          config.num_key_value_heads, bias=bias)
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads,
                              scale, cache_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))
