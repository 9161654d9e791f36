"""Checkpoint readers (Hugging Face folders) and random weights for tests."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def _checkpoint_files(folder: str) -> list[str]:
    """The safetensors files of ``folder``, as its index names them when it has one."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    # Mistral repos ship a consolidated.safetensors (other tensor names) next to the HF shards.
    hf_names = [n for n in names if not n.startswith("consolidated")]
    return [os.path.join(folder, n) for n in (hf_names or names)]


def safetensors_weights_iterator(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint in ``folder``.

    Safetensors tensors come as ``LazyTensor``: a tensor-parallel weight_loader that narrows or
    slices one reads only its rank's slice from the file; any other use reads the whole tensor.
    Use each one before the iterator moves on (its file closes behind it).
    Falls back to ``pytorch_model*.bin`` files (loaded with ``weights_only=True``).
    """
    from safetensors import safe_open

    from pagellm.models.lazy_tensor import LazyTensor

    files = _checkpoint_files(folder)
    if files:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, LazyTensor(f.get_slice(name))  # type: ignore[misc]
        return
    bins = sorted(n for n in os.listdir(folder) if n.startswith("pytorch_model")
                  and n.endswith(".bin"))
    if not bins:
        raise ValueError(f"no *.safetensors (or pytorch_model*.bin) weights in {folder!r} "
                         "(--model); use --load-format dummy for random weights")
    for name in bins:
        state = torch.load(os.path.join(folder, name), map_location="cpu", weights_only=True,
                           mmap=True)
        yield from state.items()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter with seeded N(0, std) noise; 1-D norm weights get 1 + noise."""
    for name, param in model.named_parameters():
        gen = torch.Generator(device=param.device)
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        noise = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        noise.normal_(0.0, std, generator=gen)
        if param.dim() == 1 and "norm" in name:
            noise += 1.0
        param.data.copy_(noise)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make ``dtype`` the default, so parameters are created in it directly."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
