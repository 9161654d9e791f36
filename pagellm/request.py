"""A request's state inside the engine core (pure Python, no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagellm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, stop token or stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5  # client gone
    FINISHED_ERROR = 6  # the model step that ran it raised (see EngineCore.step)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # the engine failed while running it; never a user's fault


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    ``all_token_ids`` is prompt + output; the scheduler catches ``num_computed_tokens`` up to
    ``num_tokens`` within its per-step budget. ``group_id`` ties the n samples of one prompt
    together (they share the prompt's KV blocks); ``cache_salt`` isolates tenants.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    group_id: str | None = None
    priority: int = 0
    max_tokens: int = 16  # resolved by the engine (None in SamplingParams -> rest of context)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first scheduling (-1: not scheduled yet).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Timestamps (time.monotonic) for metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Structured outputs: the RequestGrammar (pagellm/structured_output/request_grammar.py) the
    # engine core attaches when the request arrives; None for an unconstrained request. The
    # scheduler admits the request once ``grammar.ready`` and feeds it every sampled token.
    grammar: Any = field(default=None, repr=False)
    # Speculative decoding: draft tokens proposed by the model runner, verified by the next
    # step (scheduled after the known tokens; not part of all_token_ids until accepted).
    spec_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: tokens scheduled whose sampled id has not come back yet.
    num_output_placeholders: int = 0
    # Slots past the known tokens a draft model writes K/V to while proposing.
    num_lookahead_slots: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_unknown_slots(self) -> int:
        """KV slots the scheduler may allocate past the known tokens (see the fields above)."""
        return len(self.spec_token_ids) + self.num_output_placeholders + self.num_lookahead_slots

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def get_finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)
