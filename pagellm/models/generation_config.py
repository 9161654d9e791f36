"""The model's generation_config.json, read as vLLM reads it.

Two things come from it: every EOS id it lists (with config.json's), which all stop generation,
and the model creator's sampling defaults (temperature, top_p, top_k, min_p,
repetition_penalty), which apply where a request leaves them unset. ``--generation-config``:
"auto" (default) reads the model's file, "vllm" ignores its sampling defaults (its EOS ids still
count, as in vLLM), a folder reads that folder's generation_config.json instead.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm")

GENERATION_CONFIG_MODES = ("auto", "vllm")
FILE_NAME = "generation_config.json"
# The fields vLLM takes from the file as defaults (get_diff_sampling_param).
DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationConfig:
    """What the engine took from generation_config.json (and config.json's eos_token_id)."""

    path: str | None = None  # the file read; None when there was none
    eos_token_ids: tuple[int, ...] = ()  # in file order; the tokenizer's EOS is added apart
    defaults: dict[str, Any] = field(default_factory=dict)  # empty with "vllm"

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (vLLM's get_default_sampling_params)."""
        return SamplingParams(**self.defaults)


def _eos_ids(value: Any) -> list[int]:
    """eos_token_id as a list: it may be an int, a list of ints, or absent."""
    items = value if isinstance(value, list | tuple) else [value]
    return [v for v in items if isinstance(v, int) and not isinstance(v, bool)]


def _find_file(mode: str, source: Any) -> str | None:
    if mode not in GENERATION_CONFIG_MODES:
        folder = os.path.expanduser(mode)
        path = os.path.join(folder, FILE_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"--generation-config must be auto, vllm, or a folder holding {FILE_NAME}; "
                f"got {mode!r}, " + ("which has no " + FILE_NAME if os.path.isdir(folder)
                                     else "which is not a folder") + ".")
        return path
    folders = [source.path]
    if source.kind == "gguf":
        # The converted HF folder has one only if someone put it there; GGUF metadata carries
        # the EOS id, which reaches the tokenizer and config.json.
        from pagellm.models import gguf_cache

        cached = gguf_cache.cached_folder(source.gguf_path, gguf_cache.CONFIG)
        folders = [cached, source.path] if cached else folders
    for folder in folders:
        path = os.path.join(folder, FILE_NAME)
        if os.path.isfile(path):
            return path
    return None


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} (--generation-config): {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} (--generation-config) must hold a JSON object.")
    return data


def _valid_defaults(data: dict[str, Any], path: str) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    for name in DEFAULT_FIELDS:
        value = data.get(name)
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except (TypeError, ValueError) as e:
            # A value this engine cannot run must not stop the model from serving.
            logger.warning("Ignoring %s from %s: %s", name, path, e)
            continue
        defaults[name] = value
    return defaults


def load_generation_config(mode: str, source: Any, hf_config: Any) -> GenerationConfig:
    """Read the generation config ``--generation-config`` names (ValueError naming the flag
    for a bad value or path). ``source``: the model's ModelSource; ``hf_config``: its config."""
    if not isinstance(mode, str) or not mode:
        raise ValueError(f"--generation-config must be auto, vllm, or a folder holding "
                         f"{FILE_NAME}; got {mode!r}.")
    path = _find_file(mode, source)
    data = _read(path) if path is not None else {}
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
    eos: list[int] = []
    for t in _eos_ids(data.get("eos_token_id")) + _eos_ids(getattr(hf_config, "eos_token_id",
                                                                    None)):
        if t in eos:
            continue
        if not 0 <= t < vocab:
            logger.warning("Ignoring EOS token id %d: outside the vocabulary (size %d)", t, vocab)
            continue
        eos.append(t)
    defaults = _valid_defaults(data, path) if path is not None and mode != "vllm" else {}
    if defaults:
        logger.info("Default sampling parameters from the model's %s: %s (a request's own "
                    "values win; --generation-config vllm ignores them)", path,
                    ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return GenerationConfig(path=path, eos_token_ids=tuple(eos), defaults=defaults)


def extra_stop_ids(params: SamplingParams, generation: GenerationConfig | None,
                   eos_token_id: int | None) -> SamplingParams:
    """``params`` with the model's other EOS ids added to stop_token_ids (as vLLM's
    update_from_generation_config): they stop generation, and are blocked under min_tokens,
    like the tokenizer's EOS. Unchanged with ignore_eos or nothing to add."""
    if generation is None or params.ignore_eos:
        return params
    have = params.stop_token_ids or []
    missing = [t for t in generation.eos_token_ids if t != eos_token_id and t not in have]
    if not missing:
        return params
    return params.clone(stop_token_ids=[*have, *missing])
