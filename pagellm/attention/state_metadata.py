"""Per-step metadata of recurrent layers (Gated DeltaNet, Mamba-2), beside the attention
metadata: which state slot each sequence of the flat batch reads and writes.

Sequence ``i``'s new tokens are rows ``query_start_loc_cpu[i]:query_start_loc_cpu[i + 1]``; it
continues the state in slot ``state_slots[i]`` when ``has_initial_state[i]`` (it has computed
tokens before this step), else it starts from zeros. Every recurrent layer leaves the state
after the sequence's last new token in that slot, and the snapshots ``checkpoints`` ask for.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StateMetadata:
    query_start_loc_cpu: list[int]
    state_slots: list[int]
    has_initial_state: list[bool]
    # Prefix-cache snapshots (core/state_snapshots.py): per sequence, (n, slot) pairs: the
    # state after its first n new tokens is also stored in that slot. None: no snapshots.
    checkpoints: list[list[tuple[int, int]]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.state_slots)

    @classmethod
    def one_sequence(cls, num_tokens: int, slot: int) -> StateMetadata:
        """The whole flat batch as one sequence from zero state (profiling and warm-up runs)."""
        return cls([0, num_tokens], [slot], [False])
