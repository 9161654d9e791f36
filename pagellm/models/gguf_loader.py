"""Read a GGUF file's tensors, dequantized, under their Hugging Face names.

llama.cpp's converter permutes the rows of Q and K of "llama"-architecture models (Llama,
Mistral) from Hugging Face's rotate-half rope layout to its interleaved one; we undo it, as
transformers' own GGUF loader does. Other architectures (qwen2, qwen3) are stored unpermuted.
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
# llama3 GGUFs store the rope frequency factors; we derive them from the config instead.
_SKIPPED = {"rope_freqs"}
_PERMUTED_ARCHS = {"llama"}


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None to skip."""
    stem, _, suffix = name.rpartition(".")
    if stem in _SKIPPED:
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face Llama/Mistral/Qwen2/Qwen3 "
                     "equivalent")


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
    permute = gguf_architecture(reader) in _PERMUTED_ARCHS
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
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
