"""User-facing results, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing precedes it), then token id -> Logprob
# (the prompt token itself plus the top-N), as vLLM's.
PromptLogprobs = list[dict[int, Logprob] | None]
# The same as the engine scored it, one ``core.sched_output.Logprobs`` record per prompt token
# (None first): what AsyncLLM's outputs carry, for the server to shape off its event loop.
RawPromptLogprobs = list[Any]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: one entry per prompt token (see PromptLogprobs;
    # RawPromptLogprobs from AsyncLLM).
    prompt_logprobs: PromptLogprobs | RawPromptLogprobs | None = None
