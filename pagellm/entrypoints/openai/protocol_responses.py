"""The request body of ``POST /v1/responses`` (OpenAI's Responses API, vLLM's ResponsesRequest
field names). Input items and tools stay plain dicts here: responses_input.py checks them and
turns them into the chat request they mean, naming the field that is wrong."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from pagellm.entrypoints.openai.protocol import HARMLESS_FIELDS, unsupported

# OpenAI's metadata bounds (they also bound what the response store keeps).
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


@dataclass(frozen=True)
class RefusedField:
    name: str
    feature: str
    defaults: tuple[Any, ...] = ()  # values that do not ask for the feature


# Responses API fields of features this server lacks: any other value than null or these is a
# 400 naming the field (a field not listed here and not declared below is refused too).
REFUSED_FIELDS = {f.name: f for f in (
    RefusedField("background", "background responses", (False,)),
    RefusedField("truncation", "automatic truncation of the conversation", ("disabled",)),
    RefusedField("top_logprobs", "logprobs in responses", (0,)),
    RefusedField("reasoning", "reasoning controls (effort, summaries)", ({},)),
    RefusedField("max_tool_calls", "a cap on built-in tool calls"),
    RefusedField("prompt", "stored prompt templates"),
    RefusedField("conversation", "conversation objects (use previous_response_id)"),
    RefusedField("service_tier", "service tiers", ("auto", "default")),
    RefusedField("stream_options", "stream options", ({},)),
    RefusedField("context_management", "context management"),
)}
# What the chat endpoint accepts without effect, minus the fields declared below.
_HARMLESS = HARMLESS_FIELDS - {"user", "metadata", "store", "parallel_tool_calls"}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": text | json_schema | json_object}}
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # null: true, as OpenAI
    previous_response_id: str | None = None
    stream: bool | None = False
    cache_salt: str | None = None  # vLLM's; the tenant's namespace is added (api_server)

    @field_validator("include")
    @classmethod
    def _include(cls, include: list[str] | None) -> list[str] | None:
        # reasoning.encrypted_content (stateless reasoning) and output logprobs need what this
        # server does not have; nothing else in OpenAI's list applies to a function-only model.
        if include:
            raise unsupported("include", f"extra output ({include[0]!r})")
        return include

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_KEYS:
            raise ValueError(f"metadata may have at most {MAX_METADATA_KEYS} keys.")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY_CHARS} "
                                 f"characters and values at most {MAX_METADATA_VALUE_CHARS}.")
        return metadata

    @field_validator("cache_salt")
    @classmethod
    def _non_empty_salt(cls, salt: str | None) -> str | None:
        if salt == "":
            raise ValueError("cache_salt must be a non-empty string if given.")
        return salt

    @model_validator(mode="after")
    def _refuse_unknown(self) -> ResponsesRequest:
        for name, value in (self.model_extra or {}).items():
            if value is None or name in _HARMLESS:
                continue
            spec = REFUSED_FIELDS.get(name)
            if spec is None:
                raise unsupported(name, "such field in its Responses API")
            if not any(value == d for d in spec.defaults):
                raise unsupported(name, spec.feature)
        return self

    @property
    def stored(self) -> bool:
        return self.store is not False
