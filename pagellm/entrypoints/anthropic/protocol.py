"""Pydantic models of Anthropic's Messages API requests (the subset pagellm serves).

As Anthropic's API, a field it does not know is a 400 ("Extra inputs are not permitted"), and
so is a field of a feature pagellm lacks (UNSUPPORTED_FIELDS), never dropped. Content blocks
are checked one by one in translate.py, so an unsupported block type is named in the error."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

# Anthropic's minimum thinking budget.
MIN_THINKING_BUDGET = 1024
# Anthropic request fields of features pagellm lacks: set (to anything but null), a 400.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "container": "code-execution containers",
    "mcp_servers": "MCP connectors",
    "context_management": "server-side context management",
    "output_config": "output configuration (structured output formats, effort)",
    "inference_geo": "inference regions",
    "speed": "speed tiers",
    "diagnostics": "request diagnostics",
    "user_profile_id": "user profiles",
    "workspace_id": "workspaces",
}


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(BaseModel):
    # Accepted: pagellm caches every prompt prefix on its own (automatic prefix caching).
    model_config = ConfigDict(extra="allow")
    type: str = "ephemeral"


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _no_citations(self) -> TextBlock:
        if self.citations:
            raise PydanticCustomError("unsupported", "citations are not supported: this "
                                      "server has no documents to cite.")
        return self


def _refuse_set(model: BaseModel, features: dict[str, str], defaults: dict[str, Any]) -> None:
    """A field of a feature pagellm lacks, set to anything but null or its default: a 400."""
    for name, feature in features.items():
        value = getattr(model, name)
        if value is not None and value != defaults.get(name):
            raise PydanticCustomError("unsupported", f"{name} is not supported: this server "
                                      f"has no {feature}.")


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # The SDK echoes these back (null, or the direct caller) with an answer's blocks.
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None

    @model_validator(mode="after")
    def _plain_call(self) -> ToolUseBlock:
        _refuse_set(self, {"caller": "programmatic tool calling", "toolset_name": "toolsets"},
                    {"caller": {"type": "direct"}})
        return self


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None  # text blocks (checked in translate.py)
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    @model_validator(mode="after")
    def _plain_result(self) -> ToolResultBlock:
        _refuse_set(self, {"toolset_name": "toolsets"}, {})
        return self


class ThinkingBlock(AnthropicModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: str


# The block types a message may hold; any other type is refused by name.
BLOCK_MODELS: dict[str, type[AnthropicModel]] = {
    "text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock}


class MessageParam(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(AnthropicModel):
    """A client tool. Server tools (web_search_..., bash_..., text_editor_...) have a versioned
    ``type`` and are refused."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # the chat path's function.strict
    eager_input_streaming: bool | None = None  # input is streamed as it comes, always
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    input_examples: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _plain_tool(self) -> Tool:
        _refuse_set(self, {"defer_loading": "tool search", "allowed_callers":
                           "programmatic tool calling", "input_examples": "tool input examples"},
                    {"defer_loading": False, "allowed_callers": ["direct"],
                     "input_examples": []})
        return self


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice of type "tool" needs name.')
        if self.type != "tool" and self.name is not None:
            raise ValueError(f'tool_choice of type "{self.type}" takes no name.')
        return self


class ThinkingConfig(AnthropicModel):
    """enabled (with budget_tokens), disabled, or adaptive (the model decides whether to
    think: the chat template's default)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None  # adaptive's: how thinking is shown; only the full text is

    @model_validator(mode="after")
    def _budget(self) -> ThinkingConfig:
        if self.type == "enabled":
            if self.budget_tokens is None:
                raise ValueError('thinking of type "enabled" needs budget_tokens.')
            if self.budget_tokens < MIN_THINKING_BUDGET:
                raise ValueError(f"thinking.budget_tokens must be >= {MIN_THINKING_BUDGET}, "
                                 f"got {self.budget_tokens}.")
        elif self.budget_tokens is not None:
            raise ValueError(f'thinking of type "{self.type}" takes no budget_tokens.')
        if self.display not in (None, "summarized", "full"):
            raise ValueError("thinking.display must be summarized or full.")
        return self


class Metadata(AnthropicModel):
    user_id: str | None = None  # who sent it, for abuse tracking: changes nothing here


class CountTokensRequest(AnthropicModel):
    """POST /v1/messages/count_tokens: what a Messages request renders, without max_tokens."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _known_fields(self) -> CountTokensRequest:
        for name, value in (self.model_extra or {}).items():
            feature = UNSUPPORTED_FIELDS.get(name)
            if feature is None:
                raise PydanticCustomError("extra_forbidden", f"{name}: Extra inputs are not "
                                          "permitted")
            if value is not None:
                raise PydanticCustomError("unsupported", f"{name} is not supported: this "
                                          f"server has no {feature}.")
        if not self.messages:
            raise ValueError("messages: at least one message is required.")
        return self


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here

    @model_validator(mode="after")
    def _thinking_budget(self) -> MessagesRequest:
        thinking = self.thinking
        if thinking is not None and thinking.budget_tokens is not None \
                and thinking.budget_tokens >= self.max_tokens:
            raise ValueError("max_tokens must be greater than thinking.budget_tokens.")
        return self
