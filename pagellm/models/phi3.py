"""Phi-3 (and Phi-3.5 / Phi-4-mini, same tensors): Llama's layers, but the checkpoint stores q/k/v
as one ``qkv_proj`` tensor and gate/up as one ``gate_up_proj``; rope may be ``longrope``
(pagellm/layers/rotary.py).

The fused tensors are split into their q, k, v (gate, up) parts before loading, so each part
goes through the per-shard loaders: a tensor-parallel rank gets its heads of q, k and v, not a
contiguous slice of the fused rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagellm.models.llama import LlamaForCausalLM, get_head_dim


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_bias(config: Any) -> tuple[bool, bool]:
        return False, False

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """Fused q/k/v and gate/up checkpoint tensors split into the parts the loaders take."""
        c = self.config
        head_dim = get_head_dim(c)
        q_size = c.num_attention_heads * head_dim
        kv_size = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                if tensor.shape[0] != q_size + 2 * kv_size:
                    raise ValueError(f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} "
                                     f"should have {q_size + 2 * kv_size} rows (q, k, v)")
                parts = tensor.split([q_size, kv_size, kv_size], dim=0)
                for part, t in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                    yield name.replace(".qkv_proj.", f".{part}."), t
            elif ".gate_up_proj." in name:
                if tensor.shape[0] != 2 * c.intermediate_size:
                    raise ValueError(f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} "
                                     f"should have {2 * c.intermediate_size} rows (gate, up)")
                gate, up = tensor.split(c.intermediate_size, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self.checkpoint_weights(weights))
