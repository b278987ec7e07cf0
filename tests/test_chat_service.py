"""The chat pipeline's contract without torch: a fake engine that finishes, fails
mid-stream, stalls and is left early, a fake clock, the real quota manager and ledger.
Every run ends with one terminal event (unless its consumer left), one settlement, and
the bill the protocol promises."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine import EngineOverloaded, RequestOutput
from gateway.errors import (ContextLengthExceeded, DeadlineExceeded, Draining, InternalError, Overloaded,
                            RateLimited)
from gateway.metrics import GatewayMetrics
from gateway.streaming import ChatService, Delta, Done, Failed
from tests.fake_engine import FakeEngine
from tests.live import FakeClock, fake_quotas, tenants

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
def clock():
    return FakeClock()


def service(engine, clock, tmp_path, **limits) -> tuple[ChatService, object]:
    registry = tenants(acme=limits)
    quotas = fake_quotas(clock, tmp_path / "usage.sqlite3")
    chat = ChatService(engine, quotas, GatewayMetrics(), model_name="tiny", clock=clock)
    chat.on_engine_started()
    chat.ready = True
    return chat, registry.tenants["acme"]


async def events_of(chat, adm) -> list:
    return [event async for event in chat.run(adm)]


async def test_finish_gives_one_done_and_bills_prompt_plus_completion(clock, tmp_path):
    """Deltas then one Done; num_tokens (a textless step included) add up to completion_tokens."""
    engine = FakeEngine([(1, "He"), (1, ""), (2, "llo")])
    chat, acme = service(engine, clock, tmp_path)
    adm = await chat.admit(acme, {"messages": HELLO}, transport="ws")
    events = await events_of(chat, adm)
    assert [type(e) for e in events] == [Delta, Delta, Done]
    done = events[-1]
    assert sum(e.num_tokens for e in events[:-1]) == done.usage.completion_tokens == 4
    assert done.usage.prompt_tokens == len("hello") and done.finish_reason == "stop"
    assert chat.admitter.quotas.ledger.used_today("acme") == 5 + 4
    assert adm.lease.settled and not chat.active


async def test_a_trailing_textless_token_is_still_counted(clock, tmp_path):
    """A final step whose token has no text (an end-of-sequence token) reaches the deltas' sum."""
    engine = FakeEngine([(1, "Hi"), (1, "")])
    chat, acme = service(engine, clock, tmp_path)
    events = await events_of(chat, await chat.admit(acme, {"messages": HELLO}, transport="sse"))
    assert sum(e.num_tokens for e in events if isinstance(e, Delta)) == events[-1].usage.completion_tokens == 2


async def test_failure_mid_stream_is_one_failed_event_billed_once(clock, tmp_path):
    """An engine error after a token ends with one Failed(InternalError), billed prompt + what was produced."""
    engine = FakeEngine([(1, "a")], finish="error", error="boom")
    chat, acme = service(engine, clock, tmp_path)
    events = await events_of(chat, await chat.admit(acme, {"messages": HELLO}, transport="ws"))
    assert [type(e) for e in events] == [Delta, Failed]
    assert isinstance(events[-1].error, InternalError) and not events[-1].before_first_token
    assert chat.admitter.quotas.ledger.used_today("acme") == 5 + 1
    assert len(engine.finals) == 1


async def test_deadline_after_prefill_bills_the_computed_prompt(clock, tmp_path):
    """A request that ends without a token pays the prompt tokens the engine computed (the billing hole)."""
    engine = FakeEngine([], finish="deadline", computed=3)
    chat, acme = service(engine, clock, tmp_path)
    events = await events_of(chat, await chat.admit(acme, {"messages": HELLO}, transport="ws"))
    assert len(events) == 1 and isinstance(events[0].error, DeadlineExceeded) and events[0].before_first_token
    assert chat.admitter.quotas.ledger.used_today("acme") == 3


async def test_leaving_before_the_first_token_still_settles_once_with_the_computed_prompt(clock, tmp_path):
    """A consumer that leaves a stalled request gets no event; the engine's final output settles the lease."""
    engine = FakeEngine(["stall"], computed=4)
    chat, acme = service(engine, clock, tmp_path)
    adm = await chat.admit(acme, {"messages": HELLO}, transport="sse")
    events = chat.run(adm)
    step = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0)
    step.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await step
    await events.aclose()
    await asyncio.sleep(0)          # the engine's final output lands on the next loop pass
    assert adm.lease.settled and chat.admitter.quotas.ledger.used_today("acme") == 4
    assert chat.admitter.quotas.in_flight("acme") == 0 and len(engine.finals) == 1


async def test_refused_by_the_engine_is_one_failed_and_bills_nothing(clock, tmp_path):
    """A queue limit hit between admission and generate is a Failed(Overloaded), billed 0."""
    engine = FakeEngine(refuse=EngineOverloaded("full", limit="requests"))
    chat, acme = service(engine, clock, tmp_path)
    events = await events_of(chat, await chat.admit(acme, {"messages": HELLO}, transport="http"))
    assert len(events) == 1 and isinstance(events[0].error, Overloaded)
    assert chat.admitter.quotas.ledger.used_today("acme") == 0 and chat.admitter.quotas.in_flight("acme") == 0


async def test_drain_stops_a_stalled_request_with_draining(clock, tmp_path):
    """drain() aborts what is still running; its stream ends with Failed(Draining)."""
    engine = FakeEngine(["stall"])
    chat, acme = service(engine, clock, tmp_path)
    run = asyncio.ensure_future(events_of(chat, await chat.admit(acme, {"messages": HELLO}, transport="ws")))
    await asyncio.sleep(0)
    await chat.drain(0.0)
    events = await run
    assert len(events) == 1 and isinstance(events[0].error, Draining)
    with pytest.raises(Draining):
        await chat.admit(acme, {"messages": HELLO}, transport="ws")


async def test_a_too_long_prompt_is_refused_before_tokenizing_and_still_counts_a_request(clock, tmp_path):
    """The character bound refuses an over-long prompt without encoding it; the request
    counted against requests_per_minute, so a flood of them hits the tenant's own limit."""
    engine = FakeEngine()
    chat, acme = service(engine, clock, tmp_path, requests_per_minute=2, max_prompt_tokens=10)
    with pytest.raises(ContextLengthExceeded) as exc:
        await chat.admit(acme, {"messages": [{"role": "user", "content": "x" * 11}]}, transport="http")
    assert "at least 11" in exc.value.message and engine.tokenizer.encoded == 0
    with pytest.raises(ContextLengthExceeded):
        await chat.admit(acme, {"messages": [{"role": "user", "content": "x" * 100}]}, transport="http")
    with pytest.raises(RateLimited) as limited:
        await chat.admit(acme, {"messages": HELLO}, transport="http")
    assert limited.value.reason == "requests_per_minute"
    assert chat.admitter.quotas.in_flight("acme") == 0 and engine.tokenizer.encoded == 0


async def test_timeout_deadline_and_tenant_bound_take_the_earliest(clock, tmp_path):
    """The deadline is arrival + the smallest of timeout_s, deadline_ms and the tenant's bound."""
    chat, acme = service(FakeEngine(), clock, tmp_path, deadline_ms=5000)
    adm = await chat.admit(acme, {"messages": HELLO, "deadline_ms": 3000}, transport="ws", timeout_s=1.5)
    assert adm.deadline == pytest.approx(clock.now + 1.5)
    adm.lease.settle(0)
    adm = await chat.admit(acme, {"messages": HELLO}, transport="ws", timeout_s=60)
    assert adm.deadline == pytest.approx(clock.now + 5.0)
    adm.lease.settle(0)
