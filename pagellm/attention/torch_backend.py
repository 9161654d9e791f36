"""Paged attention in plain torch: the CPU path and the oracle other backends are tested against.

One step: write every new K/V into its cache slot (one vectorized index_copy_), then attend.
Pure-decode sequences are batched: their blocks are gathered through the block tables into a
padded ``[B, Lmax, Hkv, D]`` tensor and attended by one SDPA call. Prefill chunks (query_len > 1)
run one by one with a causal mask shifted by their context length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.attention.backend import AttentionBackend, AttentionMetadata


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """SDPA on ``[B, H, L, D]`` tensors; K/V may have fewer heads (GQA)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention of ``q [T, H, D]`` over ``k/v [T, Hkv, D]`` as one sequence, no cache."""
    out = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                scale, is_causal=True)
    return out[0].transpose(0, 1)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``key/value [T, Hkv, D]`` at flat slots ``slot_mapping [T]`` of the caches."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    slots = slot_mapping.to(torch.long)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def split_decode_prefill(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """The step's sequences with one new token (decodes) and with more (prefill chunks)."""
    if meta.is_decode_only:
        return list(range(meta.num_seqs)), []
    starts = meta.query_start_loc_cpu
    decode_seqs: list[int] = []
    prefill_seqs: list[int] = []
    for i in range(meta.num_seqs):
        (decode_seqs if starts[i + 1] - starts[i] == 1 else prefill_seqs).append(i)
    return decode_seqs, prefill_seqs


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = meta.num_tokens
        write_kv_cache(key[:num_tokens], value[:num_tokens], k_cache, v_cache,
                       meta.slot_mapping[:num_tokens])
        out = torch.empty_like(query)
        starts = meta.query_start_loc_cpu
        seq_lens = meta.seq_lens_cpu
        decode_seqs, prefill_seqs = split_decode_prefill(meta)
        for group in _length_buckets(decode_seqs, seq_lens):
            self._decode(query, k_cache, v_cache, meta, group, out)
        for i in prefill_seqs:
            start, end = starts[i], starts[i + 1]
            out[start:end] = self._prefill(query[start:end], k_cache, v_cache,
                                           meta.block_tables[i], seq_lens[i])
        return out

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``block_tables [B, nb]`` as ``[B, nb * block_size, Hkv, D]`` each.

        NOTE: index_select of whole rows into a reused buffer; advanced indexing (``cache[ids]``)
        copies element by element and a fresh allocation per layer costs page faults, together
        far slower on CPU. The buffers are only valid until the next layer's call."""
        num_seqs, num_blocks = block_tables.shape
        block_numel = k_cache[0].numel()
        ids = block_tables.reshape(-1).long()
        out = []
        for i, cache in enumerate((k_cache, v_cache)):
            buf = self._workspace(i, ids.numel() * block_numel, cache)
            rows = buf.view(ids.numel(), block_numel)
            torch.index_select(cache.view(cache.shape[0], block_numel), 0, ids, out=rows)
            out.append(rows.view(num_seqs, num_blocks * cache.shape[1], *cache.shape[2:]))
        return out[0], out[1]

    def _workspace(self, slot: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        # Shared by every layer of an engine's model: layers run one after another and each
        # consumes its gathered K/V before the next one gathers.
        buffers = self.workspace
        # A buffer made under inference mode cannot be written outside it (tests mix both).
        key = (slot, like.dtype, like.device, torch.is_inference_mode_enabled())
        buf = buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, int(1.25 * (buf.numel() if buf is not None else 0))),
                              dtype=like.dtype, device=like.device)
            buffers[key] = buf
        return buf[:numel]

    def _decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, seqs: list[int], out: torch.Tensor) -> None:
        device = query.device
        block_size = k_cache.shape[1]
        max_len = max(meta.seq_lens_cpu[i] for i in seqs)
        num_blocks = -(-max_len // block_size)
        if len(seqs) == meta.num_seqs:
            token_idx = None
            block_tables = meta.block_tables[:, :num_blocks]
            seq_lens = meta.seq_lens
        else:
            seq_idx = torch.tensor(seqs, device=device)
            token_idx = torch.tensor([meta.query_start_loc_cpu[i] for i in seqs], device=device)
            block_tables = meta.block_tables[seq_idx, :num_blocks]
            seq_lens = meta.seq_lens[seq_idx]
        k, v = self._gather(k_cache, v_cache, block_tables)  # [B, Lmax, Hkv, D]
        valid = torch.arange(k.shape[1], device=device)[None, :] < seq_lens[:, None].long()
        if not meta.padding_is_zero:
            # NOTE: padding slots may hold anything (NaN included): zero them by selection so a
            # masked position contributes exactly 0, then mask them out of the softmax.
            invalid = ~valid[:, :, None, None]
            k.masked_fill_(invalid, 0)
            v.masked_fill_(invalid, 0)
        q = query[: meta.num_tokens] if token_idx is None else query[token_idx]
        o = _sdpa(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), self.scale,
                  mask=valid[:, None, None, :])
        o = o[:, :, 0, :]
        if token_idx is None:
            out[: meta.num_tokens] = o
        else:
            out[token_idx] = o

    def _prefill(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        block_size = k_cache.shape[1]
        query_len = query.shape[0]
        context_len = seq_len - query_len
        blocks = block_table[None, : -(-seq_len // block_size)]
        k, v = self._gather(k_cache, v_cache, blocks)
        k = k[0, :seq_len].transpose(0, 1)[None]  # [1, Hkv, S, D]
        v = v[0, :seq_len].transpose(0, 1)[None]
        q = query.transpose(0, 1)[None]
        if context_len == 0:
            o = _sdpa(q, k, v, self.scale, is_causal=True)
        else:
            device = query.device
            q_pos = torch.arange(context_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            o = _sdpa(q, k, v, self.scale, mask=mask)
        return o[0].transpose(0, 1)


def _length_buckets(seqs: list[int], seq_lens: list[int], max_buckets: int = 4,
                    min_bucket: int = 8) -> list[list[int]]:
    """Split decode sequences into groups of similar length (sorted, equal counts), so that the
    padded K/V gather of each group wastes little; small batches stay one group."""
    if len(seqs) < 2 * min_bucket:
        return [seqs] if seqs else []
    ordered = sorted(seqs, key=lambda i: seq_lens[i])
    n = min(max_buckets, len(ordered) // min_bucket)
    size = -(-len(ordered) // n)
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]
