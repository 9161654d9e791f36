"""Benchmark workloads: random token prompts, or a JSONL file of
``{"prompt_token_ids": [...], "max_tokens": N}`` (or ``"prompt"`` text) rows."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def parse_range(text: str | int, flag: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64-512' -> (64, 512)."""
    s = str(text)
    try:
        if "-" in s:
            lo, hi = (int(x) for x in s.split("-", 1))
        else:
            lo = hi = int(s)
    except ValueError:
        raise ValueError(f"{flag} must be N or LO-HI, got {text!r}.") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{flag} must be N or LO-HI with 1 <= LO <= HI, got {text!r}.")
    return lo, hi


def random_requests(num_prompts: int, input_len: str | int, output_len: str | int,
                    vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    in_lo, in_hi = parse_range(input_len, "--input-len")
    out_lo, out_hi = parse_range(output_len, "--output-len")
    # Stay clear of the lowest ids, which are usually special tokens.
    lo_id = min(1000, vocab_size // 4)
    out = []
    for _ in range(num_prompts):
        prompt = [rng.randrange(lo_id, vocab_size) for _ in range(rng.randint(in_lo, in_hi))]
        out.append(BenchRequest(prompt, rng.randint(out_lo, out_hi)))
    return out


def load_jsonl(path: str, tokenizer=None) -> list[BenchRequest]:
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            ids = row.get("prompt_token_ids")
            if ids is None:
                if tokenizer is None or "prompt" not in row:
                    raise ValueError(f"{path}:{lineno}: needs prompt_token_ids (or prompt)")
                ids = tokenizer.encode(row["prompt"])
            out.append(BenchRequest(list(ids), int(row.get("max_tokens", 128))))
    return out
