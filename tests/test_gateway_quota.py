"""Tenant quotas through the real gateway, with a fake quota clock: rpm, tpm, concurrency,
the daily budget across a restart, Retry-After and x-ratelimit headers, per-request caps."""

from __future__ import annotations

import asyncio
import json

import httpx
import websockets

from tests.held_engine import HeldEngine
from tests.live import KEYS, FakeClock, engine_config, fake_quotas, serve, tenants, wait_until

HELLO = [{"role": "user", "content": "Hi!"}]


def chat(live, key: str = KEYS["acme"], **body) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                      json={"messages": HELLO, "max_tokens": 4, **body})


def test_requests_per_minute_with_retry_after_and_headers(tiny_model, tmp_path):
    """2 rpm: the third request is a 429 naming the limit, Retry-After 30 s; after 30 s it passes."""
    clock = FakeClock()
    with serve(tiny_model("llama"), tmp_path, registry=tenants(acme={"requests_per_minute": 2}),
               quotas=fake_quotas(clock, tmp_path / "q.sqlite3")) as live:
        first = chat(live)
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert chat(live).status_code == 200
        refused = chat(live)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "requests_per_minute"
        assert refused.headers["retry-after"] == "30"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        clock.advance(29.0)
        assert chat(live).status_code == 429
        clock.advance(1.0)
        assert chat(live).status_code == 200
        metrics = httpx.get(f"{live.url}/metrics").text
        assert 'streamgate_gateway_rate_limited_total{reason="requests_per_minute",tenant="acme"} 2.0' in metrics


def test_tokens_per_minute_reserves_prompt_plus_max_tokens_and_refunds(tiny_model, tmp_path):
    """A reservation beyond the tpm bucket is refused; unused reserved tokens come back at the end."""
    clock = FakeClock()
    quotas = fake_quotas(clock, tmp_path / "q.sqlite3")
    reg = tenants(acme={"tokens_per_minute": 600})
    with serve(tiny_model("llama"), tmp_path, registry=reg, quotas=quotas) as live:
        r = chat(live, max_tokens=200)      # reserves prompt + 200, uses prompt + 200
        assert r.status_code == 200
        used = r.json()["usage"]["total_tokens"]
        left = quotas.snapshot(reg.tenants["acme"])["tokens_available"]
        assert abs(left - (600 - used)) < 1
        refused = chat(live, max_tokens=500)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "tokens_per_minute"
        assert float(refused.headers["retry-after"]) >= 1
        r = chat(live, max_tokens=5, stop=None)
        assert r.status_code == 200
        # the refused request took nothing; the small one gave back all but what it used
        after = quotas.snapshot(reg.tenants["acme"])["tokens_available"]
        assert abs(after - (left - r.json()["usage"]["total_tokens"])) < 1


def test_concurrent_streams_cap_and_lease_return(tiny_model, tmp_path):
    """max_concurrent=1: a second request while one streams gets 429 max_concurrent; afterwards it passes."""
    reg = tenants(acme={"max_concurrent": 1})
    # the real engine held after 16 steps: the first stream runs until cancelled, whatever this host's speed
    model = tiny_model("llama")
    engine = HeldEngine(engine_config(model, max_num_seqs=2), steps=16)
    with serve(model, tmp_path, engine=engine, registry=reg, engine_kw={"max_num_seqs": 2}) as live:
        async def scenario():
            async with websockets.connect(live.ws_url) as ws:
                await ws.send(json.dumps({"type": "auth", "api_key": KEYS["acme"]}))
                await ws.recv()
                await ws.send(json.dumps({"type": "chat.request", "id": 1, "messages": HELLO, "max_tokens": 1500}))
                assert json.loads(await ws.recv())["type"] == "chat.delta"
                refused = await asyncio.to_thread(chat, live)
                await ws.send(json.dumps({"type": "chat.cancel", "id": 1}))
                while (msg := json.loads(await ws.recv()))["type"] == "chat.delta":     # read to the end
                    pass
                assert msg["type"] == "chat.done" and msg["finish_reason"] == "abort"
                return refused
        refused = asyncio.run(asyncio.wait_for(scenario(), 60))     # a bound, should it hang
        engine.release()
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "max_concurrent"
        assert refused.headers["retry-after"] == "1"
        assert wait_until(lambda: live.gateway.quotas.in_flight("acme") == 0)
        assert chat(live).status_code == 200


def test_daily_budget_survives_a_restart(tiny_model, tmp_path):
    """Usage is written to SQLite: a new app over the same file still refuses past the budget."""
    clock = FakeClock()
    db = tmp_path / "ledger.sqlite3"
    reg = tenants(acme={"daily_tokens": 120})
    with serve(tiny_model("llama"), tmp_path, registry=reg, quotas=fake_quotas(clock, db)) as live:
        r = chat(live, max_tokens=10)
        assert r.status_code == 200
        billed = r.json()["usage"]["total_tokens"]
    quotas = fake_quotas(clock, db)
    assert quotas.ledger.used_today("acme") == billed
    with serve(tiny_model("llama"), tmp_path, registry=reg, quotas=quotas) as live:
        need = 120 - billed + 1          # one token more than is left today
        refused = chat(live, max_tokens=max(1, need - r.json()["usage"]["prompt_tokens"]))
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "daily_tokens"
        assert int(refused.headers["retry-after"]) > 0
        clock.advance(86_400)           # the next UTC day
        assert chat(live, max_tokens=10).status_code == 200


def test_per_request_caps_priority_and_deadline_clamped_to_the_tenant(tiny_model, tmp_path):
    """max_tokens above the tenant cap is a 400 naming it; priority and deadline never exceed the tenant's."""
    reg = tenants(batch={"max_tokens": 8, "deadline_ms": 5000})
    with serve(tiny_model("llama"), tmp_path, registry=reg) as live:
        r = chat(live, KEYS["batch"], max_tokens=9)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        chat_service, tenant = live.gateway.chat, reg.tenants["batch"]

        async def admit(body, timeout_s=None):
            adm = await chat_service.admit(tenant, body, transport="http", timeout_s=timeout_s)
            adm.lease.settle(0)
            return adm
        adm = live.call(admit, {"messages": HELLO, "priority": 0, "deadline_ms": 60_000})
        assert adm.priority == 2                        # cannot raise urgency above class 2
        assert adm.params.max_tokens == 8               # the tenant cap is the default
        assert adm.deadline - adm.arrival <= 5.0 + 1e-6  # the tenant bound wins
        adm = live.call(admit, {"messages": HELLO, "priority": 5}, 1.5)
        assert adm.priority == 5 and abs(adm.deadline - adm.arrival - 1.5) < 1e-6
        r = httpx.post(f"{live.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['batch']}",
                       "X-Request-Timeout": "soon"}, json={"messages": HELLO})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Timeout"


def test_out_of_range_numbers_are_400s_naming_the_field(tiny_model, tmp_path):
    """Huge priority, seed or timeout values are refused with the field named (they must
    never reach the engine thread)."""
    with serve(tiny_model("llama"), tmp_path) as live:
        for body, param in (({"priority": 10**309}, "priority"), ({"seed": 2**64}, "seed"),
                            ({"top_k": 2**40}, "top_k"), ({"deadline_ms": 10**12}, "deadline_ms")):
            r = chat(live, **body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": HELLO},
                       headers={"Authorization": f"Bearer {KEYS['acme']}", "X-Request-Timeout": "1e400"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Timeout"
        assert chat(live).status_code == 200          # the engine is still fine


def test_release_returns_a_never_started_lease_once(tiny_model, tmp_path):
    """An admission whose stream never ran is released unbilled, exactly once."""
    with serve(tiny_model("llama"), tmp_path, registry=tenants(acme={"max_concurrent": 1})) as live:
        service, tenant = live.gateway.chat, live.gateway.registry.tenants["acme"]

        async def admit_and_release():
            adm = await service.admit(tenant, {"messages": HELLO}, transport="ws")
            busy = live.gateway.quotas.in_flight("acme")
            service.release(adm)
            service.release(adm)
            return busy
        assert live.call(admit_and_release) == 1
        assert live.gateway.quotas.in_flight("acme") == 0
        assert live.gateway.quotas.ledger.used_today("acme") == 0
        assert chat(live).status_code == 200
