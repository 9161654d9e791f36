"""Pydantic models of the OpenAI API (the subset we serve), plus vLLM's extra sampling fields.

A field of a feature this server lacks is refused, never dropped: the client would get
unconstrained text and believe it constrained. UNSUPPORTED_FIELDS is the one list of them."""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagellm.entrypoints.openai.protocol_tools import (
    ChatTool,
    DeltaToolCall,
    MessageToolCall,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolCall,
    ToolChoice,
)
from pagellm.entrypoints.openai.serving_errors import UNSUPPORTED_PARAMETER

logger = logging.getLogger("pagellm")

MAX_LOGPROBS = 20


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class UnsupportedField:
    name: str
    feature: str  # what asking for it means, for the error message
    # Values that do not ask for the feature; null (or leaving the field out) never does.
    defaults: tuple[Any, ...] = ()
    endpoints: tuple[str, ...] = ("completions", "chat")

    def asks(self, value: Any) -> bool:
        return value is not None and not any(value == d for d in self.defaults)


_TOOLS = "legacy function calling (use tools and tool_choice)"
# OpenAI and vLLM request fields of features pagellm lacks: a request that sets one to a value
# other than null or its default gets a 400 naming it (code "unsupported_parameter").
UNSUPPORTED_FIELDS: tuple[UnsupportedField, ...] = (
    # Structured output has one backend (xgrammar) and no whitespace pattern of its own
    # (structured_outputs.disable_any_whitespace drops free whitespace instead).
    UnsupportedField("guided_decoding_backend", "per-request structured-output backends"),
    UnsupportedField("guided_whitespace_pattern", "custom whitespace patterns for structured "
                     "output (structured_outputs.disable_any_whitespace removes free whitespace)"),
    UnsupportedField("functions", _TOOLS, ([],)),
    UnsupportedField("function_call", _TOOLS, ("none", "auto")),
    UnsupportedField("use_beam_search", "beam search", (False,)),
    UnsupportedField("length_penalty", "beam search", (1.0,)),
    # As vLLM V1: no per-request processors; plugins load with --logits-processors at
    # start-up and read a request's vllm_xargs (sample/logits_processors.py).
    UnsupportedField("logits_processors", "per-request logits processors (load plugins with "
                     "--logits-processors and pass their arguments in vllm_xargs)", ([],)),
    UnsupportedField("spaces_between_special_tokens", "detokenization options", (True,)),
    UnsupportedField("return_tokens_as_token_ids", "token ids in logprobs", (False,)),
    UnsupportedField("suffix", "insertion (text after the completion)", ("",),
                     ("completions",)),
    UnsupportedField("chat_template", "per-request chat templates", (), ("chat",)),
    UnsupportedField("mm_processor_kwargs", "multimodal input", ({},)),
    UnsupportedField("audio", "audio output", (), ("chat",)),
    UnsupportedField("modalities", "output modalities other than text", (["text"],),
                     ("chat",)),
    UnsupportedField("prediction", "predicted outputs", (), ("chat",)),
    UnsupportedField("web_search_options", "web search", (), ("chat",)),
    UnsupportedField("reasoning_effort", "reasoning controls", (), ("chat",)),
    UnsupportedField("verbosity", "verbosity controls", (), ("chat",)),
    UnsupportedField("kv_transfer_params", "disaggregated prefill"),
    # SGLang's fields, which vllm-router adds to every request it forwards, at these values.
    UnsupportedField("no_stop_trim", "untrimmed stop strings (use include_stop_str_in_output)",
                     (False,)),
    UnsupportedField("return_hidden_states", "hidden-state output", (False,)),
    UnsupportedField("separate_reasoning", "reasoning left inside the content", (True,),
                     ("chat",)),
    UnsupportedField("stream_reasoning", "reasoning sent only at the end of a stream", (True,),
                     ("chat",)),
    UnsupportedField("include_reasoning", "dropping the reasoning from the answer", (True,),
                     ("chat",)),
)
_UNSUPPORTED = {(ep, f.name): f for f in UNSUPPORTED_FIELDS for ep in f.endpoints}
# OpenAI fields that change nothing about the output: accepted and ignored without a word.
HARMLESS_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                             "safety_identifier", "prompt_cache_key", "prompt_cache_retention"})
_MAX_LOGGED_NAMES = 8
_LOGGABLE_NAME = re.compile(r"[A-Za-z0-9_]{1,40}")


def unsupported(name: str, feature: str, param: str | None = None) -> PydanticCustomError:
    """The validation error of a field we know but do not support; serving_errors turns it
    into a 400 whose ``param`` is ``param`` (default: the field)."""
    # The message is a template: the table's names and features have no braces.
    return PydanticCustomError(
        UNSUPPORTED_PARAMETER,
        f"{name} is not supported yet: this server has no {feature}. Leave the field out "
        "(or null) to run without it.", {"param": param or name})


class OpenAIModel(BaseModel):
    # Unknown fields of nested objects are ignored; request bodies keep theirs (extra="allow")
    # to check them against UNSUPPORTED_FIELDS.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False  # one last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")
    endpoint: ClassVar[str]

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: int = 0  # lower is served sooner; needs --scheduling-policy priority
    # vLLM's: each prompt token's logprob (the first's is null) plus the top-N, in the response.
    prompt_logprobs: int | None = None
    # vLLM's, for RL: the prompt's token ids and each choice's (streamed: its new ones).
    return_token_ids: bool | None = None
    # vLLM's: words never generated, the only ids that may be sampled, and the prompt cut to
    # its last k tokens (-1: max_model_len) before the length checks.
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's: arguments for the --logits-processors plugins (SamplingParams.extra_args).
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Structured output (structured_request.py): at most one of these asks for a constraint.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("cache_salt")
    @classmethod
    def _non_empty_salt(cls, salt: str | None) -> str | None:
        # An empty salt would share the cache with unsalted requests: the client believes
        # itself isolated and is not (vLLM refuses it too).
        if salt == "":
            raise ValueError("cache_salt must be a non-empty string if given.")
        return salt

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_range(cls, k: int | None) -> int | None:
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {k}.")
        return k

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        return self

    @model_validator(mode="after")
    def _check_extra_fields(self) -> SamplingFields:
        """400 for a field of a feature we lack; unknown fields are logged and ignored, as vLLM
        does (their names only: values may be prompt text)."""
        extra = self.model_extra or {}
        unknown = []
        for name, value in extra.items():
            spec = _UNSUPPORTED.get((self.endpoint, name))
            if spec is not None:
                if spec.asks(value):
                    raise unsupported(name, spec.feature)
            elif name not in HARMLESS_FIELDS:
                unknown.append(name)
        if unknown:
            # A name is the client's text too: only short identifiers reach the log.
            shown = [n for n in unknown if _LOGGABLE_NAME.fullmatch(n)][:_MAX_LOGGED_NAMES]
            more = len(unknown) - len(shown)
            logger.warning("Ignored unknown request fields: %s%s", ", ".join(shown) or "-",
                           f" (and {more} more)" if more else "")
        return self


class CompletionRequest(SamplingFields):
    endpoint: ClassVar[str] = "completions"

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # null: the rest of the context
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    add_special_tokens: bool = True  # the tokenizer's BOS/EOS around a text prompt (vLLM's)

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, "
                             f"got {self.logprobs}.")
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "best-of-n selection (best_of must be unset or "
                              "equal to n)")
        return self


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to that call

    @model_validator(mode="after")
    def _no_function_call(self) -> ChatMessage:
        # The legacy field: the chat template would render the message without it.
        if (self.model_extra or {}).get("function_call"):
            raise unsupported("function_call", _TOOLS, "messages")
        return self


class ChatCompletionRequest(SamplingFields):
    endpoint: ClassVar[str] = "chat"

    messages: list[ChatMessage]
    max_tokens: int | None = None  # null: the rest of the context
    max_completion_tokens: int | None = None
    logprobs: bool | None = False  # OpenAI's SDKs may send null
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The tokenizer's special tokens on top of what the template writes (vLLM's default: no).
    add_special_tokens: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = True  # false: at most one call
    # vLLM's: extra variables for the chat template (enable_thinking...), JSON data only, and
    # documents for RAG templates; chat_template_args.py checks them.
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    # vLLM's: the last message's content (when it is the answer's role) starts the answer.
    echo: bool = False

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if not self.messages:
            raise ValueError("messages must not be empty.")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs requires logprobs to be true.")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, "
                                 f"got {self.top_logprobs}.")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both "
                             "be true.")
        return self


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI's field)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry in vLLM's ``prompt_logprobs`` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shape: one entry per prompt token, null for the first.
PromptLogprobsList = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsList | None = None
    # return_token_ids (vLLM's): the prompt's ids (streamed: in a choice's first chunk only)
    # and the generated ones (streamed: this chunk's).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning-parser: the thinking, apart
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the generated ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsList | None = None  # vLLM's, when the request asks
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk only


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagellm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(OpenAIModel):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("Give exactly one of prompt or messages.")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
