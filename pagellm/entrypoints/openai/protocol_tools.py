"""Pydantic models of the OpenAI (and vLLM) request and response parts for tool calling and
structured output: tools, tool_choice, tool calls in messages and deltas, response_format and
vLLM's structured_outputs."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator


class OpenAIModel(BaseModel):
    # As protocol.OpenAIModel (which imports this module): unknown nested fields are ignored.
    model_config = ConfigDict(extra="ignore")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # every call is constrained by its schema when enforced


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class MessageFunctionCall(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(OpenAIModel):
    """A tool call of an assistant message in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # pagellm always enforces the schema


class LegacyStructure(OpenAIModel):
    """One of a legacy structural tag's ``structures``: begin, a JSON schema, end."""

    model_config = ConfigDict(populate_by_name=True)

    begin: str
    structure_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class ResponseFormat(OpenAIModel):
    """``type`` structural_tag (vLLM's): ``format`` (xgrammar's format tree), or the legacy
    ``structures`` and ``triggers``."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[LegacyStructure] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.json_schema is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema.")
        legacy = self.structures is not None or self.triggers is not None
        if self.type == "structural_tag":
            if (self.format is None) == (not legacy):
                raise ValueError("response_format of type structural_tag needs either format "
                                 "or structures and triggers.")
            if legacy and (not self.structures or not self.triggers):
                raise ValueError("response_format of type structural_tag needs non-empty "
                                 "structures and triggers.")
        elif self.format is not None or legacy:
            raise ValueError("response_format.format, structures and triggers belong to type "
                             "structural_tag.")
        return self

    def structural_tag(self) -> dict[str, Any]:
        """The structural tag spec, as vLLM hands it to xgrammar."""
        if self.format is not None:
            return {"type": "structural_tag", "format": self.format}
        assert self.structures is not None and self.triggers is not None
        return {"structures": [s.model_dump(by_alias=True) for s in self.structures],
                "triggers": list(self.triggers)}


# vLLM's StructuredOutputsParams fields that pagellm's engine has (one of them per request).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object",
                           "structural_tag")


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's ``structured_outputs`` request field. Its other keys (whitespace_pattern,
    ...) are refused by name, never dropped."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_spec: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None  # a structural tag as JSON text (vLLM's)
    # No free whitespace between JSON tokens (keeps small models from looping on it).
    disable_any_whitespace: bool = False
    # Whitespace allowed in a row between JSON tokens; left out: the server's
    # --structured-outputs-max-whitespace-cnt, null: unbounded (pagellm's, not vLLM's).
    max_whitespace_cnt: StrictInt | None = None

    @model_validator(mode="after")
    def _known_keys(self) -> StructuredOutputsRequest:
        for key, value in (self.model_extra or {}).items():
            if value is not None and value is not False:
                raise ValueError(f"structured_outputs.{key} is not supported: this server "
                                 f"takes one of {', '.join(STRUCTURED_OUTPUT_KINDS)}.")
        return self

    def constraints(self) -> dict[str, Any]:
        """The constraints asked for: kind -> value."""
        values = {"json": self.json_spec, "regex": self.regex, "choice": self.choice,
                  "grammar": self.grammar, "json_object": self.json_object or None,
                  "structural_tag": self.structural_tag}
        return {k: v for k, v in values.items() if v is not None}
