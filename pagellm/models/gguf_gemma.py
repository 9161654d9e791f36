"""Gemma 2 / Gemma 3 (text) configs from a GGUF file's metadata, as llama.cpp reads them.

transformers' GGUF config reader keeps only the sizes, the window and one rope base; the rest is
rebuilt here the way llama.cpp's loader (llama-model.cpp) and converter (convert_hf_to_gguf.py)
agree on it:

- soft-capping: ``{arch}.attn_logit_softcapping`` / ``{arch}.final_logit_softcapping``
  (absent: off).
- attention scale: the files carry none; llama.cpp uses ``head_dim ** -0.5``, except for the 27B
  models (46 layers for Gemma 2, 62 for Gemma 3) which use ``(hidden / heads) ** -0.5``; that is
  ``query_pre_attn_scalar`` in the checkpoints' configs.
- layer types: ``{arch}.attention.sliding_window_pattern`` when present (a period, or one bool
  per layer, true = sliding); else Gemma 2 alternates (every 2nd layer global) and Gemma 3 has
  5 sliding layers, then 1 global. No window (absent or 0): every layer global.
- rope: Gemma 2 has one table (``rope.freq_base``, default 10k); Gemma 3's global layers use
  ``rope.freq_base`` (default 1e6) with ``rope.scaling.type``/``factor`` (linear), its sliding ones
  ``rope.freq_base_swa`` (default 10k, which llama.cpp assumes) unscaled.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Layer counts llama.cpp calls "27B" (llama-model.cpp), whose attention scale is hidden / heads.
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_DEFAULT_PERIOD = {"gemma2": 2, "gemma3": 6}


def _read_metadata(path: str, arch: str) -> dict[str, Any]:
    """``{key without "<arch>.": value}`` of the file's architecture keys (arrays as lists)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    out: dict[str, Any] = {}
    prefix = f"{arch}."
    for key, field in reader.fields.items():
        if not key.startswith(prefix) or not field.data:
            continue
        values = [field.parts[i] for i in field.data]
        if field.types and field.types[-1].name == "STRING":
            parsed = [bytes(v).decode() for v in values]
        else:
            parsed = [np.asarray(v).item() for v in values]
        is_array = field.types and field.types[0].name == "ARRAY"
        out[key[len(prefix):]] = parsed if is_array else parsed[0]
    return out


def gemma_layer_types(arch: str, num_layers: int, window: int | None,
                      pattern: int | list[bool] | None) -> list[str]:
    """Per layer ``"sliding_attention"`` / ``"full_attention"`` (llama.cpp's set_swa_pattern:
    with period n, layer i slides unless (i + 1) % n == 0)."""
    if not window:
        return ["full_attention"] * num_layers
    if pattern is None:
        pattern = _DEFAULT_PERIOD[arch]
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} "
                             f"entries for {num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern)
        sliding = [period > 0 and (i + 1) % period != 0 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _global_rope(meta: dict[str, Any], arch: str, default_theta: float) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default",
                              "rope_theta": float(meta.get("rope.freq_base", default_theta))}
    kind = meta.get("rope.scaling.type", "none")
    factor = meta.get("rope.scaling.factor")
    if kind == "linear" and factor is not None and float(factor) != 1.0:
        params.update(rope_type="linear", factor=float(factor))
    elif kind not in ("none", "linear"):
        raise ValueError(f"{arch} GGUF: {arch}.rope.scaling.type {kind!r} is not supported "
                         "(Gemma uses linear scaling)")
    return params


def gemma_config_from_gguf(config: Any, path: str) -> Any:
    """A Gemma2Config / Gemma3TextConfig with every field the GGUF file decides."""
    from transformers import Gemma2Config, Gemma3TextConfig

    arch = "gemma2" if config.model_type == "gemma2" else "gemma3"
    meta = _read_metadata(path, arch)
    layers = int(config.num_hidden_layers)
    head_dim = int(meta.get("attention.key_length") or config.head_dim)
    value_dim = meta.get("attention.value_length")
    if value_dim is not None and int(value_dim) != head_dim:
        raise ValueError(f"{arch} GGUF {path!r}: attention.value_length {value_dim} differs from "
                         f"attention.key_length {head_dim}; Gemma needs them equal")
    window = int(meta.get("attention.sliding_window") or 0) or None
    heads = int(config.num_attention_heads)
    fields = {k: v for k, v in config.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version", "rope_theta",
                           "rope_parameters", "rope_scaling", "layer_types",
                           "sliding_window_pattern", "attn_logit_softcapping")}
    softcap = meta.get("final_logit_softcapping")
    attn_softcap = meta.get("attn_logit_softcapping")
    fields.update(
        head_dim=head_dim, sliding_window=window,
        query_pre_attn_scalar=(int(config.hidden_size) // heads
                               if layers == _27B_LAYERS[arch] else head_dim),
        final_logit_softcapping=float(softcap) if softcap else None,
        layer_types=gemma_layer_types(arch, layers, window,
                                      meta.get("attention.sliding_window_pattern")))
    if arch == "gemma2":
        out = Gemma2Config(**fields, attn_logit_softcapping=(float(attn_softcap) if attn_softcap
                                                             else None),
                           rope_parameters=_global_rope(meta, arch, 10000.0))
        out.architectures = ["Gemma2ForCausalLM"]
        return out
    if attn_softcap:
        raise ValueError(f"gemma3 GGUF {path!r} sets gemma3.attn_logit_softcapping; Gemma 3 has "
                         "no attention soft-capping")
    sliding = {"rope_type": "default",
               "rope_theta": float(meta.get("rope.freq_base_swa", 10000.0))}
    out = Gemma3TextConfig(**fields, rope_parameters={
        "full_attention": _global_rope(meta, arch, 1_000_000.0), "sliding_attention": sliding})
    out.architectures = ["Gemma3ForCausalLM"]
    return out
