"""After every gateway test, every counter and registry a request or socket takes from is
back to its idle value (docs/PROTOCOL.md, "Resources"): `Gateway.held()` read on the
server's own event loop."""

from __future__ import annotations

import time

import pytest

IDLE = {"chat.active": 0, "stats.subscribers": 0, "stats_slots": {}, "sockets": {}, "pending_sockets": 0,
        "pending_by_address": {}, "quota.in_flight": {}, "open_streams": {}, "open_websockets": 0,
        "billing.unwritten": 0}


def held(live) -> dict:
    async def read():
        return live.gateway.held()
    return live.call(read)


def assert_idle(live, timeout: float = 15.0) -> None:
    """Wait (on the server's own state, not a timer) until nothing is held; fail naming what is."""
    end = time.monotonic() + timeout
    now = held(live)
    while now != IDLE and time.monotonic() < end:
        time.sleep(0.02)
        now = held(live)
    assert now == IDLE, {k: v for k, v in now.items() if v != IDLE[k]}


@pytest.fixture
def idle_after(request):
    """Use in a module whose tests share a `live` server: each test must leave it idle."""
    yield
    if "live" in request.fixturenames:
        live = request.getfixturevalue("live")
        if live.thread.is_alive():
            assert_idle(live)
