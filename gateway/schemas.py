"""The chat request body, shared by HTTP and WebSocket, validated with pydantic so every
error names its field (`messages.0.role: ...`).

OpenAI fields we cannot honour (n > 1, tools, logprobs, non-text response formats,
penalties) are refused with a 400 naming the field instead of being silently ignored.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import BadRequest

MAX_DEADLINE_MS = 86_400_000        # one day
# Each message costs validation on the event loop and chat-template rendering, which holds
# the GIL, per message whatever its length: 25k empty messages (0.8 MB) stalled every
# stream for seconds. Checked before validation.
MAX_MESSAGES = 1024


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, gt=0, lt=2**31)
    max_completion_tokens: int | None = Field(default=None, gt=0, lt=2**31)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, lt=2**31)     # as in vLLM; 0 = off
    seed: int | None = Field(default=None, ge=-2**63, lt=2**63)
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None
    # streamgate extensions
    priority: int | None = Field(default=None, ge=-2**31, lt=2**31)
    deadline_ms: int | None = Field(default=None, gt=0, le=MAX_DEADLINE_MS)
    ignore_eos: bool = False            # as in vLLM: generate exactly max_tokens (benchmarks)
    # accepted only at their no-op values
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    tools: list | None = None
    tool_choice: object = None
    functions: list | None = None
    function_call: object = None
    logit_bias: dict | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None

    @field_validator("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "n",
                     "priority", "deadline_ms", mode="before")
    @classmethod
    def _not_a_boolean(cls, v):
        if isinstance(v, bool):        # pydantic would read true as 1
            raise ValueError("must be a number, not a boolean")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @model_validator(mode="after")
    def _unsupported(self):
        if self.n != 1:
            raise _Unsupported("n", "only n=1 is supported")
        if self.presence_penalty or self.frequency_penalty:
            raise _Unsupported("presence_penalty" if self.presence_penalty else "frequency_penalty",
                               "penalties are not supported")
        if self.logprobs:
            raise _Unsupported("logprobs", "logprobs are not supported")
        for name in ("tools", "tool_choice", "functions", "function_call"):
            if getattr(self, name) not in (None, [], "none"):
                raise _Unsupported(name, "tool and function calls are not supported")
        if self.logit_bias:
            raise _Unsupported("logit_bias", "logit_bias is not supported")
        if self.top_logprobs:
            raise _Unsupported("top_logprobs", "logprobs are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise _Unsupported("response_format", "only the text response format is supported")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class _Unsupported(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


_SECONDS = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")


def timeout_from_header(value: str | None) -> float | None:
    """`X-Request-Timeout`: plain decimal seconds in (0, 86400] (no signs, exponents,
    underscores, inf or nan), or None when absent."""
    if value is None:
        return None
    seconds = float(value) if _SECONDS.fullmatch(value.strip()) else 0.0
    if not 0 < seconds <= MAX_DEADLINE_MS / 1000:
        raise BadRequest(f"X-Request-Timeout: must be a number of seconds in (0, 86400] (got {value[:40]!r})",
                         param="X-Request-Timeout")
    return seconds


def timeout_from_field(value: object, param: str = "timeout_s") -> float | None:
    """A WebSocket request's `timeout_s`: a JSON number of seconds in (0, 86400], or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_DEADLINE_MS / 1000:
        raise BadRequest(f"{param}: must be a number of seconds in (0, 86400] (got {str(value)[:40]!r})",
                         param=param)
    return float(value)


def parse_chat_request(body: object) -> ChatRequest:
    """Validate a decoded JSON body; raise BadRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:      # before validating them all
        raise BadRequest(f"messages: at most {MAX_MESSAGES} messages (got {len(messages)})", param="messages")
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _Unsupported):
            raise BadRequest(f"{cause.field}: {cause}", param=cause.field) from None
        field = ".".join(str(p) for p in err["loc"]) or None
        message = err["msg"].removeprefix("Value error, ")
        raise BadRequest(f"{field}: {message}" if field else message, param=field) from None
