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
from pagellm.layers.linear_method import LinearMethodBase
from pagellm.layers.method_factory import make_linear_method


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
        # The weight is the embedding table above (or a tied embedding's), not the method's
        # create_weights; the embedding lookup reads it, so a CPU kernel's layout is a copy.
        self.linear_method: LinearMethodBase = make_linear_method(weight_shared=True)
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear_method.apply(self, hidden, self.bias)
        if self.tp_size > 1:
            logits = all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings].float()

