"""Two real `streamgate serve --redis` replicas (tiny model) on one real redis-server: under
parallel load split across both, a tenant's requests/min, concurrency and daily budget
hold exactly as in one process; billed tokens add up to Redis's ledger and outlive a Redis
crash (AOF); an admission is one round trip; Redis stopped means 503
`quota_backend_unavailable` and service resumes when it returns; both serve the vLLM-named
series routers scrape. (The killed-replica test runs last: it kills replica 0.)"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import time

import httpx
import pytest
import redis
import websockets
from prometheus_client.parser import text_string_to_metric_families

from bench.redis_server import free_port
from tenants.redis_scripts import BEGIN, TOKENS

from .redis_server import wait_healthy
from .replicas import LONG, TTL, key, redis_server, replicas  # noqa: F401  (fixtures)

async def post(client: httpx.AsyncClient, url: str, tenant: str, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, **body}
    return await client.post(f"{url}/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key(tenant)}"})


async def burst(urls: list[str], tenant: str, n: int, **body) -> list[httpx.Response]:
    """`n` requests at once, alternating replicas."""
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(post(client, urls[i % 2], tenant, **body) for i in range(n)))


def codes(responses) -> list:
    return sorted("ok" if r.status_code == 200 else r.json()["error"]["code"] for r in responses)


def redis_billed(url: str, tenant: str) -> int:
    r = redis.Redis.from_url(url)
    day = int(r.time()[0]) // 86400
    return int(r.hget(f"{{sg:{tenant}}}:billed", day) or 0)


def test_requests_per_minute_hold_across_replicas(replicas):
    """20 parallel requests split across two replicas: the tenant's full bucket of 6 passes,
    plus at most what it refilled (one per 10 s) while the burst lasted; the rest get 429."""
    start = time.monotonic()
    got = codes(asyncio.run(burst(replicas.urls, "rpm", 20)))
    refilled = int((time.monotonic() - start) * 6 / 60)
    assert got == ["ok"] * got.count("ok") + ["requests_per_minute"] * (20 - got.count("ok"))
    assert 6 <= got.count("ok") <= 6 + refilled


def test_concurrency_holds_across_replicas_and_frees_on_disconnect(replicas):
    """12 parallel long streams split across two replicas: exactly max_concurrent=3 run, the
    rest get 429 max_concurrent; once the streams are closed the slots come back."""

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            async def open_stream(i: int):
                req = client.build_request("POST", f"{replicas.urls[i % 2]}/v1/chat/completions",
                                           json={"messages": [{"role": "user", "content": "go"}], **LONG},
                                           headers={"Authorization": f"Bearer {key('conc')}"})
                resp = await client.send(req, stream=True)
                if resp.status_code == 200:
                    resp.lines = resp.aiter_lines()     # held: dropping the iterator closes the stream
                    await anext(resp.lines)             # it runs
                else:
                    await resp.aread()
                return resp

            streams = await asyncio.gather(*(open_stream(i) for i in range(12)))
            running = [s for s in streams if s.status_code == 200]
            refused = [s.json()["error"]["code"] for s in streams if s.status_code != 200]
            assert len(running) == 3 and refused == ["max_concurrent"] * 9
            again = await post(client, replicas.urls[1], "conc")
            assert again.status_code == 429 and again.json()["error"]["code"] == "max_concurrent"
            for s in running:
                await s.aclose()
            deadline = time.monotonic() + 20
            while (r := await post(client, replicas.urls[0], "conc")).status_code != 200:
                assert time.monotonic() < deadline, "the closed streams' slots did not come back"
                await asyncio.sleep(0.1)

    asyncio.run(scenario())


def test_daily_budget_holds_and_billed_tokens_equal_redis_ledger(replicas, redis_server):
    """Parallel clients on both replicas stop at the daily budget; the usage the replicas
    reported adds up to the tokens Redis billed, which never pass the budget."""

    need = 0  # what one request reserves: its prompt + max_tokens

    async def scenario() -> int:
        billed = 0
        async with httpx.AsyncClient(timeout=60) as client:
            async def client_loop(i: int) -> None:
                nonlocal billed, need
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    r = await post(client, replicas.urls[i % 2], "daily", max_tokens=5)
                    if r.status_code == 200:
                        billed += r.json()["usage"]["total_tokens"]
                        need = r.json()["usage"]["prompt_tokens"] + 5
                        continue
                    assert r.json()["error"]["code"] == "daily_tokens", r.text
                    if need and redis_billed(redis_server.url, "daily") + need > 300:  # not held: billed
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError("the daily budget never ran out")

            await asyncio.gather(*(client_loop(i) for i in range(6)))
        return billed

    billed = asyncio.run(scenario())
    deadline = time.monotonic() + 10
    while redis_billed(redis_server.url, "daily") != billed:   # the outboxes flush in the background
        assert time.monotonic() < deadline, (redis_billed(redis_server.url, "daily"), billed)
        time.sleep(0.05)
    assert 300 - need < billed <= 300


def test_vllm_series_on_both_replicas(replicas):
    """Each replica's /metrics has the vLLM-named gauges routers scrape, with model_name."""
    for url in replicas.urls:
        text = httpx.get(f"{url}/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                     "vllm:gpu_cache_usage_perc", "vllm:cache_config_info"):
            assert families[name].type == "gauge" and "model_name" in families[name].samples[0].labels


ROUTER = os.path.join(os.environ.get("STREAMGATE_CACHE") or os.path.expanduser("~/.cache/streamgate"),
                      "vllm-router", "bin", "vllm-router")


def served(url: str) -> float:
    """Chat requests this replica answered with 200 for tenant `free` (its own /metrics)."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return sum(s.value for f in families if f.name == "streamgate_gateway_requests" for s in f.samples
               if s.name.endswith("_total") and s.labels["tenant"] == "free" and s.labels["status"] == "200")


def test_sse_streams_through_vllm_router_to_both_replicas(replicas, tmp_path):
    """vllm-router (PyPI, round robin) in front of the two replicas: 8 streamed chat
    completions flow through it intact and each replica serves some of them."""
    if not os.path.exists(ROUTER):
        pytest.fail(f"{ROUTER} is missing: run `bash scripts/ensure_router.sh` (`make test` does)")
    port = free_port()
    router = subprocess.Popen([ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                               "--worker-urls", *replicas.urls, "--prometheus-port", str(free_port()),
                               "--worker-startup-check-interval", "1"],
                              stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        # the router answers once it has seen the workers' /health at 200
        wait_healthy(url, router, 90, lambda: (tmp_path / "router.log").read_text()[-2000:])
        before = [served(u) for u in replicas.urls]
        for _ in range(8):
            with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                              headers={"Authorization": f"Bearer {key('free')}"},
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                    "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert data[-1] == "[DONE]"
            chunks = [json.loads(d) for d in data[:-1]]
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert sum(c.get("num_tokens", 0) for c in chunks) == 3
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        gained = [served(u) - b for u, b in zip(replicas.urls, before)]
        assert sum(gained) == 8 and min(gained) >= 1, gained
    finally:
        router.terminate()
        router.wait(10)


async def ws_request(url: str) -> dict:
    """One WebSocket chat.request; its terminal message (chat.done or error)."""
    async with websockets.connect(url.replace("http", "ws") + "/v1/chat/ws") as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": key("free")}))
        assert json.loads(await ws.recv())["type"] == "auth.ok"
        await ws.send(json.dumps({"type": "chat.request", "id": 1, "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "hi"}]}))
        while (msg := json.loads(await ws.recv()))["type"] not in ("chat.done", "error"):
            pass
        return msg


def test_redis_down_is_503_and_service_resumes_when_it_returns(replicas, redis_server):
    """Redis stopped: both replicas answer 503 quota_backend_unavailable with Retry-After
    (on the WebSocket an error event with retry_after); once it is back (same port, AOF),
    they serve again without a restart."""
    redis_server.stop()
    try:
        for url in replicas.urls:
            r = asyncio.run(burst([url, url], "free", 1))[0]
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "quota_backend_unavailable"
            assert int(r.headers["retry-after"]) >= 1
            err = asyncio.run(ws_request(url))["error"]
            assert err["code"] == "quota_backend_unavailable" and err["retry_after"] >= 1
    finally:
        redis_server.start()
    for url in replicas.urls:
        deadline = time.monotonic() + 10
        while (r := asyncio.run(burst([url, url], "free", 1))[0]).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
    assert asyncio.run(ws_request(replicas.urls[1]))["type"] == "chat.done"


def test_an_admission_through_serve_is_one_round_trip(replicas, redis_server):
    """A chat request to a `serve --redis` replica makes one admission script call (BEGIN,
    its token estimate prepaid), never the second step (TOKENS), seen in Redis's own log."""
    admin = redis.Redis.from_url(redis_server.url)
    names = {hashlib.sha1(s.encode()).hexdigest(): n for n, s in (("BEGIN", BEGIN), ("TOKENS", TOKENS))}
    for script in (BEGIN, TOKENS):
        admin.script_load(script)                       # no NOSCRIPT miss in the log
    admin.config_set("slowlog-log-slower-than", 0)
    admin.slowlog_reset()
    try:
        got = codes(asyncio.run(burst(replicas.urls, "free", 4)))
        calls = [e["command"].split() for e in admin.slowlog_get(1000)]
    finally:
        admin.config_set("slowlog-log-slower-than", 10_000)
    assert got == ["ok"] * 4
    scripts = [names.get(c[1].decode(), "other") for c in calls if c[0].upper() == b"EVALSHA"]
    assert scripts.count("BEGIN") == 4 and "TOKENS" not in scripts


def test_usage_billed_through_serve_outlives_a_redis_crash(replicas, redis_server):
    """Tokens billed by both replicas survive Redis being killed (SIGKILL) and restarted
    with AOF; the replicas then serve and bill on top of them."""
    before = redis_billed(redis_server.url, "free")
    used = sum(r.json()["usage"]["total_tokens"] for r in asyncio.run(burst(replicas.urls, "free", 4)))
    deadline = time.monotonic() + 10
    while redis_billed(redis_server.url, "free") != before + used:    # the outboxes flush
        assert time.monotonic() < deadline, (redis_billed(redis_server.url, "free"), before + used)
        time.sleep(0.05)
    redis_server.stop(signal.SIGKILL)
    redis_server.start()
    assert redis_billed(redis_server.url, "free") == before + used
    deadline = time.monotonic() + 10
    while (r := asyncio.run(burst(replicas.urls, "free", 1))[0]).status_code != 200:   # reconnect
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)
    more = r.json()["usage"]["total_tokens"]
    while redis_billed(redis_server.url, "free") != before + used + more:
        assert time.monotonic() < deadline + 10, redis_billed(redis_server.url, "free")
        time.sleep(0.05)


def test_a_killed_replica_frees_its_slots_within_the_lease_ttl(replicas):
    """Replica 0 holds all 3 of a tenant's slots with long streams and is killed with
    SIGKILL: replica 1 refuses max_concurrent at first, then admits within the lease TTL."""

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            held = []
            for _ in range(3):
                req = client.build_request("POST", f"{replicas.urls[0]}/v1/chat/completions",
                                           json={"messages": [{"role": "user", "content": "go"}], **LONG},
                                           headers={"Authorization": f"Bearer {key('conc')}"})
                resp = await client.send(req, stream=True)
                assert resp.status_code == 200
                resp.lines = resp.aiter_lines()         # held: dropping the iterator closes the stream
                await anext(resp.lines)
                held.append(resp)
            refused = await post(client, replicas.urls[1], "conc")
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "max_concurrent"
            replicas.procs[0].kill()
            killed = time.monotonic()
            while (await post(client, replicas.urls[1], "conc")).status_code != 200:
                assert time.monotonic() - killed < TTL + 5, "the killed replica's leases were not freed"
                await asyncio.sleep(0.1)

    asyncio.run(scenario())
