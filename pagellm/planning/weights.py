"""Weight bytes of one tensor-parallel rank, from the config alone (no tensors loaded).

The count mirrors the engine's layers (pagellm/layers): q/k/v and gate/up are column-parallel
(K/V heads replicated when there are fewer than ranks), o and down are row-parallel with their
bias replicated, the vocab-parallel embedding and LM head hold ceil(vocab / tp) rows each (the
last rank's padding included, so every rank is the same size), and norms are replicated. A tied
LM head shares the embedding's tensor and costs nothing more. Qwen3's per-head q/k norms are
replicated too.

A Mixture-of-Experts layer (Mixtral, Qwen3-MoE) holds a replicated router ``[E, H]`` and every
expert's gate/up/down, each split over the ranks along the expert's intermediate dimension
(pagellm/layers/fused_moe.py); layers the config keeps dense hold the dense MLP. A shared
expert (Qwen3-Next) adds a gated MLP of its width per MoE layer. Hybrid models' recurrent
layers (Gated DeltaNet, Mamba-2) hold their token mixer instead of attention.

Quantization is weight-only and applies to the decoder's linear layers and MoE experts (each
expert's gate/up and down, as a linear of that shape); embeddings, LM head, norms, biases and MoE
routers stay in the model dtype (as AWQ/GPTQ-style checkpoints keep them):
- int8: 1 byte per weight + one fp16 scale per output channel;
- int4: half a byte per weight + a 16-bit scale and zero point per group of 32 input weights
  (the engine's default ``int4``, pagellm.layers.quantization.DEFAULT_INT4_GROUP_SIZE).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from types import SimpleNamespace

from pagellm.memory_plan import kv_heads_per_rank
from pagellm.planning.model_spec import ModelSpec

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32  # = pagellm.layers.quantization.DEFAULT_INT4_GROUP_SIZE (no torch here)
SCALE_BYTES = 2  # 16-bit scales (and int4 zero points)


def linear_weight_bytes(out_features: int, in_features: int, dtype_bytes: int,
                        quantization: str = "none") -> int:
    """Bytes of one ``[out_features, in_features]`` weight (no bias)."""
    if quantization == "none":
        return out_features * in_features * dtype_bytes
    if quantization == "int8":
        return out_features * in_features + out_features * SCALE_BYTES
    if quantization == "int4":
        groups = math.ceil(in_features / INT4_GROUP_SIZE)
        return (math.ceil(out_features * in_features / 2)
                + out_features * groups * 2 * SCALE_BYTES)  # scale + zero point per group
    raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                     f"got {quantization!r}.")


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """The engine's own check (pagellm.config.check_tensor_parallel), minus the GPU count: a
    plan targets GPUs this machine need not have."""
    import torch

    from pagellm.config import check_tensor_parallel as engine_check

    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}.")
    shape = SimpleNamespace(num_attention_heads=spec.num_heads,
                            num_key_value_heads=spec.num_kv_heads,
                            intermediate_size=spec.intermediate_size)
    engine_check(tp, shape, torch.device("cpu"), "cpu")
    if spec.moe_intermediate_size % tp:
        raise ValueError(f"--tensor-parallel-size {tp} cannot split this model: it needs to "
                         f"divide the experts' intermediate size ({spec.moe_intermediate_size}).")


def valid_tensor_parallel(spec: ModelSpec, tp: int) -> bool:
    try:
        check_tensor_parallel(spec, tp)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class WeightBreakdown:
    """Bytes held by one rank, by part."""

    embedding: int
    lm_head: int
    attention: int
    mlp: int
    norms: int

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.attention + self.mlp + self.norms

    def as_dict(self) -> dict[str, int]:
        return dict(asdict(self), total=self.total)


def weight_bytes_per_rank(spec: ModelSpec, dtype_bytes: int, tp: int = 1,
                          quantization: str = "none") -> WeightBreakdown:
    check_tensor_parallel(spec, tp)
    h, hd, q, b = spec.hidden_size, spec.head_dim, quantization, dtype_bytes
    heads = spec.num_heads // tp
    kv = kv_heads_per_rank(spec.num_kv_heads, tp)
    inter = spec.intermediate_size // tp
    # A gated attention's q_proj yields a query and a gate per head.
    qkv_out = ((2 if spec.attention_output_gate else 1) * heads + 2 * kv) * hd
    attention = (linear_weight_bytes(qkv_out, h, b, q) + linear_weight_bytes(h, heads * hd, b, q)
                 + (qkv_out * b if spec.qkv_bias else 0) + (h * b if spec.o_bias else 0))
    # Recurrent layers (linear attention, Mamba-2) in place of attention: their token mixer's
    # parameters split over the ranks (quantized: as one [params / H, H] linear, an estimate).
    per_rank = math.ceil(spec.recurrent_params / tp)
    recurrent = len(spec.recurrent_layers) * (
        per_rank * b if q == "none" else linear_weight_bytes(math.ceil(per_rank / h), h, b, q))
    attention_layers = spec.num_layers - len(spec.recurrent_layers)
    shared = spec.shared_expert_intermediate_size // tp
    shared_expert = (linear_weight_bytes(2 * shared, h, b, q) + linear_weight_bytes(h, shared, b, q)
                     + h * b) if shared else 0
    mlp = (linear_weight_bytes(2 * inter, h, b, q) + linear_weight_bytes(h, inter, b, q)
           + ((2 * inter + h) * b if spec.mlp_bias else 0))
    moe_inter = spec.moe_intermediate_size // tp
    # Each expert's gate/up and down, plus its router row.
    moe = spec.num_experts * (linear_weight_bytes(2 * moe_inter, h, b, q)
                              + linear_weight_bytes(h, moe_inter, b, q) + h * b) + shared_expert
    dense_layers = spec.num_layers - spec.moe_layers
    vocab_rows = math.ceil(spec.vocab_size / tp)
    embedding = vocab_rows * h * b
    return WeightBreakdown(
        embedding=embedding, lm_head=0 if spec.tie_word_embeddings else embedding,
        attention=attention_layers * attention + recurrent,
        mlp=dense_layers * mlp + spec.moe_layers * moe,
        norms=(spec.norms_per_layer * spec.num_layers + 1) * h * b
        + (attention_layers * 2 * hd * b if spec.qk_norm else 0))


def num_parameters(spec: ModelSpec) -> int:
    """Unique parameters of the whole model (tied embeddings counted once)."""
    return weight_bytes_per_rank(spec, 1, 1).total
