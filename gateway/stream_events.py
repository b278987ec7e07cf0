"""What `ChatService.run()` yields (`Delta`, then one `Done` or `Failed`), and the small
accumulator that turns a request's engine outputs into those events.

The accumulator knows nothing of quotas or transports: it counts tokens, times the first
and following ones, holds the tokens (and logprobs) of outputs that carried no text until
the next delta, and remembers how each choice ended. Anything that goes wrong reaches the
caller as a `GatewayError` (`refusal`, `failure`), never as a string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import EngineOverloaded

from .errors import BadRequest, DeadlineExceeded, GatewayError, InternalError, Overloaded


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


@dataclass
class Delta:
    text: str
    num_tokens: int     # the deltas' num_tokens add up to usage.completion_tokens
    index: int = 0      # the choice (request `n`)
    logprobs: list | None = None        # engine TokenLogprobs of this delta's tokens (when asked)
    finish_reason: str | None = None    # set on a choice's last delta


@dataclass
class Done:
    finish_reason: str          # stop | length | abort (cancelled by the client)
    usage: Usage
    timings: dict
    finish_reasons: list = field(default_factory=list)      # per choice (request `n`)


@dataclass
class Failed:
    error: GatewayError
    usage: Usage
    timings: dict
    before_first_token: bool


def streamed(usage: Usage) -> int:
    """What the gateway itself saw streamed: prompt + completion once a token came. The
    engine's final counts are billed, never less than this (a final output made up when
    the engine stops or fails with requests in flight carries no counts)."""
    return usage.total_tokens if usage.completion_tokens else 0


def refusal(exc: Exception) -> GatewayError:
    """The GatewayError for an engine that refused a request before queueing it (or had
    stopped): overloaded, invalid, or gone."""
    if isinstance(exc, EngineOverloaded):
        return Overloaded(f"the engine is overloaded ({exc}); retry later", retry_after=exc.retry_after)
    if isinstance(exc, ValueError):
        return BadRequest(str(exc))
    return InternalError(f"the engine failed this request: {exc}")


class StreamAccumulator:
    """One request's engine outputs, folded into deltas, usage, timings and its ending."""

    def __init__(self, n: int, prompt_tokens: int, clock, itl):
        self.n = n
        self.clock = clock
        self.itl = itl                          # live.ItlWindow: gaps between tokens
        self.usage = Usage(prompt_tokens, 0)
        self.first: float | None = None         # when the first token came
        self.last: float | None = None
        self.queued_s: float | None = None      # the engine's arrival to first scheduled
        self.finishes = ["abort"] * n           # per choice
        self.finish = "abort"                   # the request's: the first choice's, or the first failure's
        self.error: str | None = None           # the engine's message with a failing finish
        self._unsent = [0] * n                  # tokens of outputs that carried no text yet
        self._held: list = [None] * n           # their logprobs

    def add(self, index: int, out) -> Delta | None:
        """Fold in one engine output of choice `index`; the delta to send, if any."""
        if out.new_token_ids:
            now = self.clock()
            if self.first is None:
                self.first = now
            else:
                self.itl.add(now - self.last)
            self.last = now
            self.usage.completion_tokens += len(out.new_token_ids)
            self._unsent[index] += len(out.new_token_ids)
            if out.logprobs:
                self._held[index] = (self._held[index] or []) + list(out.logprobs)
        if out.queue_time_s is not None:
            self.queued_s = out.queue_time_s
        if out.finished:
            self.finishes[index] = out.finish_reason
            if self.finish == "abort" or out.finish_reason not in ("stop", "length"):
                self.finish, self.error = out.finish_reason, out.error
        if not (out.new_text or (out.finished and (self._unsent[index] or self.n > 1))):
            return None
        delta = Delta(out.new_text, self._unsent[index], index, self._held[index],
                      out.finish_reason if out.finished and self.n > 1 else None)
        self._unsent[index], self._held[index] = 0, None
        return delta

    def failure(self, grammar_field: str) -> GatewayError | None:
        """How the engine ended the request, as a GatewayError; None if it finished (stop,
        length) or was cancelled (abort). `grammar_field` names the request field whose
        grammar a failed compile blames."""
        if self.finish == "deadline":
            n = self.usage.completion_tokens
            when = "before the first token" if n == 0 else f"after {n} token{'s' if n > 1 else ''}"
            return DeadlineExceeded(f"the request's deadline passed {when}")
        if self.finish == "error" and str(self.error).startswith("grammar:") and self.usage.completion_tokens == 0:
            return BadRequest(f"{grammar_field}: {self.error}", param=grammar_field)   # the compile failed or ran too long
        if self.finish == "error":
            return InternalError(f"the engine failed this request: {self.error}")
        return None

    def timings(self, arrival: float) -> dict:
        now = self.clock()
        timings = {"queue_ms": None if self.queued_s is None else round(self.queued_s * 1000, 2),
                   "ttft_ms": None if self.first is None else round((self.first - arrival) * 1000, 2),
                   "total_ms": round((now - arrival) * 1000, 2)}
        if self.first is not None and self.usage.completion_tokens > 1 and now > self.first:
            timings["tokens_per_s"] = round((self.usage.completion_tokens - 1) / (now - self.first), 2)
        return timings
