"""A checkpoint tensor that is read from its safetensors file only when, and as far as, needed.

Tensor-parallel weight loaders take a slice of each checkpoint tensor (``narrow`` or ``[a:b]``);
on a ``LazyTensor`` those read just the slice, so each rank reads about 1/N of the sharded weights
instead of every full tensor. Everything else (``dst.copy_(lazy)``, ``lazy.to(...)``) reads the
whole tensor, so loaders written for plain tensors keep working unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

_bytes_read = 0  # this process's total, for the per-rank loading log and tests


def checkpoint_bytes_read() -> int:
    """Bytes materialized from safetensors files by this process so far."""
    return _bytes_read


class LazyTensor:
    """Wraps a safetensors ``PySafeSlice``; quacks like a read-only tensor."""

    __slots__ = ("_slice", "shape")

    def __init__(self, st_slice: Any) -> None:
        self._slice = st_slice
        self.shape = torch.Size(st_slice.get_shape())

    @property
    def dtype(self) -> torch.dtype:
        return _ST_DTYPES[self._slice.get_dtype()]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % self.ndim
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._read(index)

    def __getitem__(self, index: Any) -> torch.Tensor:
        parts = index if isinstance(index, tuple) else (index,)
        if all(isinstance(p, slice) and p.step in (None, 1) for p in parts):
            return self._read(parts)
        return self.materialize()[index]

    def materialize(self) -> torch.Tensor:
        return self._read(...)

    def _read(self, index: Any) -> torch.Tensor:
        global _bytes_read
        t = self._slice[index]
        _bytes_read += t.numel() * t.element_size()
        return t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self._slice.get_dtype()})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        def real(x: Any) -> Any:
            return x.materialize() if isinstance(x, LazyTensor) else x

        return func(*(real(a) for a in args), **{k: real(v) for k, v in (kwargs or {}).items()})
