"""State slots: the fixed-size cache of recurrent layers (pure Python).

A model with Gated DeltaNet or Mamba-2 layers keeps, per request, one slot of every such
layer's state (its conv window and recurrent state; the tensors live in the worker,
worker/state_cache.py). A slot is taken when the request is first scheduled and returned when
it finishes or is preempted (a preempted request recomputes its state from its tokens, as it
recomputes its KV). The pool is sized by the memory plan: one slot per running sequence.
"""

from __future__ import annotations


class StateSlotPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state slot pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # Lowest ids first, so a lightly loaded engine touches few slots' memory.
        self._free = list(range(num_slots - 1, -1, -1))
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, req_id: str) -> int | None:
        return self._owner.get(req_id)

    def ensure(self, req_id: str) -> int | None:
        """The request's slot, taking a free one if it has none; None when none is free."""
        slot = self._owner.get(req_id)
        if slot is None and self._free:
            slot = self._free.pop()
            self._owner[req_id] = slot
        return slot

    def release(self, req_id: str) -> None:
        slot = self._owner.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)
