"""A test proposer that knows the target's greedy continuation: it drafts the true next tokens,
wrong from one position on, so every acceptance count from 0 to k occurs with a real model, real
KV and real rejections (a random tiny model rarely repeats itself, so n-gram drafts are rarely
accepted there)."""

from __future__ import annotations

from pagellm.worker.input_batch import CachedRequestState, InputBatch


class OracleProposer:
    """``references``: prompt token ids -> the target's greedy output after it (long enough)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab_size: int) -> None:
        self.references = references
        self.vocab_size = vocab_size
        self.num_proposed = 0

    @property
    def num_lookahead_slots(self) -> int:
        return 0

    @property
    def kv_bytes_per_token(self) -> int:
        return 0

    @property
    def weight_bytes(self) -> int:
        return 0

    def initialize(self, num_blocks: int) -> None:
        pass

    def remove_request(self, req_id: str) -> None:
        pass

    def sleep(self, level: int) -> int:
        return 0

    def wake_up(self) -> None:
        pass

    def propose(self, batch: InputBatch, states: list[CachedRequestState],
                num_tokens: int) -> list[list[int]]:
        out = []
        for state in states:
            tokens = batch.token_ids[state.row, :state.num_tokens].tolist()
            prompt, produced = tokens[:state.num_prompt_tokens], tokens[state.num_prompt_tokens:]
            ref = self.references.get(tuple(prompt))
            if ref is None or ref[:len(produced)] != produced:
                out.append([])
                continue
            drafts = ref[len(produced):len(produced) + num_tokens]
            wrong = len(produced) % (num_tokens + 1)  # the first draft to reject
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % self.vocab_size
            self.num_proposed += len(drafts)
            out.append(drafts)
        return out
