"""Prompt logprobs in the HTTP answers: vLLM's ``prompt_logprobs`` field, and the echoed
prompt tokens of a legacy completion with ``echo`` and ``logprobs``."""

from __future__ import annotations

import dataclasses

from pagellm.entrypoints.openai.protocol import PromptLogprob, PromptLogprobsList
from pagellm.outputs import CompletionOutput, PromptLogprobs

MIN_LOGPROB = -9999.0  # JSON has no -inf


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobsList | None:
    """vLLM's shape: null for the first prompt token, then token id -> {logprob, rank,
    decoded_token} (the prompt token and the top-N)."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {tid: PromptLogprob(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank,
                                decoded_token=lp.decoded_token) for tid, lp in entry.items()}
            for entry in prompt_logprobs]


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
