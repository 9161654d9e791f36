"""Attention backend lookup by name: "cpu" (C++ kernels), "torch" (reference), "triton" (CUDA),
"auto" (triton on CUDA, cpu on CPU).

The triton backend is imported only when asked for, so ``import pagellm`` works without triton.
"""

from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionBackend

BACKEND_NAMES = ("auto", "cpu", "torch", "triton")

# For layers used outside an engine (tests, scripts): an engine names its backend on every
# layer of its model (the model runner), so engines neither read nor change this.
_default_backend = "auto"


def set_default_backend(name: str) -> None:
    """Backend of ``Attention`` layers that name none and belong to no engine."""
    global _default_backend
    _check_name(name)
    _default_backend = name


def _check_name(name: str) -> None:
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"unknown attention backend {name!r} (--attention-backend must be one of "
            f"{', '.join(BACKEND_NAMES)})"
        )


def _import_triton() -> type[AttentionBackend]:
    from pagellm.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


def get_attn_backend_cls(name: str | None, device: torch.device | str) -> type[AttentionBackend]:
    """The backend class for ``name`` (None: ``set_default_backend``'s) on ``device``."""
    name = name or _default_backend
    _check_name(name)
    device = torch.device(device)
    if name == "torch":
        from pagellm.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        # Falls back to the torch path by itself where the kernels cannot run.
        from pagellm.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend
    if name == "triton":
        try:
            return _import_triton()
        except ImportError as e:
            raise ValueError(f"--attention-backend triton is unavailable: {e}") from e
    if device.type == "cuda":
        try:
            return _import_triton()
        except ImportError:
            pass
    from pagellm.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend
