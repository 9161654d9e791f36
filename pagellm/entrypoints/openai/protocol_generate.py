"""vLLM's token-in/token-out shapes (``POST /inference/v1/generate``): GenerateRequest with vLLM's
SamplingParams as JSON, and the response and stream chunk models.

A SamplingParams field pagellm lacks is refused by name (``sampling_params.<field>``) when set to
anything that asks for it; the tables below are the one list of what is taken, what only
describes the engine's own bookkeeping, and what is refused."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagellm.entrypoints.openai.protocol import (
    ChatLogprobs,
    StreamOptions,
    UsageInfo,
    unsupported,
)
from pagellm.entrypoints.openai.protocol_tools import StructuredOutputsRequest
from pagellm.entrypoints.openai.request_ids import MAX_REQUEST_ID_CHARS

logger = logging.getLogger("pagellm")

GENERATE_PATH = "/inference/v1/generate"


@dataclass(frozen=True)
class RefusedField:
    """A vLLM SamplingParams field pagellm does not implement."""

    feature: str  # what setting it asks for, for the error message
    defaults: tuple[Any, ...] = (None,)  # values that ask for nothing

    def asks(self, value: Any) -> bool:
        return not any(value == d for d in self.defaults)


# vLLM SamplingParams fields (current and older releases) that pagellm lacks.
REFUSED_SAMPLING_FIELDS: dict[str, RefusedField] = {
    "use_beam_search": RefusedField("beam search", (None, False)),
    "length_penalty": RefusedField("beam search", (None, 1.0, 1)),
    "early_stopping": RefusedField("beam search", (None, False)),
    "spaces_between_special_tokens": RefusedField("detokenization options", (None, True)),
    "logits_processors": RefusedField("custom logits processors", (None, [])),
    "_bad_words_token_ids": RefusedField("banned words", (None, [])),
    "thinking_token_budget": RefusedField("thinking budgets"),
    "repetition_detection": RefusedField("repetition detection"),
    "routed_experts_prompt_start": RefusedField("routed-expert output", (None, 0)),
    "trace_decode_token_ids": RefusedField("forced decoding"),
    "stream_interval": RefusedField("per-request stream intervals"),
    "logprob_token_ids": RefusedField("logprobs of chosen token ids"),
    "prompt_logprob_token_ids": RefusedField("prompt logprobs of chosen token ids"),
    "prompt_logprob_start": RefusedField("prompt logprobs from a given position", (None, 0)),
    "guided_decoding": RefusedField("the old guided_decoding field (use structured_outputs)"),
}
# Fields that only say how vLLM's engine keeps a request, which this endpoint decides itself
# (the output kind follows ``stream``) or which vLLM recomputes from the other fields: any value
# gives the same answer.
ENGINE_BOOKKEEPING_FIELDS = frozenset({"output_kind", "skip_clone", "flat_logprobs",
                                       "output_text_buffer_length", "_eos_token_id",
                                       "_all_stop_token_ids"})
# GenerateRequest fields that describe the rendered prompt and change nothing in generation.
PROMPT_INFO_FIELDS = frozenset({"assistant_tokens_mask", "token_offsets"})


class GenerateSamplingParams(BaseModel):
    """vLLM's SamplingParams as JSON: the fields pagellm implements, with vLLM's defaults
    (``max_tokens`` left out: the rest of the context, as vLLM's endpoint)."""

    model_config = ConfigDict(extra="allow")

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsRequest | None = None
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    # Arguments for --logits-processors plugins (a completion's vllm_xargs).
    extra_args: dict[str, Any] | None = None
    best_of: int | None = None  # vLLM's older releases: only equal to n (no best-of-n)
    # Skipping the prefix cache: pagellm does it exactly for prompt_logprobs (as vLLM's default).
    skip_reading_prefix_cache: bool | None = None

    @model_validator(mode="after")
    def _check_fields(self) -> GenerateSamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("sampling_params.best_of", "best-of-n selection (best_of must be "
                              "unset or equal to n)")
        skip = self.skip_reading_prefix_cache
        if skip is not None and skip != (self.prompt_logprobs is not None):
            raise unsupported("sampling_params.skip_reading_prefix_cache",
                              "choice of prefix-cache reads (the cache is skipped exactly when "
                              "prompt_logprobs is set)")
        for name, value in (self.model_extra or {}).items():
            spec = REFUSED_SAMPLING_FIELDS.get(name)
            if spec is not None:
                if spec.asks(value):
                    raise unsupported(f"sampling_params.{name}", spec.feature)
            elif name not in ENGINE_BOOKKEEPING_FIELDS and value is not None:
                # Not a SamplingParams field we know: a typo must not run as if unset.
                raise unsupported(f"sampling_params.{name}", "such SamplingParams field")
        return self


class GenerateRequest(BaseModel):
    """vLLM's GenerateRequest: what /v1/completions/render and /v1/chat/completions/render
    answer with."""

    model_config = ConfigDict(extra="allow")

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    token_ids: list[int]
    features: Any = None  # multimodal input: refused
    sampling_params: GenerateSamplingParams
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None  # disaggregated prefill: refused

    @field_validator("request_id")
    @classmethod
    def _loggable_id(cls, request_id: str) -> str:
        # It names the engine's request, in the log and in X-Request-Id (request_ids.py).
        if not (0 < len(request_id) <= MAX_REQUEST_ID_CHARS and request_id.isascii()
                and request_id.isprintable() and " " not in request_id):
            raise ValueError(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII "
                             "characters (no spaces).")
        return request_id

    @field_validator("cache_salt")
    @classmethod
    def _non_empty_salt(cls, salt: str | None) -> str | None:
        if salt == "":  # would share the unsalted namespace (as /v1/completions refuses)
            raise ValueError("cache_salt must be a non-empty string if given.")
        return salt

    @model_validator(mode="after")
    def _check_request(self) -> GenerateRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        if self.features is not None:
            raise unsupported("features", "multimodal input")
        if self.kv_transfer_params is not None:
            raise unsupported("kv_transfer_params", "KV transfer (disaggregated prefill)")
        unknown = [n for n in (self.model_extra or {}) if n not in PROMPT_INFO_FIELDS]
        if unknown:  # as every endpoint: unknown fields are logged (names only) and ignored
            logger.warning("Ignored unknown request fields: %s", ", ".join(
                n for n in unknown[:8] if n.isidentifier() and len(n) <= 40) or "-")
        return self


class GenerateChoice(BaseModel):
    index: int
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] = Field(default_factory=list)


class GenerateResponse(BaseModel):
    request_id: str
    choices: list[GenerateChoice]
    # Filled in as plain dicts (see prompt_logprobs.plain_prompt_logprobs).
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class GenerateStreamResponse(BaseModel):
    request_id: str
    choices: list[GenerateChoice]
    usage: UsageInfo | None = None
