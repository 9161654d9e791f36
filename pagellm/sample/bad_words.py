"""bad_words (vLLM's): words a request must never generate.

Each word becomes token sequences once, when the request is added (``bad_words_token_ids``):
the word as written at the start of a text, and with a leading space (mid-sentence) when that
tokenizes to a different sequence of the same length. At each step the last token of a
sequence is masked when the tokens before it end the output so far; a one-token word is
always masked. Requests without bad words cost nothing: no row, no tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def bad_words_token_ids(words: Sequence[str], tokenizer: Any, vocab_size: int
                        ) -> list[list[int]]:
    """The banned token sequences of ``words``; ValueError naming bad_words for a word whose
    tokens fall outside the model's vocabulary (or that tokenizes to nothing)."""
    sequences: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"SamplingParams.bad_words: {word!r} tokenizes to no tokens.")
        sequences.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        # A leading space that only adds a space token is not another spelling of the word.
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    bad = sorted({t for seq in sequences for t in seq if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"SamplingParams.bad_words: token ids {bad[:8]} are outside the "
                         f"vocabulary (size {vocab_size}).")
    return sequences


def banned_next_tokens(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> set[int]:
    """The tokens that would complete a banned sequence after ``output``."""
    banned: set[int] = set()
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix:]) == list(seq[:prefix]):
            banned.add(seq[-1])
    return banned


def bad_words_mask(sequences: Sequence[Sequence[Sequence[int]]],
                   outputs: Sequence[Sequence[int]], device: torch.device | str
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) to set to -inf this step, one entry of ``sequences`` and ``outputs``
    per sampling row; None when no row bans anything."""
    rows: list[int] = []
    tokens: list[int] = []
    for i, (seqs, out) in enumerate(zip(sequences, outputs, strict=True)):
        if seqs:
            for tok in banned_next_tokens(seqs, out):
                rows.append(i)
                tokens.append(tok)
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(tokens, dtype=torch.long, device=device))
