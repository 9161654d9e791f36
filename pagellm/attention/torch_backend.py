"""Paged attention in plain torch: the CPU path and the oracle other backends are tested against.

One step: write every new K/V into its cache slot (one vectorized index_copy_), then attend.
Pure-decode sequences are batched: their blocks are gathered through the block tables into a
padded ``[B, Lmax, Hkv, D]`` tensor and attended by one SDPA call. Prefill chunks (query_len > 1)
run one by one with a causal mask shifted by their context length. A quantized cache
(``kv_quant``, attention/kv_quant.py) is written quantized and only the gathered blocks are
dequantized; a float cache of another dtype than the query's is converted as gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.attention.kv_quant import KVQuant, dequantize, write_kv_quant


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """SDPA on ``[B, H, L, D]`` tensors; K/V may have fewer heads (GQA)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         soft_cap: float, mask: torch.Tensor | None = None,
                         is_causal: bool = False) -> torch.Tensor:
    """Attention on ``[B, H, L, D]`` tensors with scores capped to ``soft_cap * tanh(s /
    soft_cap)`` (SDPA has no capping); fp32 scores and softmax, as transformers' eager path."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           mask: torch.Tensor | None = None, is_causal: bool = False,
           soft_cap: float | None = None) -> torch.Tensor:
    """SDPA, or the soft-capped path when ``soft_cap`` is set; ``[B, H, L, D]`` tensors."""
    if soft_cap is None:
        return _sdpa(q, k, v, scale, mask, is_causal)
    return softcapped_attention(q, k, v, scale, soft_cap, mask, is_causal)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor,
                sliding_window: int | None) -> torch.Tensor:
    """``[Lq, Lk]`` bool: key position k_pos[j] is visible to query position q_pos[i], causally
    and, with a window W, only when ``k > q - W`` (transformers' sliding_window_overlay)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     sliding_window: int | None = None,
                     soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of ``q [T, H, D]`` over ``k/v [T, Hkv, D]`` as one sequence, no cache."""
    mask = None
    if sliding_window is not None and sliding_window < q.shape[0]:
        pos = torch.arange(q.shape[0], device=q.device)
        mask = window_mask(pos, pos, sliding_window)
    out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                 scale, mask=mask, is_causal=mask is None, soft_cap=soft_cap)
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
        kv_quant: KVQuant | None = None,
    ) -> torch.Tensor:
        num_tokens = meta.num_tokens
        if kv_quant is not None:
            write_kv_quant(key[:num_tokens], value[:num_tokens], k_cache, v_cache,
                           meta.slot_mapping[:num_tokens], kv_quant)
        else:
            write_kv_cache(key[:num_tokens], value[:num_tokens], k_cache, v_cache,
                           meta.slot_mapping[:num_tokens])
        out = torch.empty_like(query)
        starts = meta.query_start_loc_cpu
        seq_lens = meta.seq_lens_cpu
        decode_seqs, prefill_seqs = split_decode_prefill(meta)
        for group in _length_buckets(decode_seqs, seq_lens):
            self._decode(query, k_cache, v_cache, meta, group, out, kv_quant)
        for i in prefill_seqs:
            start, end = starts[i], starts[i + 1]
            out[start:end] = self._prefill(query[start:end], k_cache, v_cache,
                                           meta.block_tables[i], seq_lens[i], kv_quant)
        return out

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                dtype: torch.dtype | None = None, quant: KVQuant | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``block_tables [B, nb]`` as ``[B, nb * block_size, Hkv, D]`` each, in
        ``dtype`` (None: the cache's); a quantized cache's blocks (``quant``) dequantized.

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
        if quant is not None:
            out = [dequantize(x, self._gather_scales(table, ids, x.shape[:3]), quant, which)
                   for x, table, which in ((out[0], quant.k_scales, "k"),
                                           (out[1], quant.v_scales, "v"))]
        if dtype is not None and out[0].dtype != dtype:
            out = [x.to(dtype) for x in out]
        return out[0], out[1]

    @staticmethod
    def _gather_scales(table: torch.Tensor | None, ids: torch.Tensor,
                       shape: torch.Size) -> torch.Tensor | None:
        """The per-(token, head) scales of the gathered blocks, ``[B, nb * block_size, Hkv]``."""
        return None if table is None else table.index_select(0, ids).view(shape)

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
                meta: AttentionMetadata, seqs: list[int], out: torch.Tensor,
                quant: KVQuant | None = None) -> None:
        device = query.device
        block_size = k_cache.shape[1]
        window = self.sliding_window
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
        seq_lens = seq_lens.long()
        first_pos = None  # position of each row's first gathered key (0 without a window)
        if window is not None and max_len > window:
            # Gather only the blocks that hold the window: those before it may have been freed
            # (core/kv_cache_groups.py) and now belong to another request.
            first_block = (seq_lens - window).clamp(min=0) // block_size
            span = max(((n - 1) // block_size - max(n - window, 0) // block_size + 1)
                       for n in (meta.seq_lens_cpu[i] for i in seqs))
            cols = (first_block[:, None] + torch.arange(span, device=device)[None, :]).clamp(
                max=block_tables.shape[1] - 1)
            block_tables = torch.gather(block_tables, 1, cols)
            first_pos = first_block * block_size
        # [B, Lmax, Hkv, D]
        k, v = self._gather(k_cache, v_cache, block_tables, query.dtype, quant)
        key_pos = torch.arange(k.shape[1], device=device)[None, :]
        if first_pos is not None:
            key_pos = key_pos + first_pos[:, None]
        valid = key_pos < seq_lens[:, None]
        if window is not None:
            valid &= key_pos >= seq_lens[:, None] - window
        if not meta.padding_is_zero:
            # NOTE: padding slots may hold anything (NaN included): zero them by selection so a
            # masked position contributes exactly 0, then mask them out of the softmax.
            invalid = ~valid[:, :, None, None]
            k.masked_fill_(invalid, 0)
            v.masked_fill_(invalid, 0)
        q = query[: meta.num_tokens] if token_idx is None else query[token_idx]
        o = attend(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), self.scale,
                   mask=valid[:, None, None, :], soft_cap=self.logits_soft_cap)
        o = o[:, :, 0, :]
        if token_idx is None:
            out[: meta.num_tokens] = o
        else:
            out[token_idx] = o

    def _prefill(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_len: int,
                 quant: KVQuant | None = None) -> torch.Tensor:
        block_size = k_cache.shape[1]
        query_len = query.shape[0]
        context_len = seq_len - query_len
        window = self.sliding_window
        # With a window, the first key any row of the chunk sees (earlier blocks may be freed).
        first_block = 0
        if window is not None:
            first_block = max(context_len - window + 1, 0) // block_size
        blocks = block_table[None, first_block: -(-seq_len // block_size)]
        first_pos = first_block * block_size
        k, v = self._gather(k_cache, v_cache, blocks, query.dtype, quant)
        k = k[0, : seq_len - first_pos].transpose(0, 1)[None]  # [1, Hkv, S, D]
        v = v[0, : seq_len - first_pos].transpose(0, 1)[None]
        q = query.transpose(0, 1)[None]
        soft_cap = self.logits_soft_cap
        if context_len == 0 and (window is None or window >= seq_len):
            o = attend(q, k, v, self.scale, is_causal=True, soft_cap=soft_cap)
        else:
            device = query.device
            q_pos = torch.arange(context_len, seq_len, device=device)
            k_pos = torch.arange(first_pos, seq_len, device=device)
            o = attend(q, k, v, self.scale, mask=window_mask(q_pos, k_pos, window),
                       soft_cap=soft_cap)
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
