"""Redis quota backend, one round trip per admission: `begin` takes the caller's estimate
of the tokens with the lease when the limits hold twice it; `reserve_tokens` then sends
nothing when the exact count is within it (the excess goes back by a background TRIM),
and otherwise reserves the difference, refusing only on the exact count. Counted with
Redis's own command log (SLOWLOG at 0 µs logs every command). Also: the gateway's
estimate, made before rendering, covers the real prompt."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
import redis
from tenants import Limits, QuotaExceeded, Tenant
from tenants.redis_quota import RedisQuotas
from tenants.redis_scripts import BEGIN, TOKENS, TRIM

from .redis_server import redis_server  # noqa: F401  (fixture)
from .test_quota_redis import drain


def sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


@pytest.fixture
async def backend(redis_server, tmp_path):
    b = RedisQuotas(redis_server.url, tmp_path / "outbox.sqlite", lease_ttl=5.0)
    await b.start()
    yield b
    await b.stop()


@pytest.fixture
def scripts_run(redis_server):
    """Returns the scripts Redis ran since the fixture started, by name, in order."""
    admin = redis.Redis.from_url(redis_server.url)
    admin.config_set("slowlog-log-slower-than", 0)
    admin.config_set("slowlog-max-len", 10_000)
    names = {sha(BEGIN): "BEGIN", sha(TOKENS): "TOKENS", sha(TRIM): "TRIM"}
    for script in (BEGIN, TOKENS, TRIM):                # no NOSCRIPT miss in the log
        admin.script_load(script)
    admin.slowlog_reset()

    def run() -> list[str]:
        entries = reversed(admin.slowlog_get(10_000))     # oldest first
        calls = [e["command"].split() for e in entries]
        return [names.get(c[1].decode(), "other") for c in calls if c[0].upper() == b"EVALSHA"]

    yield run
    admin.close()


def tenant(**limits) -> Tenant:
    return Tenant(name="acme", key_hashes=("0" * 64,), limits=Limits(**limits))


async def test_a_prepaid_estimate_makes_admission_one_round_trip(backend, scripts_run):
    """Far from the limits the estimate is taken with the lease; reserving a smaller exact
    count sends nothing, and the trim gives the excess back to both limits."""
    t = tenant(tokens_per_minute=6000, daily_tokens=100_000)
    began = time.monotonic()
    lease = await backend.begin(t, 500)
    assert lease.reserved_tokens == 500
    await lease.reserve_tokens(120)
    assert scripts_run() == ["BEGIN"] and lease.reserved_tokens == 120
    for _ in range(200):                                # the trim rides the sender's next batch
        if scripts_run() == ["BEGIN", "TRIM"]:
            break
        await asyncio.sleep(0.01)
    assert scripts_run() == ["BEGIN", "TRIM"]
    assert (await backend.snapshot(t))["daily_reserved"] == 120
    level = float(await backend.redis.hget(backend.keys("acme")["q"], "tt"))
    assert 6000 - 120 <= level <= 6000 - 120 + 100 * (time.monotonic() - began)  # refills 100/s
    lease.settle(100)
    await drain(backend)
    snap = await backend.snapshot(t)
    assert snap == {"in_flight": 0, "daily_reserved": 0, "daily_used": 100}


async def test_near_a_limit_admission_is_exact_in_two_steps(backend, scripts_run):
    """When tokens/min holds less than twice the estimate nothing is prepaid: the exact
    count is reserved in a second step, so a request that fits is admitted and one that
    does not is refused, as in one process."""
    t = tenant(tokens_per_minute=1000)
    first = await backend.begin(t, 850)
    assert first.reserved_tokens == 0                   # 1000 < 2 x 850
    await first.reserve_tokens(850)
    fits = await backend.begin(t, 100)                  # ~150 left: not prepaid ...
    await fits.reserve_tokens(140)                      # ... but the exact 140 fits
    assert fits.reserved_tokens == 140
    too_big = await backend.begin(t, 5)
    with pytest.raises(QuotaExceeded) as exc:
        await too_big.reserve_tokens(100)
    assert exc.value.reason == "tokens_per_minute" and exc.value.retry_after > 0
    assert scripts_run() == ["BEGIN", "TOKENS", "BEGIN", "TOKENS", "BEGIN", "TOKENS"]
    for lease in (first, fits, too_big):
        lease.settle(0)
    await drain(backend)


async def test_an_estimate_below_the_count_reserves_the_difference(backend, scripts_run):
    """An estimate that falls short costs a second round trip for the difference only; a
    total above the limit can never fit, whatever was prepaid."""
    t = tenant(tokens_per_minute=1000, daily_tokens=5000)
    short = await backend.begin(t, 100)
    assert short.reserved_tokens == 100
    await short.reserve_tokens(250)
    assert short.reserved_tokens == 250 and scripts_run() == ["BEGIN", "TOKENS"]
    assert (await backend.snapshot(t))["daily_reserved"] == 250
    never = await backend.begin(t, 100)
    with pytest.raises(QuotaExceeded) as exc:
        await never.reserve_tokens(1001)
    assert exc.value.reason == "tokens_per_minute" and exc.value.retry_after is None
    assert "reserves 1001 tokens" in str(exc.value)
    never.settle(0)
    short.settle(250)
    await drain(backend)
    assert (await backend.snapshot(t)) == {"in_flight": 0, "daily_reserved": 0, "daily_used": 250}


async def test_a_settlement_before_the_trim_gives_back_the_whole_prepaid(backend):
    """A lease settled before its trim was sent (a request that ends at once) drops the trim:
    the settlement alone refunds tokens/min and the daily hold, nothing twice."""
    t = tenant(tokens_per_minute=100_000, daily_tokens=100_000)
    lease = await backend.begin(t, 900)
    await lease.reserve_tokens(100)
    lease.settle(40)                                    # before the sender ran
    await drain(backend)
    await backend.flush()
    snap = await backend.snapshot(t)
    assert snap == {"in_flight": 0, "daily_reserved": 0, "daily_used": 40}
    level = float(await backend.redis.hget(backend.keys("acme")["q"], "tt"))
    assert 100_000 - 40 <= level <= 100_000


def test_the_gateway_estimate_covers_the_rendered_prompt(tokenizer_dir):
    """The estimate made before rendering (message lengths + the template's measured bytes)
    is at least the prompt's real token count, for ASCII, non-ASCII and system messages."""
    from transformers import AutoTokenizer

    from gateway.tokenize import Tokenizers
    from gateway.schemas import parse_chat_request

    tokenizers = Tokenizers(AutoTokenizer.from_pretrained(tokenizer_dir), workers=1)
    try:
        for messages in ([{"role": "user", "content": "hello there"}],
                         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Why? " * 300}],
                         [{"role": "user", "content": "héllo wörld 日本語 " * 40},
                          {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]):
            estimate = tokenizers.estimate_prompt(parse_chat_request({"messages": messages}).messages)
            real = len(tokenizers.encode(tokenizers.render(messages)))
            assert real <= estimate < 8 * real + 200, (messages[0]["content"][:20], real, estimate)
    finally:
        tokenizers.close()
