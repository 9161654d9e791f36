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
# client_metadata (Codex's request attribution: session, thread and turn ids, and a JSON blob of
# turn metadata) goes to the request's trace span; its bounds are looser than metadata's.
MAX_CLIENT_METADATA_KEYS = 32
MAX_CLIENT_METADATA_VALUE_CHARS = 8192
MAX_PROMPT_CACHE_KEY_CHARS = 1024
ENCRYPTED_REASONING = "reasoning.encrypted_content"
INCLUDABLE = (ENCRYPTED_REASONING,)


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
    # Echoed in the response and put on the request's trace span, as client_metadata is. One
    # engine has one prefix cache, which every request of a tenant already shares.
    prompt_cache_key: str | None = None
    client_metadata: dict[str, str] | None = None

    @field_validator("include")
    @classmethod
    def _include(cls, include: list[str] | None) -> list[str] | None:
        # Output logprobs are not made here; nothing else in OpenAI's list applies to a
        # function-only model.
        for name in include or []:
            if name not in INCLUDABLE:
                raise unsupported("include", f"extra output ({name!r}; it has "
                                  f"{', '.join(INCLUDABLE)})")
        return include

    @field_validator("client_metadata")
    @classmethod
    def _client_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is not None and (
                len(metadata) > MAX_CLIENT_METADATA_KEYS
                or any(len(k) > MAX_METADATA_KEY_CHARS for k in metadata)
                or any(len(v) > MAX_CLIENT_METADATA_VALUE_CHARS for v in metadata.values())):
            raise ValueError(f"client_metadata may have at most {MAX_CLIENT_METADATA_KEYS} "
                             f"keys of at most {MAX_METADATA_KEY_CHARS} characters and values "
                             f"of at most {MAX_CLIENT_METADATA_VALUE_CHARS}.")
        return metadata

    @field_validator("prompt_cache_key")
    @classmethod
    def _prompt_cache_key(cls, key: str | None) -> str | None:
        if key is not None and not 0 < len(key) <= MAX_PROMPT_CACHE_KEY_CHARS:
            raise ValueError("prompt_cache_key must be a non-empty string of at most "
                             f"{MAX_PROMPT_CACHE_KEY_CHARS} characters.")
        return key

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

    @property
    def seals_reasoning(self) -> bool:
        """include reasoning.encrypted_content: reasoning items carry it."""
        return ENCRYPTED_REASONING in (self.include or [])
