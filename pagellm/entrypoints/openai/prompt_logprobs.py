"""Prompt logprobs in the HTTP answers: vLLM's ``prompt_logprobs`` field, and the echoed
prompt tokens of a legacy completion with ``echo`` and ``logprobs``."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagellm.engine.detokenizer import decode_token
from pagellm.engine.output_processor import logprob_entry
from pagellm.outputs import CompletionOutput, PromptLogprobs, RawPromptLogprobs

MIN_LOGPROB = -9999.0  # JSON has no -inf
PlainPromptLogprobs = list[dict[str, dict[str, Any]] | None]


def resolve_prompt_logprobs(prompt_logprobs: int | None, echo: bool,
                            logprobs: int | None) -> int | None:
    """How many top tokens the engine scores per prompt token: the request's
    ``prompt_logprobs``, else ``logprobs`` when the prompt is echoed with logprobs (as vLLM)."""
    if prompt_logprobs is not None:
        return prompt_logprobs
    return logprobs if echo and logprobs is not None else None


def without_generation(c: CompletionOutput) -> CompletionOutput:
    """``echo`` with ``max_tokens: 0`` (prompt scoring, as vLLM): the engine sampled one token
    to finish the request; the answer holds none of it."""
    return dataclasses.replace(c, text="", token_ids=[],
                               logprobs=[] if c.logprobs is not None else None,
                               cumulative_logprob=0.0 if c.logprobs is not None else None,
                               finish_reason="length" if c.finish_reason else None,
                               stop_reason=None)


def prompt_logprob_entries(num_prompt_tokens: int, num_top: int) -> int:
    """At most how many entries scoring ``num_prompt_tokens`` prompt tokens returns: each
    token's own logprob and its top ``num_top``."""
    return num_prompt_tokens * (num_top + 1)


def shaped_prompt_logprobs(prompt_logprobs: RawPromptLogprobs | None, tokenizer: Any
                           ) -> PromptLogprobs | None:
    """Entries with their ``decoded_token``, from what AsyncLLM's outputs carry: the engine's
    records (RawPromptLogprobs). Up to ~100k entries a request: run it off the event loop. Each
    distinct token id is decoded once."""
    if prompt_logprobs is None:
        return None
    texts: dict[int, str] = {}

    def text(tid: int) -> str:
        if tid not in texts:
            texts[tid] = decode_token(tokenizer, tid)
        return texts[tid]

    return [None if rec is None else logprob_entry(rec, text) for rec in prompt_logprobs]


def plain_prompt_logprobs(prompt_logprobs: PromptLogprobs | None) -> PlainPromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` field (protocol.PromptLogprobsList): null for the first prompt
    token, then token id -> {logprob, rank, decoded_token} (the prompt token and the top-N), as
    plain lists and dicts: up to ~100k entries, too many to build as pydantic models (their
    dump, like the C JSON encoder, holds the GIL throughout)."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(tid): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank,
                        "decoded_token": lp.decoded_token} for tid, lp in entry.items()}
            for entry in prompt_logprobs]
