"""The chat request body, shared by HTTP and WebSocket, validated with pydantic so every
error names its field (`messages.0.role: ...`). The parts OpenAI's newer fields add
(tools, tool calls, response formats) are in gateway/schema_parts.py.

Fields that cannot be honoured (the deprecated `functions`/`function_call`, combinations
that contradict each other) are refused with a 400 naming the field instead of being
silently ignored.
"""

from __future__ import annotations

import re

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import BadRequest
from .schema_parts import Message, ResponseFormat, StreamOptions, TextPart, Tool, ToolChoice  # noqa: F401

MAX_DEADLINE_MS = 86_400_000        # one day
# Each message costs validation on the event loop and chat-template rendering, which holds
# the GIL, per message whatever its length: 25k empty messages (0.8 MB) stalled every
# stream for seconds. Checked before validation.
MAX_MESSAGES = 1024
MAX_N = 16                          # choices per request (each is an engine request)
MAX_TOP_LOGPROBS = 20               # as OpenAI
MAX_LOGIT_BIAS = 300                # entries, as OpenAI
MAX_TOOLS = 128                     # as OpenAI


class SamplingFields(BaseModel):
    """What chat and completions requests share: limits, sampling and the extensions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, gt=0, lt=2**31)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, lt=2**31)     # as in vLLM; 0 = off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-2**63, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)     # as in vLLM; 1 = off
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # streamgate extensions
    priority: int | None = Field(default=None, ge=-2**31, lt=2**31)
    deadline_ms: int | None = Field(default=None, gt=0, le=MAX_DEADLINE_MS)
    ignore_eos: bool = False            # as in vLLM: generate exactly max_tokens (benchmarks)

    @field_validator("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "priority",
                     "deadline_ms", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "max_completion_tokens", "top_logprobs", "best_of", mode="before", check_fields=False)
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

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if not v:
            return None
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for key, bias in v.items():
            if not key.isascii() or not key.isdigit() or len(key) > 10:
                raise ValueError(f"keys are token ids (non-negative integers as strings), got {key[:20]!r}")
            if isinstance(bias, bool) or not -100 <= bias <= 100:
                raise ValueError(f"biases are numbers in [-100, 100], got {bias!r} for {key}")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0, lt=2**31)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    separate_reasoning: bool = True     # as in SGLang: <think> blocks as reasoning_content; false: inline
    functions: list | None = None
    function_call: object = None

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("functions", "function_call"):
            if getattr(self, name) not in (None, [], "none"):
                raise _Unsupported(name, "the deprecated function-calling fields are not supported; use tools "
                                         "and tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise _Unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise _Unsupported("tools", "two tools have the same function name")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise _Unsupported("tool_choice", "tool_choice names a tool or requires one, but no tools are given")
        if hasattr(choice, "function") and choice.function.name not in names:
            raise _Unsupported("tool_choice", f"tool_choice names {choice.function.name!r}, which is not in tools")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def tools_on(self) -> bool:
        """Whether tools are offered to the model (and its output parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None:
        """"required", a function's name (named tool_choice), or None (auto/none)."""
        if not self.tools_on or self.tool_choice in (None, "auto"):
            return None
        return "required" if self.tool_choice == "required" else self.tool_choice.function.name

    @property
    def num_top_logprobs(self) -> int | None:
        """None: no logprobs; 0: the chosen token's only; k: and the top k."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: one prompt, as text or token ids (a list holding one of
    either is accepted, as lm-eval sends it)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    default_max_tokens: ClassVar[int] = 16          # OpenAI's default here, clamped to the tenant's cap
    max_tokens: int | None = Field(default=None, ge=0, lt=2**31)     # 0 with echo: score the prompt only
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("one prompt per request (got a batch of " f"{len(v)}); send them separately")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("logprobs", mode="before")
    @classmethod
    def _not_a_bool(cls, v):            # (chat's logprobs is a boolean: not in the shared validator)
        if isinstance(v, bool):
            raise ValueError("must be a number, not a boolean")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.best_of not in (None, 1, self.n):
            raise _Unsupported("best_of", "best_of is not supported (only equal to n)")
        if self.suffix is not None and isinstance(self.prompt, list):
            raise _Unsupported("suffix", "suffix needs a text prompt")
        if self.max_tokens == 0 and not self.echo:
            raise _Unsupported("max_tokens", "max_tokens 0 needs echo: true (the prompt echoed, and scored with "
                                             "logprobs, nothing generated)")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The engine's prompt_logprobs: echo with logprobs scores the prompt (max_tokens 0
        alone needs them too: the engine generates nothing only for a scored prompt)."""
        if self.echo and self.logprobs is not None:
            return self.logprobs
        return 0 if self.max_tokens == 0 else None

    @property
    def forced_tool(self) -> None:
        return None


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
    return parse_body(ChatRequest, body)


REQUEST_KINDS = {"chat": ChatRequest, "completion": CompletionRequest}


def parse_body(model: type[BaseModel], body: object):
    """Validate a decoded JSON body as `model`; raise BadRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:      # before validating them all
        raise BadRequest(f"messages: at most {MAX_MESSAGES} messages (got {len(messages)})", param="messages")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _Unsupported):
            raise BadRequest(f"{cause.field}: {cause}", param=cause.field) from None
        field = ".".join(str(p) for p in err["loc"]) or None
        message = err["msg"].removeprefix("Value error, ")
        raise BadRequest(f"{field}: {message}" if field else message, param=field) from None
