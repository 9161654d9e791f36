"""Per-request state the model runner keeps between steps, in persistent numpy rows.

Each live request owns one row of a token buffer ``[max_num_reqs, max_model_len]`` and of a block
table ``[max_num_reqs, max_blocks_per_req]``. A step touches only what changed (new requests,
appended blocks, sampled tokens); the flat batch is then gathered from the rows with vectorized
indexing, never a per-token Python loop. Penalty and logit-bias state lives on the device in
``sampling`` (sampling_state.py), changed with the rows, never rebuilt per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.sampling_params import SamplingParams
from pagellm.worker.sampling_state import SamplingState


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    row: int
    num_prompt_tokens: int
    num_tokens: int  # tokens known so far (prompt + output)
    num_computed_tokens: int
    num_blocks: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    state_slot: int = -1  # recurrent layers' state slot (core/state_slots.py); -1: none


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 vocab_size: int, device: torch.device | str = "cpu",
                 samples: bool = True) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
        # Block tables of KV cache groups 1.. (models with several; see set_num_kv_groups).
        self.group_block_tables: list[np.ndarray] = []
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.null_block_id = 0
        # Only a rank that samples keeps penalty/bias state (tensor parallel: rank 0).
        self.sampling = SamplingState(max_num_reqs, vocab_size, device) if samples else None

    def set_null_block(self, block_id: int) -> None:
        """Pad every block-table row with ``block_id`` (an always-zero block)."""
        self.null_block_id = block_id
        self.block_table.fill(block_id)
        for table in self.group_block_tables:
            table.fill(block_id)

    def set_num_kv_groups(self, num_groups: int) -> None:
        """One more block table per KV cache group past the first (core/kv_cache_groups.py)."""
        self.group_block_tables = [np.full_like(self.block_table, self.null_block_id)
                                   for _ in range(num_groups - 1)]

    def add_request(self, req_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                    sampling_params: SamplingParams, block_ids: list[int],
                    num_computed_tokens: int, generator: torch.Generator | None,
                    group_block_ids: list[list[int]] | None = None,
                    state_slot: int = -1) -> CachedRequestState:
        assert req_id not in self.requests, req_id
        row = self._free_rows.pop()
        tokens = list(prompt_token_ids) + list(output_token_ids)
        self.token_ids[row, : len(tokens)] = tokens
        self.block_table[row] = self.null_block_id
        self.block_table[row, : len(block_ids)] = block_ids
        for table, ids in zip(self.group_block_tables, group_block_ids or (), strict=True):
            table[row] = self.null_block_id
            table[row, : len(ids)] = ids
        state = CachedRequestState(
            req_id=req_id, row=row, num_prompt_tokens=len(prompt_token_ids),
            num_tokens=len(tokens), num_computed_tokens=num_computed_tokens,
            num_blocks=len(block_ids), sampling_params=sampling_params, generator=generator,
            output_token_ids=list(output_token_ids), state_slot=state_slot)
        self.requests[req_id] = state
        if self.sampling is not None:
            self.sampling.add(row, sampling_params, prompt_token_ids, output_token_ids)
        return state

    def append_blocks(self, state: CachedRequestState, block_ids: list[int],
                      group_block_ids: list[list[int]] | None = None) -> None:
        if block_ids:
            n = state.num_blocks
            self.block_table[state.row, n : n + len(block_ids)] = block_ids
            for table, ids in zip(self.group_block_tables, group_block_ids or (), strict=True):
                table[state.row, n : n + len(ids)] = ids
            state.num_blocks = n + len(block_ids)

    def append_token(self, state: CachedRequestState, token_id: int) -> None:
        if state.num_tokens < self.max_model_len:
            self.token_ids[state.row, state.num_tokens] = token_id
        state.num_tokens += 1
        state.output_token_ids.append(token_id)
        if self.sampling is not None:
            self.sampling.append(state.row, token_id)

    def remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)
            if self.sampling is not None:
                self.sampling.remove(state.row)
