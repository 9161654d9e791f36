"""Loading Mixture-of-Experts checkpoints: per-expert tensors into FusedMoE's stacked weights.

Checkpoints store each expert's projections apart (``<layer>.<block>.experts.<e>.<proj>.weight``);
``MoeWeightsMixin.load_weights`` routes those to ``FusedMoE.weight_loader`` and leaves every other
tensor (attention, norms, the router, dense MLPs) to Llama's loader. A stacked weight counts as
loaded only once every expert's every projection came; the error names the missing ones by
their checkpoint names, as the dense loader does for fused shards.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagellm.layers.fused_moe import EXPERT_SHARDS, FusedMoE
from pagellm.models.llama import LlamaForCausalLM, load_checkpoint_tensor


class MoeWeightsMixin(LlamaForCausalLM):
    # The checkpoint's name of a layer's MoE block (our module is always ``mlp``) and of the
    # expert projections for w1 (gate), w3 (up), w2 (down).
    moe_block_name = "mlp"
    expert_proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        super().__init__(config, max_model_len)
        self._expert_shards: dict[str, set[tuple[int, str]]] = {}

    def _expert_pattern(self) -> re.Pattern[str]:
        projs = "|".join(map(re.escape, self.expert_proj_names))
        return re.compile(rf"^(.*)\.{re.escape(self.moe_block_name)}\.experts\.(\d+)\."
                          rf"({projs})\.weight$")

    def _to_module_name(self, ckpt_name: str) -> str:
        if self.moe_block_name == "mlp":
            return ckpt_name
        return ckpt_name.replace(f".{self.moe_block_name}.", ".mlp.")

    def moe_target(self, ckpt_name: str) -> tuple[str, tuple[int, str] | None]:
        """Where a checkpoint tensor goes: ``(stacked parameter, (expert, shard))`` for an
        expert's projection (``FusedMoE.weight_loader``'s shard id); else ``(module name, None)``,
        the name Llama's loader maps further (fused qkv/gate_up). Used by ``load_weights`` and
        by in-place updates (pagellm/worker/weight_update.py)."""
        m = self._expert_pattern().match(ckpt_name)
        if m is None:
            return self._to_module_name(ckpt_name), None
        shard = dict(zip(self.expert_proj_names, EXPERT_SHARDS, strict=True))[m.group(3)]
        name = f"{m.group(1)}.mlp.experts.{'w2' if shard == 'w2' else 'w13'}_weight"
        return name, (int(m.group(2)), shard)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        self._expert_shards = {}

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for ckpt_name, tensor in weights:
                name, expert_shard = self.moe_target(ckpt_name)
                if expert_shard is None:
                    yield name, tensor
                    continue
                param = params.get(name)
                if param is None:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} matches no parameter of "
                                     f"{type(self).__name__}")
                load_checkpoint_tensor(param, tensor, expert_shard, ckpt_name)
                self._expert_shards.setdefault(name, set()).add(expert_shard)

        return super().load_weights(others())

    def _missing_tensors(self, params: dict[str, nn.Parameter], loaded: set[str],
                         shards: dict[str, set[int | str]]) -> list[str]:
        experts = {f"{name}.{w}": m for name, m in self.named_modules()
                   if isinstance(m, FusedMoE) for w in ("w13_weight", "w2_weight")}
        rest = {n: p for n, p in params.items() if n not in experts}
        missing = [self._to_ckpt_name(n)
                   for n in super()._missing_tensors(rest, loaded, shards)]
        name_of = dict(zip(EXPERT_SHARDS, self.expert_proj_names, strict=True))
        for pname, moe in experts.items():
            got = self._expert_shards.get(pname, set())
            prefix = pname.removesuffix(".mlp.experts.w13_weight").removesuffix(
                ".mlp.experts.w2_weight")
            kinds = ("w2",) if pname.endswith("w2_weight") else ("w1", "w3")
            missing += [f"{prefix}.{self.moe_block_name}.experts.{e}.{name_of[k]}.weight"
                        for e in range(moe.num_experts) for k in kinds if (e, k) not in got]
        return sorted(missing)

    def _to_ckpt_name(self, name: str) -> str:
        if self.moe_block_name == "mlp":
            return name
        return name.replace(".mlp.", f".{self.moe_block_name}.")
