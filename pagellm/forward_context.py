"""Per-step attention metadata, set by the model runner and read by attention layers.

Models never see block tables: the runner enters ``set_forward_context(meta, kv_caches)`` around
the forward pass and every ``Attention`` layer calls ``get_forward_context()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagellm.attention.backend import AttentionMetadata
    from pagellm.attention.kv_quant import KVQuant
    from pagellm.attention.state_metadata import StateMetadata


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    # One (k_cache, v_cache) pair per layer, indexed by the layer's index.
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # With an 8-bit --kv-cache-dtype, each layer's quantization state (scales) beside its
    # caches, indexed like them; None: float caches.
    kv_quant: list[KVQuant] | None = None
    # Models with recurrent layers: each such layer's state tensors by layer index
    # (worker/state_cache.py), and which slot each sequence uses; None without metadata (a
    # profiling run: the batch is one sequence from zero state) or without such layers.
    state_caches: dict[int, tuple[torch.Tensor, ...]] | None = None
    state_metadata: StateMetadata | None = None


_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _context is not None, "attention called outside set_forward_context()"
    return _context


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    kv_quant: list[KVQuant] | None = None,
    state_caches: dict[int, tuple[torch.Tensor, ...]] | None = None,
    state_metadata: StateMetadata | None = None,
) -> Iterator[None]:
    global _context
    prev = _context
    _context = ForwardContext(attn_metadata, kv_caches, kv_quant, state_caches, state_metadata)
    try:
        yield
    finally:
        _context = prev
