"""Read a GGUF file's tensors, dequantized, under their Hugging Face names.

llama.cpp's converter permutes the rows of Q and K of "llama"-architecture models (Llama,
Mistral) from Hugging Face's rotate-half rope layout to its interleaved one; we undo it, as
transformers' own GGUF loader does. Other architectures (qwen2, qwen3, phi3) are stored unpermuted.

phi3 files keep the checkpoint's fused tensors (``attn_qkv``; ``ffn_up`` holds gate then up) and
longrope's factors as the tensors ``rope_factors_long/short``, which transformers' GGUF config
reader ignores, as it does the original context length and the rotary width: see
``complete_gguf_config``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}
# Per-architecture overrides (gguf.constants.MODEL_TENSORS[MODEL_ARCH.PHI3]): the fused
# tensors that Phi3ForCausalLM splits; phi3 has no ffn_gate.
_ARCH_BLOCK_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
# Rope factors stored as tensors (llama3's rope_freqs, phi3's longrope factors) live in the
# config instead (derived, or put there by complete_gguf_config).
_SKIPPED = {"rope_freqs", "rope_factors_long", "rope_factors_short"}
_PERMUTED_ARCHS = {"llama"}


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None to skip."""
    stem, _, suffix = name.rpartition(".")
    if stem in _SKIPPED:
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    block_names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} of a {arch!r} file has no Hugging Face equivalent "
                     "here (supported GGUF architectures: llama, qwen2, qwen3, phi3)")


def reverse_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of rope rows (weight or bias)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_architecture(reader: Any) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def gguf_weights_iterator(path: str, hf_config: Any,
                          dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor in the GGUF file at ``path``."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = gguf_architecture(reader)
    permute = arch in _PERMUTED_ARCHS
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name, arch)
        if name is None:
            continue
        array = dequantize(t.data, t.tensor_type)
        if not array.flags.writeable:  # unquantized tensors come back as views of the mmap
            array = np.array(array)
        w = torch.from_numpy(array)
        if permute and ".self_attn.q_proj." in name:
            w = reverse_permute(w, num_heads)
        elif permute and ".self_attn.k_proj." in name:
            w = reverse_permute(w, num_kv_heads)
        yield name, (w if dtype is None else w.to(dtype))


def _metadata(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else np.asarray(field.parts[field.data[0]]).item()


def complete_gguf_config(config: Any, path: str) -> None:
    """Put back into a phi3 GGUF's transformers config what its GGUF reader leaves out (it keeps
    Phi3Config's defaults: 4096 original context, plain rope, full rotary width, no window)."""
    if getattr(config, "model_type", None) != "phi3":
        return
    from gguf import GGUFReader

    reader = GGUFReader(path)
    original = _metadata(reader, "phi3.rope.scaling.original_context_length")
    if original is not None:
        config.original_max_position_embeddings = int(original)
    params = dict(getattr(config, "rope_parameters", None) or {})
    head_dim = config.hidden_size // config.num_attention_heads
    rope_dims = _metadata(reader, "phi3.rope.dimension_count")
    if rope_dims is not None:  # Phi-4-mini rotates part of each head
        params["partial_rotary_factor"] = int(rope_dims) / head_dim
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        if set(factors) != {"rope_factors_long.weight", "rope_factors_short.weight"}:
            raise ValueError(f"phi3 GGUF {path!r} has rope factor tensors {sorted(factors)}; "
                             "longrope needs both rope_factors_long and rope_factors_short")
        if original is None:
            raise ValueError(f"phi3 GGUF {path!r} has longrope factors but no "
                             "phi3.rope.scaling.original_context_length")
        params.update(
            rope_type="longrope", original_max_position_embeddings=int(original),
            long_factor=[float(x) for x in factors["rope_factors_long.weight"].data],
            short_factor=[float(x) for x in factors["rope_factors_short.weight"].data])
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = params
    else:  # transformers < 5: top-level fields, and rope_scaling with exactly these keys
        config.partial_rotary_factor = params.get("partial_rotary_factor", 1.0)
        if factors:
            config.rope_scaling = {k: params[k] for k in ("long_factor", "short_factor")}
            config.rope_scaling["type"] = "longrope"
    window = _metadata(reader, "phi3.attention.sliding_window")
    if window:  # the converter writes 0 for none
        config.sliding_window = int(window)
