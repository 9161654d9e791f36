"""Nemotron-H (``NemotronHForCausalLM``, model_type ``nemotron_h``): a stack of single-mixer
blocks, ``x + mixer(norm(x))``, each block one of (``layers_block_type``, or the legacy
``hybrid_override_pattern``): Mamba-2 ``M``, attention ``*`` (no position encoding), a ReLU²
MLP ``-`` (up, down; no gate), or a MoE ``E``.

MoE: a float32 sigmoid router whose choice adds ``e_score_correction_bias`` (group-limited when
``n_group > 1``), weights the chosen experts' plain sigmoid scores (renormalized with
``norm_topk_prob``) times ``routed_scaling_factor``; ReLU² experts, optionally in a smaller
latent space (``moe_latent_size``: ``fc1_latent_proj``/``fc2_latent_proj`` around them); plus a
shared ReLU² MLP on the block's input. Norms scale by ``weight`` in float32.

Only Mamba-2 and attention blocks hold a cache, so they alone are numbered for the caches
(``cache_idx``: the KV layout and the state caches count 0, 1, ... over them, skipping the MLP
and MoE blocks, which would otherwise each get a KV tensor). ``layer_sliding_windows`` and
``recurrent_layers`` use that numbering.

Checkpoints keep the model under ``backbone.`` and each expert apart (``experts.<e>.up_proj``);
transformers 5's own names (``model.``, stacked ``experts.up_proj [E, I, H]``) load too. The
multi-token-prediction layers (``mtp.*``) are skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagellm.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagellm.layers.mamba2_mixer import Mamba2Layer, Mamba2Spec
from pagellm.models.llama import LlamaForCausalLM, get_head_dim, rope_table_len
from pagellm.models.mamba_hybrid import (
    ATTENTION,
    MAMBA,
    HybridAttention,
    Mamba2StateMixin,
    copy_param,
    give_weight_loaders,
    mixer_kind,
    refuse_tensor_parallel,
)

logger = logging.getLogger("pagellm")


def _kinds(config: Any) -> list[str]:
    """Each block's kind: mamba, attention, mlp or moe."""
    return [t if t in ("mlp", "moe") else mixer_kind(t, "layers_block_type")
            for t in config.layers_block_type]


def _cache_kinds(config: Any) -> list[str]:
    """The kinds of the blocks with a cache (Mamba-2, attention), in order: the cache index
    space of this model."""
    return [k for k in _kinds(config) if k in (MAMBA, ATTENTION)]


def _check(config: Any) -> None:
    if config.mlp_hidden_act != "relu2":
        raise ValueError(f"mlp_hidden_act {config.mlp_hidden_act!r} is not supported "
                         f"(only 'relu2')")
    if config.mamba_hidden_act not in ("silu", "swish"):
        raise ValueError(f"mamba_hidden_act {config.mamba_hidden_act!r} is not supported "
                         f"(only 'silu')")
    if "moe" in _kinds(config) and config.n_routed_experts % config.n_group:
        raise ValueError(f"n_routed_experts ({config.n_routed_experts}) is not divisible by "
                         f"n_group ({config.n_group})")
    if ATTENTION not in _kinds(config):
        raise ValueError("layers_block_type has no attention block; pagellm needs one")


class NemotronHRMSNorm(nn.Module):
    """RMSNorm with the weight applied in float32 before the cast back (transformers')."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = copy_param  # type: ignore[attr-defined]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class NemotronHMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool,
                 parallel: bool = True) -> None:
        """``parallel`` False: whole weights on every rank (a routed expert)."""
        super().__init__()
        if parallel:
            self.up_proj: nn.Module = ColumnParallelLinear(hidden, inter, bias=bias)
            self.down_proj: nn.Module = RowParallelLinear(inter, hidden, bias=bias)
        else:
            self.up_proj = ReplicatedLinear(hidden, inter, bias=bias)
            self.down_proj = ReplicatedLinear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


class NemotronHRouter(nn.Module):
    """``[T, H] -> (weights [T, k] float32, expert ids [T, k])``; weights kept in float32."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        e = int(config.n_routed_experts)
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32),
                                                    requires_grad=False)
        for p in (self.weight, self.e_score_correction_bias):
            p.weight_loader = copy_param  # type: ignore[attr-defined]
        self.top_k, self.n_group = int(config.num_experts_per_tok), int(config.n_group)
        self.topk_group = int(config.topk_group)
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.scale = float(config.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            t, e = choice.shape
            grouped = choice.view(t, self.n_group, e // self.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~mask[..., None], float("-inf")).view(t, e)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class NemotronHMoE(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(config.mlp_bias)
        latent = config.moe_latent_size
        width = int(latent) if latent is not None else hidden
        self.gate = NemotronHRouter(config)
        self.experts = nn.ModuleList(
            NemotronHMLP(width, config.moe_intermediate_size, False, parallel=False)
            for _ in range(config.n_routed_experts))
        self.shared_experts = NemotronHMLP(hidden, config.moe_shared_expert_intermediate_size,
                                           bias)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent is not None:
            self.fc1_latent_proj = ReplicatedLinear(hidden, width, bias=bias)
            self.fc2_latent_proj = ReplicatedLinear(width, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = torch.zeros_like(h)
        # Ascending expert order, each token's sum in transformers' order.
        for e in torch.unique(ids).tolist():
            tok, pos = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e](h[tok]) * weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    def __init__(self, config: Any, kind: str, cache_idx: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm = NemotronHRMSNorm(config.hidden_size, config.layer_norm_epsilon)
        if kind == MAMBA:
            self.mixer: nn.Module = Mamba2Layer(Mamba2Spec.from_config(config), cache_idx)
            give_weight_loaders(self.mixer)
        elif kind == ATTENTION:
            self.mixer = HybridAttention(config, cache_idx, None, get_head_dim(config) ** -0.5,
                                         bias=False)
        elif kind == "moe":
            self.mixer = NemotronHMoE(config)
        else:
            self.mixer = NemotronHMLP(config.hidden_size, config.intermediate_size,
                                      bool(config.mlp_bias))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.norm(hidden)
        h = self.mixer(positions, h) if self.kind == ATTENTION else self.mixer(h)
        return hidden + h


class NemotronHModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        kinds, blocks, cache_idx = _kinds(config), [], 0
        for kind in kinds:
            blocks.append(NemotronHBlock(config, kind, cache_idx))
            cache_idx += kind in (MAMBA, ATTENTION)
        self.layers = nn.ModuleList(blocks)
        self.norm_f = NemotronHRMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm_f(hidden)


class NemotronHForCausalLM(Mamba2StateMixin, LlamaForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping[:3]  # q/k/v only

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        refuse_tensor_parallel(type(self).__name__)
        _check(config)
        self.config = config
        self.model = NemotronHModel(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embeddings)
        attn = next(b.mixer.attn for b in self.model.layers if b.kind == ATTENTION)
        # The KV/state caches' layers: the Mamba-2 and attention blocks (see the docstring).
        self.num_layers = len(_cache_kinds(config))
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.max_position = rope_table_len(config, max_model_len)
        self.layer_windows = self.layer_sliding_windows(config)

    @staticmethod
    def layer_sliding_windows(config: Any) -> list[int | None]:
        return [None] * len(_cache_kinds(config))

    layer_kinds = staticmethod(_cache_kinds)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self.checkpoint_weights(weights))

    @staticmethod
    def checkpoint_weights(weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under the names the loaders take (weight updates too)."""
        return _our_names(weights)


def _our_names(weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """``backbone.`` as ``model.``, stacked experts apart, MTP layers skipped."""
    skipped = 0
    for name, t in weights:
        if name.startswith("mtp.") or ".mtp." in name:
            skipped += 1
            continue
        if name.startswith("backbone."):
            name = "model." + name.removeprefix("backbone.")
        prefix, _, proj = name.partition(".mixer.experts.")
        if proj in ("up_proj", "down_proj"):  # transformers' stacked [E, out, in]
            for e in range(t.shape[0]):
                yield f"{prefix}.mixer.experts.{e}.{proj}.weight", t[e]
            continue
        yield name, t
    if skipped:
        logger.info("Skipped %d multi-token-prediction tensors (mtp.*): pagellm does not use "
                    "MTP heads", skipped)
