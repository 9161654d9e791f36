"""The CUDA attention backend: Triton kernels reading the paged KV cache in place.

Importing this module imports triton; the backend registry imports it only when "triton" is
chosen, so ``import pagellm`` works where triton is missing. On CPU tensors the kernels run
only under ``TRITON_INTERPRET=1`` (that is how the tests exercise them).
"""

from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.attention.kv_quant import KVQuant
from pagellm.attention.triton_kernels import paged_attention, reshape_and_cache

# Split decode keys into segments while (sequence, kv head) programs number fewer than this many
# per streaming multiprocessor: few programs cannot saturate HBM bandwidth.
_MIN_PROGRAMS_PER_SM = 2
_MAX_SEGMENTS = 16
_TILE = 32


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_segments(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, decode_only: bool
) -> int:
    """Key segments per sequence for one launch: 1 unless a decode step would underfill the GPU."""
    if not decode_only:
        return 1
    want = _MIN_PROGRAMS_PER_SM * num_sms
    programs = max(num_seqs * num_kv_heads, 1)
    segments = 1
    # Each segment should keep at least two tiles of keys, or the merge costs more than it saves.
    while (
        segments < _MAX_SEGMENTS
        and programs * segments < want
        and max_seq_len >= 4 * _TILE * segments
    ):
        segments *= 2
    return segments


class TritonAttentionBackend(AttentionBackend):
    """Paged attention for a mixed flat batch (prefill chunks and decode tokens) in one launch.

    ``forward`` first stores every new K/V of the batch (one kernel), then runs the unified
    paged-attention kernel, which reads K/V through the block tables without gathering them.

    Capture-safe (decode CUDA graphs, worker/cuda_graphs.py): ``forward`` reads only the Python
    ints of ``meta`` (fixed per graph bucket, so the segment count is too) and never tensor data
    on the host; keep it that way.
    """

    name = "triton"

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        super().__init__(num_heads, head_dim, num_kv_heads, scale, sliding_window,
                         logits_soft_cap)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self._num_sms: int | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_quant: KVQuant | None = None,
    ) -> torch.Tensor:
        shape = query.shape
        query = query.view(-1, self.num_heads, self.head_dim)
        key = key.view(-1, self.num_kv_heads, self.head_dim)
        value = value.view(-1, self.num_kv_heads, self.head_dim)
        n = meta.num_tokens
        assert kv_quant is not None or query.dtype == k_cache.dtype, \
            "query and KV cache dtypes differ"
        # All stores land before any attention: a sequence may read blocks filled this step.
        reshape_and_cache(key[:n], value[:n], k_cache, v_cache, meta.slot_mapping[:n], kv_quant)
        out = torch.empty_like(query)
        if query.shape[0] > n:  # rows padded past the batch (e.g. to a graph size) stay defined
            out[n:].zero_()
        if self._num_sms is None:
            self._num_sms = _num_sms(query.device)
        segments = choose_num_segments(
            meta.num_seqs,
            self.num_kv_heads,
            meta.max_seq_len,
            self._num_sms,
            meta.is_decode_only or meta.max_query_len == 1,
        )
        paged_attention(
            query[:n],
            k_cache,
            v_cache,
            out[:n],
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.num_seqs,
            meta.max_query_len,
            self.scale,
            num_segments=segments,
            tile_size=_TILE,
            sliding_window=self.sliding_window,
            soft_cap=self.logits_soft_cap,
            kv_quant=kv_quant,
        )
        return out.view(shape)
