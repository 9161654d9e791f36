"""The attention backend contract and the per-step metadata every backend reads.

KV cache layout, per layer: ``k_cache`` and ``v_cache`` are each
``[num_blocks, block_size, num_kv_heads, head_dim]`` (head_dim contiguous). Token ``t`` of a
request lives in block ``block_table[t // block_size]`` at offset ``t % block_size``; its flat slot
is ``block_id * block_size + offset``.

The batch is flat and unpadded: ``num_tokens`` query tokens, sequences laid out one after another
(``query_start_loc`` = cu_seqlens_q). Sequence ``i`` has ``seq_lens[i]`` tokens in total (context
already in the cache + its new tokens); its new tokens are the last ``query_lens[i]`` of those, so
they sit at positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`` and attend causally.
A decode token has query_len 1; a prefill chunk has query_len > 1, with or without context.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagellm.attention.kv_quant import KVQuant

# Scratch buffers a backend reuses from step to step, keyed by (slot, dtype, device, inference
# mode). The model runner gives all layers of its model one (they run one after another).
Workspace = dict[tuple[int, torch.dtype, torch.device, bool], torch.Tensor]


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    num_seqs: int
    # [num_tokens] int64: the cache slot each new token's K/V is written to.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: start of each sequence's tokens in the flat batch.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: total length (context + new) of each sequence.
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32, rows padded with 0 past each sequence's blocks.
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that plan on the CPU (lists of python ints).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # True when every sequence has query_len 1 (a pure decode step).
    is_decode_only: bool = False
    # True when every cache slot a sequence has not written (and every padded block-table entry)
    # reads as zero: backends may then skip zeroing gathered padding (the model runner ensures
    # it; tests that fill caches with NaN leave it False).
    padding_is_zero: bool = False
    # What a backend derives once per step for all layers (the CPU backend's plan): kept on the
    # step's metadata, so it dies with the step and is never shared between engines.
    step_plan: Any = None
    # Models whose layers keep KV in several groups (full and sliding-window attention, see
    # core/kv_cache_groups.py): one metadata per group, this one being group 0's; each holds its
    # group's slot_mapping and block_tables. None: one group.
    group_metadata: list[AttentionMetadata] | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV cache group ``group`` (self for group 0 or a one-group model)."""
        if group == 0 or self.group_metadata is None:
            return self
        return self.group_metadata[group]


class AttentionBackend(abc.ABC):
    """Writes the new K/V into the cache, then attends through block tables.

    ``forward`` gets ``query [num_tokens, num_heads, head_dim]``, ``key``/``value``
    ``[num_tokens, num_kv_heads, head_dim]`` for the new tokens only, and returns
    ``[num_tokens, num_heads, head_dim]``. Every new K/V of the batch is written before any
    attention is computed, so a sequence may read blocks another sequence fills in the same step
    (this is how prefix-cache hits on blocks computed in the same step stay correct).

    ``kv_quant`` (attention/kv_quant.py): the layer's cache holds 8-bit values (--kv-cache-dtype);
    K/V are quantized as written and dequantized as read, never as a float copy of the cache.
    """

    name: str = "abstract"

    @classmethod
    def needs_zeroed_blocks(cls, dtype: torch.dtype) -> bool:
        """Whether the model runner should zero each block it hands out (then
        ``padding_is_zero`` holds): backends that gather whole blocks read unwritten slots and
        skip masking them when they read 0. A backend that only ever reads written slots says
        False and saves the memset (~47 MB per 2,048-token prefill step for the default model)."""
        return True

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        """``sliding_window`` W: a query at position p sees keys in (p - W, p] (Hugging Face's
        convention); None: every earlier key. ``logits_soft_cap`` c: scores become
        ``c * tanh(score / c)`` after scaling (Gemma 2); None: no capping."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # Its own until the model runner shares one among its model's layers.
        self.workspace: Workspace = {}

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_quant: KVQuant | None = None,
    ) -> torch.Tensor: ...
