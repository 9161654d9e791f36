"""What a speculative-decoding proposer gives the model runner (``--speculative-config``).

After a step samples, the runner asks the proposer for up to ``num_speculative_tokens`` draft
tokens per request that just sampled; the scheduler schedules them after the request's known
tokens and the next step verifies them all in one forward (``rejection.py``). Proposals are
deterministic (an n-gram match, a draft model's argmax), so rejection sampling treats each draft
token as drawn from a one-hot distribution, which keeps the target's distribution exactly.
"""

from __future__ import annotations

from typing import Protocol

from pagellm.worker.input_batch import CachedRequestState, InputBatch


class Proposer(Protocol):
    def propose(self, batch: InputBatch, states: list[CachedRequestState],
                num_tokens: int) -> list[list[int]]:
        """Up to ``num_tokens`` draft tokens for each of ``states`` (an empty list: none). A
        request's known tokens are ``batch.token_ids[state.row, :state.num_tokens]``, its block
        table ``batch.block_table[state.row]`` (slots reserved up to ``num_tokens - 1`` past
        its known tokens when ``num_lookahead_slots`` says so)."""
        ...

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past a request's known tokens the proposer writes while proposing (a draft
        model's own cache, at the target's block ids); 0 for a proposer with no KV."""
        ...

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes per block-table slot of the proposer's own KV cache (0: none): the runner adds
        them to the target's when it splits the KV budget into blocks."""
        ...

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights the proposer holds on the device (0: none), left out of the KV
        budget like the target's."""
        ...

    def initialize(self, num_blocks: int) -> None:
        """Called once the target's KV cache exists (``num_blocks`` blocks): a draft model
        allocates its own cache with as many blocks, addressed by the same block ids."""
        ...

    def remove_request(self, req_id: str) -> None:
        """Forget a finished or preempted request's state (a draft model's computed tokens)."""
        ...

    def sleep(self, level: int) -> int:
        """Sleep mode (worker/sleep.py): free what the proposer holds on the device (its cache;
        at level 2 its weights too); returns the bytes freed (0: it holds nothing)."""
        ...

    def wake_up(self) -> None:
        """Bring back what ``sleep`` freed."""
        ...
