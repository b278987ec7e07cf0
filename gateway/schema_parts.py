"""The pieces of a chat request body that OpenAI's newer fields add: messages with tool
calls and tool results, function tools, `tool_choice` and `response_format`. Validated
with pydantic so every error names its field (`tools.0.function.name: ...`)."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"     # OpenAI's (plus '.' and ':', which vLLM accepts)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = "{}"


class ToolCall(_Lenient):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None      # assistant turns that called tools
    tool_call_id: str | None = None               # tool turns: which call this answers
    reasoning_content: str | None = None          # accepted in history, not sent to the template

    @model_validator(mode="after")
    def _shape(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant turn with tool_calls may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """The message as Hugging Face chat templates take it: tool-call arguments as a
        dict (templates apply `tojson` to them) where they are a JSON object."""
        m: dict = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _as_object(c.function.arguments)}}
                               for c in self.tool_calls]
        if self.role == "tool":
            if self.tool_call_id is not None:
                m["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                m["name"] = self.name
        return m


def _as_object(arguments: str):
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class FunctionDef(_Lenient):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v):
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON schema of type object")
        return v

    def as_tool(self) -> dict:
        """The OpenAI tool shape, as `apply_chat_template(tools=...)` takes it."""
        fn = {"name": self.name, "parameters": self.parameters or {"type": "object", "properties": {}}}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class _Name(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: _Name


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaSpec(_Lenient):
    name: str = Field(default="response", pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _spec(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object ({name, schema, strict})")
        return self


class StreamOptions(_Lenient):
    include_usage: bool = False
