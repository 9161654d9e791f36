"""Penalty and logit-bias state of the persistent batch, kept on the sampling device.

A penalized request gets a slot in ``[slots, V]`` tensors when it joins the batch (its prompt
and earlier output scattered in once) and one increment per sampled token; a biased request
keeps its bias as two small device tensors. A step then gathers its rows with one indexed copy
whatever the prompt and output lengths, instead of rebuilding histograms from Python lists.
"""

from __future__ import annotations

import numpy as np
import torch

from pagellm.sample.allowed_tokens import allowed_ids_tensor, allowed_tokens_mask
from pagellm.sample.penalties import PenaltyTensors
from pagellm.sampling_params import SamplingParams


def penalized(p: SamplingParams) -> bool:
    return (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0)


class SamplingState:
    """Per-row penalty histograms and logit bias, indexed by the InputBatch row.

    Slot 0 of the tensors stays all zero: rows without penalties gather it, as they had empty
    histograms before. The tensors grow (doubling) with the number of penalized requests at
    once, so a batch that never uses penalties allocates nothing.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_slots = max_num_reqs + 1
        self.slot_of_row = np.zeros(max_num_reqs, dtype=np.int64)  # 0: not penalized
        self.output_counts: torch.Tensor | None = None  # float32 [slots, V]
        self.prompt_mask: torch.Tensor | None = None  # bool [slots, V]
        self._free_slots: list[int] = []
        self.bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # row -> (ids, values)
        self.allowed: dict[int, torch.Tensor] = {}  # row -> its allowed_token_ids
        # Sampled tokens not yet counted on the device: one scatter per step, not per token.
        self._pending_slots: list[int] = []
        self._pending_tokens: list[int] = []
        # Token ids sent to the device so far (prompt/output at add time, one per append).
        self.ids_written = 0

    # ---- batch changes ------------------------------------------------------------------
    def add(self, row: int, params: SamplingParams, prompt_token_ids: list[int],
            output_token_ids: list[int]) -> None:
        if penalized(params):
            slot = self._take_slot()
            assert self.output_counts is not None and self.prompt_mask is not None
            self.slot_of_row[row] = slot
            if output_token_ids:
                ids = self._ids(output_token_ids)
                self.output_counts[slot].index_put_(
                    (ids,), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
            # Only the repetition penalty looks at the prompt.
            if params.repetition_penalty != 1.0 and prompt_token_ids:
                self.prompt_mask[slot, self._ids(prompt_token_ids)] = True
        if params.logit_bias:
            pairs = [(t, float(b)) for t, b in params.logit_bias.items()
                     if 0 <= t < self.vocab_size]
            if pairs:
                self.bias[row] = (
                    torch.tensor([t for t, _ in pairs], dtype=torch.long, device=self.device),
                    torch.tensor([b for _, b in pairs], dtype=torch.float32,
                                 device=self.device))

        if params.allowed_token_ids is not None:
            self.allowed[row] = allowed_ids_tensor(params.allowed_token_ids, self.device)

    def remove(self, row: int) -> None:
        self.allowed.pop(row, None)
        slot = int(self.slot_of_row[row])
        if slot:
            # Its pending increments may still land; _take_slot clears the slot after them.
            self._free_slots.append(slot)
            self.slot_of_row[row] = 0
        self.bias.pop(row, None)

    def append(self, row: int, token_id: int) -> None:
        slot = int(self.slot_of_row[row])
        if slot and 0 <= token_id < self.vocab_size:
            self._pending_slots.append(slot)
            self._pending_tokens.append(token_id)

    # ---- one step -----------------------------------------------------------------------
    def penalty_tensors(self, rows: np.ndarray, params: list[SamplingParams]
                        ) -> PenaltyTensors | None:
        """The step's PenaltyTensors for batch ``rows`` (in sampling order); None when no row
        is penalized. Equal to PenaltyTensors.build over the rows' token lists."""
        use_presence = any(p.presence_penalty != 0.0 for p in params)
        use_frequency = any(p.frequency_penalty != 0.0 for p in params)
        use_repetition = any(p.repetition_penalty != 1.0 for p in params)
        if not (use_presence or use_frequency or use_repetition):
            return None
        self._flush()
        assert self.output_counts is not None and self.prompt_mask is not None
        slots = torch.from_numpy(self.slot_of_row[rows]).to(self.device)

        def row_tensor(values: list[float], used: bool) -> torch.Tensor | None:
            return (torch.tensor(values, dtype=torch.float32, device=self.device)
                    if used else None)

        return PenaltyTensors(
            presence_penalties=row_tensor([p.presence_penalty for p in params], use_presence),
            frequency_penalties=row_tensor([p.frequency_penalty for p in params],
                                           use_frequency),
            repetition_penalties=row_tensor([p.repetition_penalty for p in params],
                                            use_repetition),
            output_token_counts=self.output_counts.index_select(0, slots),
            prompt_token_mask=(self.prompt_mask.index_select(0, slots) if use_repetition
                               else None),
        )

    def logit_bias(self, rows: np.ndarray
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(sampling rows, token ids, values) of the biased rows among ``rows``, or None."""
        if not self.bias:
            return None
        found = [(i, self.bias[r]) for i, r in enumerate(rows.tolist()) if r in self.bias]
        if not found:
            return None
        lengths = [len(ids) for _, (ids, _) in found]
        sample_rows = np.repeat(np.array([i for i, _ in found], dtype=np.int64), lengths)
        return (torch.from_numpy(sample_rows).to(self.device),
                torch.cat([ids for _, (ids, _) in found]),
                torch.cat([values for _, (_, values) in found]))

    def allowed_mask(self, rows: np.ndarray) -> torch.Tensor | None:
        """The allowed_token_ids mask of ``rows`` (sampling order), or None."""
        if not self.allowed:
            return None
        return allowed_tokens_mask([self.allowed.get(r) for r in rows.tolist()],
                                   self.vocab_size, self.device)

    # ---- internals ----------------------------------------------------------------------
    def _ids(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        self.ids_written += len(ids)
        return ids.to(self.device)

    def _flush(self) -> None:
        if not self._pending_slots:
            return
        assert self.output_counts is not None
        slots = torch.tensor(self._pending_slots, dtype=torch.long)
        tokens = torch.tensor(self._pending_tokens, dtype=torch.long)
        self.ids_written += len(tokens)
        self._pending_slots, self._pending_tokens = [], []
        self.output_counts.index_put_(
            (slots.to(self.device), tokens.to(self.device)),
            torch.ones(len(tokens), dtype=torch.float32, device=self.device), accumulate=True)

    def _take_slot(self) -> int:
        self._flush()  # increments owed to a freed slot's last owner land before it is reset
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        assert self.output_counts is not None and self.prompt_mask is not None
        self.output_counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        return slot

    def _grow(self) -> None:
        old = 0 if self.output_counts is None else self.output_counts.shape[0]
        new = min(self.max_slots, max(4, 2 * old))
        assert new > old, "more penalized requests than batch rows"
        counts = torch.zeros(new, self.vocab_size, dtype=torch.float32, device=self.device)
        mask = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        if self.output_counts is not None and self.prompt_mask is not None:
            counts[:old] = self.output_counts
            mask[:old] = self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask
        # Pop order: lowest slot first; slot 0 is the shared zero row, never handed out.
        self._free_slots.extend(range(new - 1, max(old, 1) - 1, -1))
