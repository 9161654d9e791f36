"""The n-gram (prompt lookup) proposer: drafts copied from the request's own earlier tokens.

For each request, the longest n in ``[prompt_lookup_min, prompt_lookup_max]`` whose last n
tokens occurred before, and among those occurrences the most recent; the drafts are the tokens
that followed it. When that occurrence ends less than k tokens before the end (the text is
looping with period p < k), the continuation repeats with that period: it is what the text would
read if the loop went on.

(vLLM's lookup takes the earliest occurrence of the longest n-gram and stops at the end of the
text; the most recent occurrence follows the local context more closely, and the periodic
continuation gives a loop its k drafts.)

All requests are searched at once in numpy over their token rows, the whole context (vLLM
bounds no window either): one comparison pass over the rows finds the earlier positions of each
row's last token, and only those candidates are extended to longer n-grams.
"""

from __future__ import annotations

import numpy as np

from pagellm.spec_decode.config import SpeculativeConfig
from pagellm.worker.input_batch import CachedRequestState, InputBatch


def longest_recent_matches(tokens: np.ndarray, lens: np.ndarray, min_n: int, max_n: int
                           ) -> tuple[np.ndarray, np.ndarray]:
    """For rows ``tokens`` [B, W] holding ``lens[b]`` tokens each (what lies past them is not
    read), each row's best earlier occurrence of its suffix: ``(length, end)``, the n-gram
    length matched (capped at ``max_n``; 0 when none of at least ``min_n``) and the position of
    the occurrence's last token.

    Candidates are the earlier positions holding the row's last token (one comparison over the
    matrix); only those are extended backwards, so the cost is one pass plus the candidates."""
    num_rows, width = tokens.shape
    length_out = np.zeros(num_rows, dtype=np.int64)
    end_out = np.zeros(num_rows, dtype=np.int64)
    if width < 2:
        return length_out, end_out
    last = lens - 1
    eq = tokens[:, :-1] == tokens[np.arange(num_rows), last][:, None]
    eq &= np.arange(width - 1)[None, :] < last[:, None]
    rows, ends = np.nonzero(eq)  # row-major: rows ascending
    if rows.size == 0:
        return length_out, end_out
    length = np.ones(rows.size, dtype=np.int64)
    alive = np.ones(rows.size, dtype=bool)
    flat = tokens.ravel()
    candidate = rows * width + ends  # flat index of each candidate's last token
    suffix = rows * width + last[rows]  # and of its row's last token
    for i in range(1, max_n):
        alive &= ends >= i  # (a dead candidate's index may wrap: never used)
        if not alive.any():
            break
        alive &= flat[candidate - i] == flat[suffix - i]
        length += alive
    # Longest first, then the most recent: the largest length * W + end of each row.
    score = np.where(length >= min_n, length * width + ends, -1)
    firsts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    best = np.maximum.reduceat(score, firsts)
    found = best >= 0
    length_out[rows[firsts[found]]] = best[found] // width
    end_out[rows[firsts[found]]] = best[found] % width
    return length_out, end_out


class NgramProposer:
    """``Proposer`` (proposer.py) for ``{"method": "ngram"}``."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max
        self.max_model_len = max_model_len

    @property
    def num_lookahead_slots(self) -> int:
        return 0

    @property
    def kv_bytes_per_token(self) -> int:
        return 0  # no KV of its own

    @property
    def weight_bytes(self) -> int:
        return 0

    def initialize(self, num_blocks: int) -> None:
        pass  # no KV of its own

    def remove_request(self, req_id: str) -> None:
        pass  # no per-request state

    def sleep(self, level: int) -> int:
        return 0  # holds nothing on the device

    def wake_up(self) -> None:
        pass

    def propose(self, batch: InputBatch, states: list[CachedRequestState],
                num_tokens: int) -> list[list[int]]:
        if not states:
            return []
        lens = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        tokens = batch.token_ids[rows, :int(lens.max())]
        length, end = longest_recent_matches(tokens, lens, self.min_n, self.max_n)
        drafts: list[list[int]] = []
        for r, state in enumerate(states):
            k = min(num_tokens, self.max_model_len - state.num_tokens)
            if length[r] == 0 or k <= 0:
                drafts.append([])
                continue
            # What followed the occurrence, up to the row's last token.
            continuation = tokens[r, end[r] + 1:lens[r]]
            drafts.append(np.resize(continuation, k).tolist())
        return drafts

