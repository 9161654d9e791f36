"""One step's flat token batch over paged KV: positions and attention metadata from per-sequence
counts (shared by the model runner and the draft-model proposer, spec_decode/draft_model.py).

Sequence ``i`` (row ``rows[i]`` of the persistent block table) runs ``num_sched[i]`` new tokens
after ``num_computed[i]`` cached ones; its tokens sit one after another in the flat batch.
"""

from __future__ import annotations

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata


def flat_positions(num_computed: np.ndarray, num_sched: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(cu, token_seq, positions)``: int64 cu_seqlens ``[n + 1]``, each token's sequence index
    and its position in its sequence (``[total]`` each)."""
    cu = np.zeros(len(num_sched) + 1, dtype=np.int64)
    np.cumsum(num_sched, out=cu[1:])
    token_seq = np.repeat(np.arange(len(num_sched)), num_sched)
    positions = np.arange(int(cu[-1])) - cu[:-1][token_seq] + num_computed[token_seq]
    return cu, token_seq, positions


def paged_attention_metadata(block_table: np.ndarray, rows: np.ndarray, token_rows: np.ndarray,
                             positions: np.ndarray, cu: np.ndarray, num_sched: np.ndarray,
                             seq_lens: np.ndarray, block_size: int, device: torch.device,
                             padding_is_zero: bool) -> AttentionMetadata:
    """The metadata of a flat batch whose K/V go through ``block_table`` (one row per request):
    each token's slot, each sequence's blocks and lengths (``seq_lens``: cached + new)."""
    bs = block_size
    slot_mapping = block_table[token_rows, positions // bs].astype(np.int64) * bs \
        + positions % bs
    max_seq_len = int(seq_lens.max())
    block_tables = block_table[rows, : -(-max_seq_len // bs)]
    return AttentionMetadata(
        num_tokens=int(cu[-1]), num_seqs=len(rows),
        slot_mapping=torch.from_numpy(slot_mapping).to(device, non_blocking=True),
        query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(device, non_blocking=True),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device, non_blocking=True),
        block_tables=torch.from_numpy(np.ascontiguousarray(block_tables)).to(
            device, non_blocking=True),
        max_query_len=int(num_sched.max()), max_seq_len=max_seq_len,
        query_start_loc_cpu=cu.tolist(), seq_lens_cpu=seq_lens.tolist(),
        is_decode_only=bool((num_sched == 1).all()),
        padding_is_zero=padding_is_zero,
    )
