"""Read a GGUF file's tensors, dequantized, under their Hugging Face names.

llama.cpp's converter permutes the rows of Q and K of "llama"-architecture models (Llama,
Mistral) from Hugging Face's rotate-half rope layout to its interleaved one; we undo it, as
transformers' own GGUF loader does. Other architectures (qwen2, qwen3, phi3) are stored unpermuted.

phi3 files keep the checkpoint's fused tensors (``attn_qkv``; ``ffn_up`` holds gate then up) and
longrope's factors as the tensors ``rope_factors_long/short``, which transformers' GGUF config
reader ignores, as it does the original context length and the rotary width: see
``complete_gguf_config``.

Mixture-of-Experts files: Mixtral is a "llama" file with ``llama.expert_count`` (its config
becomes a MixtralConfig here; transformers reads it as a dense Llama), Qwen3-MoE a "qwen3moe"
file (``expert_feed_forward_length``, which transformers skips, is the experts' width). Each
layer holds the router ``ffn_gate_inp`` ``[E, H]`` and every expert's projections stacked,
``ffn_gate_exps``/``ffn_up_exps`` ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]``; older Mixtral
files store one tensor per expert (``blk.N.ffn_gate.E.weight``). They are split into the
checkpoints' per-expert names, which the MoE models load (pagellm/models/moe.py).

Gemma 2/3 files store every RMSNorm weight as 1 + w (llama.cpp multiplies by the weight; Gemma's
norm scales by 1 + w), so 1 is taken off here; their four norms per layer are ``attn_norm``,
``post_attention_norm``, ``ffn_norm`` (the pre-feedforward one) and ``post_ffw_norm``. Their config
is rebuilt from the metadata in pagellm/models/gguf_gemma.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pagellm.models.gguf_gemma import gemma_config_from_gguf

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
# tensors that Phi3ForCausalLM splits; phi3 has no ffn_gate. Gemma 2/3 norm both sides of each
# sublayer (gguf.tensor_mapping: ffn_norm is the pre-feedforward norm there).
_GEMMA_BLOCK_NAMES = {"post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_BLOCK_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                     "gemma2": _GEMMA_BLOCK_NAMES, "gemma3": _GEMMA_BLOCK_NAMES}
# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (its kernels multiply by the
# weight; Gemma's norm scales by 1 + w): every "*norm.weight", q/k norms included.
_NORM_PLUS_ONE_ARCHS = {"gemma2", "gemma3"}
# Rope factors stored as tensors (llama3's rope_freqs, phi3's longrope factors) live in the
# config instead (derived, or put there by complete_gguf_config).
_SKIPPED = {"rope_freqs", "rope_factors_long", "rope_factors_short"}
_PERMUTED_ARCHS = {"llama"}
# MoE: the checkpoint's name of a layer's MoE block and of the experts' (gate, up, down).
_MOE_NAMES = {"llama": ("block_sparse_moe", ("w1", "w3", "w2")),
              "qwen3moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
_EXPERT_STACKS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_EXPERT_SINGLES = {"ffn_gate": 0, "ffn_up": 1, "ffn_down": 2}  # old files: blk.N.ffn_gate.E
_SUPPORTED = "llama (and Mixtral), qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3"


def _expert_name(arch: str, layer: str, expert: int | str, proj: int) -> str:
    block, projs = _MOE_NAMES[arch]
    return f"model.layers.{layer}.{block}.experts.{expert}.{projs[proj]}.weight"


def gguf_expert_names(name: str, arch: str, num_experts: int) -> list[str] | None:
    """``blk.3.ffn_gate_exps.weight`` (all experts stacked) -> each expert's checkpoint name,
    in expert order; None for any other tensor."""
    parts = name.split(".")
    if (len(parts) != 4 or parts[0] != "blk" or parts[2] not in _EXPERT_STACKS
            or parts[3] != "weight"):
        return None
    if arch not in _MOE_NAMES:
        raise ValueError(f"GGUF tensor {name!r}: experts in a {arch!r} file are not supported "
                         "(MoE GGUF architectures: llama (Mixtral), qwen3moe)")
    return [_expert_name(arch, parts[1], e, _EXPERT_STACKS[parts[2]]) for e in range(num_experts)]


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
    if arch in _MOE_NAMES and len(parts) >= 3 and parts[0] == "blk" and suffix == "weight":
        if len(parts) == 3 and parts[2] == "ffn_gate_inp":  # the router
            return f"model.layers.{parts[1]}.{_MOE_NAMES[arch][0]}.gate.weight"
        if len(parts) == 4 and parts[2] in _EXPERT_SINGLES and parts[3].isdigit():
            return _expert_name(arch, parts[1], parts[3], _EXPERT_SINGLES[parts[2]])
    raise ValueError(f"GGUF tensor {name!r} of a {arch!r} file has no Hugging Face equivalent "
                     f"here (supported GGUF architectures: {_SUPPORTED})")


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
    num_experts = int(getattr(hf_config, "num_local_experts", None)
                      or getattr(hf_config, "num_experts", None) or 0)
    for t in reader.tensors:
        experts = gguf_expert_names(t.name, arch, num_experts)
        name = None if experts is not None else gguf_to_hf_name(t.name, arch)
        if name is None and experts is None:
            continue
        array = dequantize(t.data, t.tensor_type)
        if not array.flags.writeable:  # unquantized tensors come back as views of the mmap
            array = np.array(array)
        w = torch.from_numpy(array)
        if experts is not None:
            if w.dim() != 3 or w.shape[0] != num_experts:
                raise ValueError(f"GGUF tensor {t.name!r} has shape {tuple(w.shape)}; expected "
                                 f"{num_experts} experts stacked on its first dimension")
            for expert_name, expert in zip(experts, w.unbind(0), strict=True):
                # Own storage: the GGUF cache's safetensors refuses tensors sharing memory.
                yield expert_name, expert.to(dtype or expert.dtype, copy=True)
            continue
        if permute and ".self_attn.q_proj." in name:
            w = reverse_permute(w, num_heads)
        elif permute and ".self_attn.k_proj." in name:
            w = reverse_permute(w, num_kv_heads)
        elif arch in _NORM_PLUS_ONE_ARCHS and name.endswith("norm.weight"):
            w = w.to(torch.float32) - 1.0
        yield name, (w if dtype is None else w.to(dtype))


def _metadata(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else np.asarray(field.parts[field.data[0]]).item()


def complete_gguf_config(config: Any, path: str) -> Any:
    """The GGUF's transformers config with what its GGUF reader leaves out put back: for phi3
    (it keeps Phi3Config's defaults: 4096 original context, plain rope, full rotary width, no
    window), MoE files (see ``_complete_moe_config``) and Gemma 2/3 (soft-capping, layer types,
    attention scale, per-type rope: see pagellm/models/gguf_gemma.py). May return a new config
    object."""
    model_type = getattr(config, "model_type", None)
    # transformers calls a "llama" file "mistral" when its general.name says so (Mixtral's may).
    if model_type in ("llama", "mistral", "qwen3_moe"):
        return _complete_moe_config(config, path)
    if model_type == "phi3":
        _complete_phi3_config(config, path)
    if model_type in ("gemma2", "gemma3_text"):
        return gemma_config_from_gguf(config, path)
    return config


def _complete_moe_config(config: Any, path: str) -> Any:
    """A "llama" file with experts is Mixtral: a MixtralConfig (the expert width is the file's
    ``feed_forward_length``, as llama.cpp's converter writes it). qwen3moe: the experts' width
    and, when the file says, whether top-k weights are renormalized (llama.cpp's qwen3moe
    always does; transformers' GGUF reader defaults it to true)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = gguf_architecture(reader)
    experts = _metadata(reader, f"{arch}.expert_count")
    if config.model_type == "qwen3_moe":
        width = _metadata(reader, f"{arch}.expert_feed_forward_length")
        if width is None:
            raise ValueError(f"qwen3moe GGUF {path!r} has no {arch}.expert_feed_forward_length "
                             "(the experts' intermediate size)")
        config.moe_intermediate_size = int(width)
        norm = _metadata(reader, f"{arch}.expert_weights_norm")
        if norm is not None:
            config.norm_topk_prob = bool(norm)
        return config
    if not experts:
        return config  # a dense Llama
    from transformers import MixtralConfig

    used = _metadata(reader, f"{arch}.expert_used_count")
    if not used:
        raise ValueError(f"GGUF {path!r} has {experts} experts but no {arch}.expert_used_count")
    fields = {k: v for k, v in config.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version")}
    # Only the file decides the window (MistralConfig's default of 4096 is not Mixtral's).
    window = _metadata(reader, f"{arch}.attention.sliding_window")
    fields["sliding_window"] = int(window) if window else None
    mixtral = MixtralConfig(**fields, num_local_experts=int(experts),
                            num_experts_per_tok=int(used))
    mixtral.architectures = ["MixtralForCausalLM"]
    return mixtral


def _complete_phi3_config(config: Any, path: str) -> None:
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
