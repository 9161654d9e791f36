"""What the scheduler tells the model runner each step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagellm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (first scheduling, or resumed after preemption).

    ``prompt_token_ids`` + ``output_token_ids`` are every token the request has so far; the runner
    keeps them and appends what it samples. ``block_ids`` is the whole block table (of KV cache
    group 0; ``group_block_ids`` holds those of groups 1.., for models with several groups).
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    group_block_ids: list[list[int]] = field(default_factory=list)
    # Models with recurrent layers: the request's state slot (core/state_slots.py), held until
    # it finishes or is preempted; -1 otherwise.
    state_slot: int = -1
    # A prefix hit on such a model: the snapshot slot whose state it resumes from (copied into
    # ``state_slot`` before the step; core/state_snapshots.py), or -1.
    state_restore_slot: int = -1


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds, as diffs: blocks added this step and the new
    ``num_computed_tokens`` (before this step's tokens)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    # Models with several KV cache groups: per request, the blocks groups 1.. added (as many
    # as group 0's); empty otherwise.
    new_group_block_ids: list[list[list[int]]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens to run this step (a decode token or a prefill chunk).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished or were preempted since the last step: the runner drops their state.
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: the allowed next tokens of the constrained requests that sample this
    # step (a GrammarBitmask, pagellm/structured_output/manager.py), or None.
    grammar_bitmask: Any = None
    # Speculative decoding: req_id -> the draft tokens scheduled after its last known token
    # (counted in num_scheduled_tokens); the runner verifies them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Recurrent-state snapshots (core/state_snapshots.py): req_id -> [(n, slot)], the state
    # after the request's first n new tokens of this step is copied into that slot.
    state_checkpoints: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass(slots=True)
class Logprobs:
    """Logprobs of one sampled token: the sampled token's own plus the top-N of the raw
    distribution (token id -> logprob), and their ranks."""

    sampled_token_id: int
    sampled_logprob: float
    sampled_rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of a run of prompt tokens, scored in the step that computed the positions before
    them: ``records[j]`` is prompt token ``start + j`` (``start`` >= 1: the first prompt token has
    none) given every token before it; its ``sampled_*`` fields hold that prompt token's own."""

    start: int
    records: list[Logprobs]


@dataclass(slots=True)
class ModelRunnerOutput:
    """One entry per scheduled request, in the runner's order. ``sampled_token_ids[i]`` is empty
    for a request whose prefill chunk did not reach the end of its known tokens, and holds the
    accepted drafts plus the target's token for a request that verified drafts.
    ``prompt_logprobs`` holds, for requests that asked, the prompt tokens this step scored."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # One record per sampled token: a Logprobs for one token, a list of them for a request
    # that verified drafts (one per emitted token); None where not asked.
    logprobs: list[Logprobs | list[Logprobs] | None] = field(default_factory=list)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Speculative decoding: req_id -> draft tokens proposed after this step's tokens.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    """Per-request result of one step, from the scheduler to the output processor."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    new_logprobs: list[Logprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Prompt tokens scored this step (SamplingParams.prompt_logprobs); may come without tokens.
    prompt_logprobs: PromptLogprobs | None = None
