"""A converted copy of a GGUF model as a Hugging Face folder, made once and reused.

Reading a GGUF's config and tokenizer through transformers and dequantizing its tensors costs
tens of seconds on a small CPU; the result never changes for the same file. The first start
writes config.json, the tokenizer files and the dequantized float32 weights (safetensors) under
``$PAGELLM_CACHE_DIR`` (default ``~/.cache/pagellm``), keyed by the file's path, size and mtime;
later starts load that folder in about a second. ``PAGELLM_NO_GGUF_CACHE=1`` turns it off; an
unwritable cache directory is skipped with a warning, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Any

from pagellm.config import read_env

logger = logging.getLogger("pagellm")

# "3": phi3 configs gained their longrope factors (older cached ones lack them).
# "4": MoE files: Mixtral configs (cached before as dense Llama ones), Qwen3-MoE expert widths.
# "5": Gemma 2/3 configs (soft-capping, layer types, attention scale, rope per layer type).
_FORMAT_VERSION = "5"


def cache_root() -> str:
    env = read_env()
    if env.cache_dir:
        return env.cache_dir
    base = env.xdg_cache_home or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagellm")


def cache_enabled() -> bool:
    return read_env().gguf_cache


def cache_dir_for(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}:{_FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return os.path.join(cache_root(), "gguf", digest)


# The three parts, each written on its own (so `pagellm plan` never converts weights).
CONFIG, TOKENIZER, WEIGHTS = "config", "tokenizer", "weights"
_MARKERS = {CONFIG: "config.json", TOKENIZER: "tokenizer.done", WEIGHTS: "model.safetensors"}


def cached_folder(gguf_path: str, part: str) -> str | None:
    """The converted folder for ``gguf_path`` if it holds ``part``, else None."""
    if not cache_enabled():
        return None
    folder = cache_dir_for(gguf_path)
    return folder if os.path.isfile(os.path.join(folder, _MARKERS[part])) else None


def save_part(gguf_path: str, part: str, write: Any) -> None:
    """Run ``write(tmp_folder)`` and move what it wrote into the cache folder, atomically per
    file, with the part's marker last. Failures only log a warning."""
    if not cache_enabled():
        return
    folder = cache_dir_for(gguf_path)
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=folder)
    except OSError as e:
        logger.warning("GGUF cache disabled: cannot write under %s (%s)", cache_root(), e)
        return
    try:
        write(tmp)
        if part == TOKENIZER:
            open(os.path.join(tmp, _MARKERS[TOKENIZER]), "w").close()
        marker = _MARKERS[part]
        names = sorted(os.listdir(tmp), key=lambda n: n == marker)  # marker moved last
        for name in names:
            os.replace(os.path.join(tmp, name), os.path.join(folder, name))
        if part == WEIGHTS:
            logger.info("Saved the dequantized weights of %s in %s; later starts load them "
                        "directly", os.path.basename(gguf_path), folder)
    except OSError as e:
        logger.warning("GGUF cache not written (%s); the GGUF file is read again next time", e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_weights(gguf_path: str, weights: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    def write(tmp: str) -> None:
        save_file({k: v.contiguous() for k, v in weights.items()},
                  os.path.join(tmp, _MARKERS[WEIGHTS]), metadata={"format": "pt"})
        with open(os.path.join(tmp, "pagellm-source.json"), "w") as f:
            json.dump({"source": os.path.abspath(gguf_path), "version": _FORMAT_VERSION}, f)

    save_part(gguf_path, WEIGHTS, write)
