"""A minimal stand-in for the model runner: paged KV caches, block tables, metadata per step.

Blocks are handed out in a shuffled order (non-contiguous tables) and unused cache slots hold
NaN, so a backend reading a slot it does not own poisons the logits.
"""

from __future__ import annotations

import random

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.state_metadata import StateMetadata
from pagellm.forward_context import set_forward_context


class PagedHarness:
    def __init__(self, model: torch.nn.Module, num_blocks: int = 64, block_size: int = 16,
                 seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (torch.full(shape, float("nan"), dtype=param.dtype, device=param.device),
             torch.full(shape, float("nan"), dtype=param.dtype, device=param.device))
            for _ in range(model.num_layers)
        ]
        # Recurrent layers (linear attention): a NaN-filled state slot per sequence, handed
        # out in a shuffled order too.
        self.state_caches: dict[int, tuple[torch.Tensor, ...]] | None = None
        state_layers = model.recurrent_layers(model.config) if hasattr(
            model, "recurrent_layers") else ()
        if state_layers:
            from pagellm.distributed.parallel_state import get_tp_size

            shapes = model.recurrent_state_shapes(model.config, get_tp_size())
            self.state_caches = {
                layer: tuple(torch.full((8, *shape), float("nan"),
                                        dtype=torch.float32 if fp32 else param.dtype,
                                        device=param.device) for shape, fp32 in shapes)
                for layer in state_layers}
        self.free_slots = list(range(8))
        random.Random(seed + 1).shuffle(self.free_slots)
        self.state_slots: dict[str, int] = {}
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def _slots(self, seq_id: str, start: int, end: int) -> list[int]:
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) * self.block_size < end:
            table.append(self.free_blocks.pop())
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def step(self, batch: list[tuple[str, list[int]]],
             all_logits: bool = False) -> torch.Tensor:
        """Run ``[(seq_id, new_token_ids), ...]`` as one flat batch.

        Returns float32 logits of each sequence's last new token ``[num_seqs, vocab]``, or of
        every new token ``[num_tokens, vocab]`` with ``all_logits``.
        """
        device = next(self.model.parameters()).device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        for seq_id, tokens in batch:
            start = self.num_computed.get(seq_id, 0)
            end = start + len(tokens)
            ids += tokens
            positions += range(start, end)
            slots += self._slots(seq_id, start, end)
            starts.append(len(ids))
            seq_lens.append(end)
            self.num_computed[seq_id] = end
        tables = [self.block_tables[s] for s, _ in batch]
        width = max(len(t) for t in tables)
        table_rows = [t + [0] * (width - len(t)) for t in tables]
        query_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        meta = AttentionMetadata(
            num_tokens=len(ids),
            num_seqs=len(batch),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(table_rows, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            is_decode_only=all(q == 1 for q in query_lens),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        state_meta = None
        if self.state_caches is not None:
            slots = [self.state_slots.setdefault(s, self.free_slots.pop()) if s not in
                     self.state_slots else self.state_slots[s] for s, _ in batch]
            state_meta = StateMetadata(starts, slots,
                                       [end > len(t) for (_, t), end in zip(batch, seq_lens,
                                                                            strict=True)])
        with torch.inference_mode(), set_forward_context(meta, self.kv_caches,
                                                         state_caches=self.state_caches,
                                                         state_metadata=state_meta):
            hidden = self.model(input_ids, pos)
            if not all_logits:
                hidden = hidden[torch.tensor(starts[1:], device=device) - 1]
            return self.model.compute_logits(hidden)

    def greedy(self, seq_id: str, prompt: list[int], num_tokens: int,
               chunk: int | None = None) -> list[int]:
        """Prefill ``prompt`` (in chunks of ``chunk`` tokens if given), then decode greedily."""
        chunk = chunk or len(prompt)
        for i in range(0, len(prompt), chunk):
            logits = self.step([(seq_id, prompt[i : i + chunk])])
        out = [int(logits[0].argmax())]
        while len(out) < num_tokens:
            out.append(int(self.step([(seq_id, [out[-1]])])[0].argmax()))
        return out
