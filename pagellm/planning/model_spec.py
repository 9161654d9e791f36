"""The shape of a model, read from its config alone: no weights are loaded.

Sources: a Hugging Face folder (its config.json, through transformers as the engine reads it), a
bare config.json (any file name), or a GGUF file, whose header (metadata and tensor table) is read
here directly: transformers' GGUF config path and ``gguf.GGUFReader`` parse every tokenizer string
into objects, which takes seconds; this reader skips them and stops before the tensor data.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

# GGUF metadata value types (the GGUF spec; values as in gguf.constants.GGUFValueType).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class ModelSpec:
    """What the memory arithmetic needs; field meanings follow Hugging Face config names."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    context_len: int  # the model's own limit (the default --max-model-len)
    checkpoint_format: str  # "safetensors", "gguf Q4_1", "config only"
    checkpoint_bytes: int | None = None  # weights as stored (GGUF: quantized), when known
    config_dtype: str | None = None  # the config's torch_dtype ("bfloat16"), read by dtype auto
    engine_supported: bool = True
    qk_norm: bool = False  # an RMSNorm over each head of q and k (Qwen3)
    # Mixture-of-Experts (Mixtral, Qwen3-MoE): experts per MoE layer, how many a token uses,
    # each expert's width, and how many layers are MoE (the others keep the dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: int = 0
    # Each layer's sliding window (None: full attention); empty: all full (unknown family).
    layer_windows: tuple[int | None, ...] = ()
    norms_per_layer: int = 2  # hidden-size RMSNorms per layer (Gemma 2/3: 4)
    # Hybrid models (Qwen3-Next, Qwen3.5, Granite 4, Nemotron-H): the layers with recurrent
    # state instead of KV, the parameters of one such layer's token mixer, and one state
    # slot of one such layer in (model-dtype, float32) elements; all at tensor parallel 1
    # (they split evenly over ranks).
    recurrent_layers: tuple[int, ...] = ()
    recurrent_params: int = 0
    recurrent_state: tuple[int, int] = (0, 0)
    attention_output_gate: bool = False  # q_proj also yields a gate per head (Qwen3-Next)
    shared_expert_intermediate_size: int = 0  # a shared expert beside the routed ones

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, hf_config: Any, name: str, checkpoint_format: str = "safetensors",
                       checkpoint_bytes: int | None = None) -> ModelSpec:
        """From a transformers config (or any object with its attribute names); defaults and
        biases are those of the engine's ModelConfig and model classes."""
        from pagellm.config import hf_config_dtype, model_context_len
        from pagellm.models.registry import get_model_cls

        c = hf_config
        heads = int(c.num_attention_heads)
        try:
            model_cls: Any = get_model_cls(c)
            qkv_bias, o_bias = model_cls.attention_bias(c)
            arch, supported = model_cls.__name__, True
            qk_norm = bool(getattr(model_cls, "qk_norm", False))
            moe = getattr(model_cls, "moe_layout", None)
            experts, top_k, moe_inter, moe_layers = moe(c) if moe else (0, 0, 0, 0)
            windows = tuple(model_cls.layer_sliding_windows(c))
            norms = int(getattr(model_cls, "norms_per_layer", 2))
            hybrid = hybrid_fields(model_cls, c)
        except ValueError:
            experts, top_k, moe_inter, moe_layers, windows, norms = 0, 0, 0, 0, (), 2
            hybrid = {}
            bias = bool(getattr(c, "attention_bias", False))
            qkv_bias, o_bias, supported, qk_norm = bias, bias, False, False
            arch = (getattr(c, "architectures", None) or [getattr(c, "model_type", "?")])[0]
        dtype = hf_config_dtype(c)
        return cls(
            name=name, architecture=arch, vocab_size=int(c.vocab_size),
            hidden_size=int(c.hidden_size),
            intermediate_size=int(getattr(c, "intermediate_size", 0) or 0),  # all-MoE: none
            num_layers=int(c.num_hidden_layers), num_heads=heads,
            num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=bool(getattr(c, "mlp_bias", False)),
            context_len=model_context_len(c), checkpoint_format=checkpoint_format,
            checkpoint_bytes=checkpoint_bytes, engine_supported=supported, qk_norm=qk_norm,
            num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_inter,
            moe_layers=moe_layers, layer_windows=windows, norms_per_layer=norms,
            config_dtype=str(dtype).removeprefix("torch.") if dtype else None, **hybrid)


def hybrid_fields(model_cls: Any, c: Any) -> dict[str, Any]:
    """ModelSpec's hybrid-model fields, from the model class (empty for other models)."""
    layers = tuple(model_cls.recurrent_layers(c))
    fields: dict[str, Any] = {
        "attention_output_gate": bool(getattr(model_cls, "attention_output_gate", False)),
        "shared_expert_intermediate_size":
            int(getattr(c, "shared_expert_intermediate_size", 0) or 0)}
    if not layers:
        return fields
    shapes = model_cls.recurrent_state_shapes(c, 1)
    state = (sum(math.prod(sh) for sh, fp32 in shapes if not fp32),
             sum(math.prod(sh) for sh, fp32 in shapes if fp32))
    return dict(fields, recurrent_layers=layers,
                recurrent_params=int(model_cls.recurrent_layer_params(c)),
                recurrent_state=state)


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the innermost (HF's last) dimension
    type_name: str
    n_bytes: int


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.read("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        """Scalars and strings are read; arrays are skipped and reported by length."""
        if vtype in _SCALARS:
            return self.read(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"GGUF metadata value type {vtype} is unknown")
        etype, count = self.read("<I"), self.read("<Q")
        if etype in _SCALARS:
            size = struct.calcsize(_SCALARS[etype])
            if count <= 64:  # short arrays (per-layer values) are worth reading
                return [self.read(_SCALARS[etype]) for _ in range(count)]
            self.pos += size * count
        else:
            for _ in range(count):
                self.value(etype)
        return SimpleNamespace(array_len=count)


def read_gguf_header(path: str) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    """Metadata (long arrays as ``array_len`` only) and the tensor table of a GGUF file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"--model {path!r} is not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.read("<I")
        if version not in (2, 3):
            raise ValueError(f"--model {path!r}: GGUF version {version} is not supported "
                             "(little-endian v2/v3 only)")
        num_tensors, num_kv = cur.read("<Q"), cur.read("<Q")
        meta: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            meta[key] = cur.value(cur.read("<I"))
        tensors: dict[str, GGUFTensorInfo] = {}
        for _ in range(num_tensors):
            name = cur.string()
            dims = tuple(cur.read("<Q") for _ in range(cur.read("<I")))
            qtype = GGMLQuantizationType(cur.read("<I"))
            cur.read("<Q")  # offset into the data section
            n = 1
            for d in dims:
                n *= d
            block, type_size = GGML_QUANT_SIZES[qtype]
            tensors[name] = GGUFTensorInfo(name, dims, qtype.name, n // block * type_size)
    return meta, tensors


def gguf_model_spec(path: str) -> ModelSpec:
    meta, tensors = read_gguf_header(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"--model {path!r}: GGUF metadata has no general.architecture")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if isinstance(value, list | SimpleNamespace):
            raise ValueError(f"--model {path!r}: per-layer {arch}.{name} is not supported")
        return value

    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"--model {path!r}: GGUF file has no token_embd.weight")
    heads = key("attention.head_count")
    config = SimpleNamespace(
        model_type=arch, architectures=None, vocab_size=embd.dims[1], hidden_size=embd.dims[0],
        intermediate_size=key("feed_forward_length"), num_hidden_layers=key("block_count"),
        num_attention_heads=heads, num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length"), max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors, mlp_bias="blk.0.ffn_up.bias" in tensors)
    experts = key("expert_count", 0)
    if experts:  # MoE files, as the loader reads them (pagellm/models/gguf_loader.py)
        config.num_experts_per_tok = key("expert_used_count")
        if arch == "qwen3moe":  # every layer sparse, experts of expert_feed_forward_length
            config.model_type, config.num_experts = "qwen3_moe", experts
            config.moe_intermediate_size = key("expert_feed_forward_length")
        else:  # Mixtral: a "llama" file with experts of feed_forward_length
            config.model_type, config.num_local_experts = "mixtral", experts
    if arch in ("gemma2", "gemma3"):  # windows per layer, as pagellm/models/gguf_gemma.py
        from pagellm.models.gguf_gemma import gemma_layer_types

        config.model_type = "gemma2" if arch == "gemma2" else "gemma3_text"
        config.sliding_window = int(key("attention.sliding_window", 0)) or None
        config.layer_types = gemma_layer_types(
            arch, int(config.num_hidden_layers), config.sliding_window,
            meta.get(f"{arch}.attention.sliding_window_pattern"))
    types = sorted({t.type_name for t in tensors.values()},
                   key=lambda t: -sum(x.n_bytes for x in tensors.values() if x.type_name == t))
    name = os.path.basename(path).removesuffix(".gguf")
    return ModelSpec.from_hf_config(config, name, f"gguf {'/'.join(types)}",
                                    sum(t.n_bytes for t in tensors.values()))


def _hf_config_file(path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def load_model_spec(model: str | None) -> tuple[ModelSpec, str]:
    """``--model`` (None = the default GGUF) -> (spec, the resolved path). HF folders and bare
    config files go through transformers' AutoConfig, exactly as the engine reads them."""
    from pagellm.models.loader import resolve_model_source

    path = os.path.expanduser(model) if model else None
    if path and os.path.isfile(path) and path.endswith(".json"):
        name = os.path.basename(path).removesuffix(".json")
        if name == "config":
            name = os.path.basename(os.path.dirname(os.path.abspath(path)))
        return ModelSpec.from_hf_config(_hf_config_file(path), name, "config only"), path
    source = resolve_model_source(model)
    if source.kind == "gguf":
        return gguf_model_spec(source.gguf_path), source.gguf_path
    files = [os.path.join(source.path, f) for f in os.listdir(source.path)
             if f.endswith((".safetensors", ".bin"))]
    stored = sum(os.path.getsize(f) for f in files) or None
    spec = ModelSpec.from_hf_config(_hf_config_file(source.path),
                                    os.path.basename(source.path.rstrip("/")),
                                    "safetensors" if files else "config only", stored)
    return spec, source.path
