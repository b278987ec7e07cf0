"""The stream accumulator behind ChatService.run: deltas carry every token once, textless
tokens ride with the next text, and every way a stream fails is a GatewayError."""

from __future__ import annotations

import pytest

from engine import EngineOverloaded, RequestOutput
from gateway.errors import BadRequest, DeadlineExceeded, GatewayError, InternalError, Overloaded
from gateway.live import ItlWindow
from gateway.stream_events import StreamAccumulator, refusal
from tests.live import FakeClock


def out(tokens: int, text: str, finish: str | None = None, error: str | None = None) -> RequestOutput:
    return RequestOutput("r", [7] * tokens, text, finish is not None, finish, 3, 0, error=error)


def acc(n: int = 1) -> StreamAccumulator:
    clock = FakeClock()
    return StreamAccumulator(n, 3, clock, ItlWindow(clock=clock))


def test_textless_tokens_ride_with_the_next_delta():
    """A token without text is counted in the next delta; the deltas add up to the usage."""
    a = acc()
    assert a.add(0, out(1, "")) is None
    first = a.add(0, out(1, "Hi"))
    last = a.add(0, out(1, "", finish="stop"))
    assert (first.text, first.num_tokens, last.num_tokens) == ("Hi", 2, 1)
    assert a.usage.completion_tokens == 3 and a.finish == "stop" and a.failure("response_format") is None


def test_a_failing_choice_decides_the_requests_ending():
    """With n=2, a choice that fails after the other finished makes the request fail."""
    a = acc(2)
    a.add(0, out(1, "a", finish="length"))
    a.add(1, out(0, "", finish="error", error="boom"))
    assert a.finishes == ["length", "error"]
    assert isinstance(a.failure("response_format"), InternalError)


@pytest.mark.parametrize("finish, error, tokens, want", [
    ("deadline", None, 0, DeadlineExceeded),
    ("error", "grammar: bad schema", 0, BadRequest),
    ("error", "grammar: too slow", 2, InternalError),
    ("error", "RuntimeError: x", 0, InternalError),
])
def test_every_engine_failure_is_a_gateway_error(finish, error, tokens, want):
    """Deadline, a grammar that failed to compile (before any token), any other error."""
    a = acc()
    if tokens:
        a.add(0, out(tokens, "xy"))
    a.add(0, out(0, "", finish=finish, error=error))
    failure = a.failure("tools")
    assert isinstance(failure, want) and isinstance(failure, GatewayError)
    if want is BadRequest:
        assert failure.param == "tools"


@pytest.mark.parametrize("exc, want", [
    (EngineOverloaded("full", limit="max_queued_requests", retry_after=2.5), Overloaded),
    (ValueError("prompt_token_ids: too long"), BadRequest),
    (RuntimeError("AsyncEngine is not running"), InternalError),
])
def test_refusals_are_gateway_errors(exc, want):
    """An engine that refuses before queueing (or is gone) maps to one GatewayError each."""
    err = refusal(exc)
    assert type(err) is want and str(exc) in err.message
    if want is Overloaded:
        assert err.retry_after == 2.5
