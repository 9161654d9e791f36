"""Vocabulary-parallel token embedding and LM head.

The vocabulary is split into ``tp_size`` contiguous ranges (padded up to a multiple of tp_size);
each rank embeds only its ids and the partial embeddings are summed by an all-reduce. The LM head
computes its vocabulary slice of the logits and all-gathers them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.communication import all_gather, tensor_model_parallel_all_reduce
from pagellm.distributed.parallel_state import get_tp_rank, get_tp_size
from pagellm.kernels import cpu_ops
from pagellm.layers.linear import amx_max_numel, cpu_matmul_kind


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_per_partition
        self.vocab_end = min(self.vocab_start + self.num_per_partition, num_embeddings)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.zeros(self.num_per_partition, embedding_dim, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: None = None) -> None:
        if loaded.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"embedding shape {tuple(loaded.shape)} != "
                             f"({self.num_embeddings}, {self.embedding_dim}) from the config")
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = torch.where(outside, 0, input_ids - self.vocab_start)
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection; ``compute_logits`` returns float32 ``[N, vocab]`` on every rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype)
        self.amx_max_numel = 0  # hidden states up to this size take cpu_ops.linear
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_per_partition, dtype=self.weight.dtype),
                                     requires_grad=False)
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: None = None) -> None:
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_end])

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding; use compute_logits")

    @torch.no_grad()
    def prepack_for_cpu_(self) -> bool:
        """Choose the logits matmul of a CPU bfloat16 or float32 weight once, as the linear
        layers do (``LinearBase.prepack_for_cpu_``): ``cpu_ops.linear`` on the weight as it is
        where AMX serves it (the rows sampled per step are few), else a copy packed for
        ``cpu_ops.linear_packed`` where that takes it, else a copy in oneDNN's blocked layout
        (bit-identical to ``F.linear`` in bfloat16). The weight itself stays: a tied embedding
        still looks rows up in it. Returns whether anything changed."""
        w = self.weight.data
        kind = cpu_matmul_kind(w, self.bias)
        if kind == "amx":
            self.amx_max_numel = amx_max_numel(w, self.bias)
        elif kind == "packed":
            self.vec_packed_weight = cpu_ops.linear_pack(w)
        elif kind == "onednn":
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w)
        return kind is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        packed = getattr(self, "packed_weight", None)
        vec_packed = getattr(self, "vec_packed_weight", None)
        if 0 < hidden.numel() <= self.amx_max_numel and hidden.dtype == torch.bfloat16:
            logits = cpu_ops.linear(hidden, self.weight, self.bias)
        elif vec_packed is not None:
            logits = cpu_ops.linear_packed(hidden, vec_packed, self.bias)
        elif packed is not None:
            logits = torch.ops.mkldnn._linear_pointwise(hidden, packed, self.bias, "none", [],
                                                        "")
        else:
            logits = F.linear(hidden, self.weight, self.bias)
        if self.tp_size > 1:
            logits = all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings].float()

