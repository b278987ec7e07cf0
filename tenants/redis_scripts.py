"""The Redis quota backend's Lua scripts: each runs atomically on the server, so an
admission (BEGIN: lease + request, and the tokens when its estimate is prepaid; TOKENS:
tokens/min + daily budget when it was not), a trim (TRIM) and a settlement (SETTLE) are
one round trip each, with no check-then-act race between replicas. Time is the server's
`TIME`, never a replica's clock.

Keys of one tenant share the hash tag `{sg:<tenant>}` (one Redis Cluster slot):
    q        hash  rt/rts, tt/tts: requests/tokens bucket level and when it was computed;
                   reserved: daily-budget tokens held by leases in flight
    leases   zset  lease id -> expiry (ms); a heartbeat pushes expiry forward
    held     hash  lease id -> tokens it reserved
    billed   hash  UTC day number -> tokens billed that day
    expired  zset  lease id -> when its heartbeat was found stopped (kept a day), so that
                   its late settlement (replayed from an outbox) is still billed, once
    settled  zset  lease id -> when a settlement found no lease to settle (kept an hour): a
                   BEGIN that arrives after its own settlement (the caller gave up, and the
                   settlement overtook it on another pooled connection) takes nothing
BEGIN is idempotent by lease id: sent again (a lost reply), it returns what the first took.
A settlement bills its lease if the lease is in `held` or `expired`, and removes it from
there in the same script: sent twice, the second finds it in neither and does nothing.
Memory is in proportion to the leases in flight and recently expired, not to traffic.

The buckets are token buckets holding up to the per-minute limit, refilled continuously
(the embedded backend's rule), so one tenant sees the same limits from 1 or N replicas.
"""

from __future__ import annotations

import math

from .buckets import EPS, format_duration
from .models import Tenant
from .quota import CONCURRENCY_RETRY_S, QuotaExceeded

# Shared prelude: the server clock and a bucket level refilled up to now.
_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(cap, f_level, f_at)
  if cap < 0 then return nil end
  local v = redis.call('HMGET', KEYS[1], f_level, f_at)
  if not v[1] then return cap end
  return math.min(cap, tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60)
end
local function num(x)
  if x == nil then return '' end
  return string.format('%.17g', x)
end
"""

# KEYS: q, leases, held, billed, expired, settled
# ARGV: rpm, tpm, max_concurrent, daily_tokens (-1 = unlimited), lease id, ttl ms,
#       estimate (tokens), headroom
# Takes a concurrency lease and one request, or nothing. With the lease it also takes
# `estimate` tokens from tokens/min and the daily budget (prepaid) when both still hold
# `headroom` times the estimate; otherwise it takes no tokens (prepaid 0) and the caller
# reserves the exact count with TOKENS. It never refuses for tokens: only TOKENS does, on
# the exact count, so a loose estimate cannot refuse a request that fits.
# Returns {1|0, reason, retry_after ('' = never), info, requests level, tokens level, prepaid}.
BEGIN = _PRELUDE + """
local rpm, tpm, max_concurrent = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local daily, id, ttl_ms = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local estimate, headroom = tonumber(ARGV[7]), tonumber(ARGV[8])
local EPS = 1e-9
local now_ms = math.floor(now * 1000)

-- Leases whose heartbeat stopped (their replica died) give back their slot and daily hold.
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms)
if #dead > 0 then
  local reserved = tonumber(redis.call('HGET', KEYS[1], 'reserved') or '0')
  for _, d in ipairs(dead) do
    reserved = reserved - tonumber(redis.call('HGET', KEYS[3], d) or '0')
    redis.call('HDEL', KEYS[3], d)
    redis.call('ZADD', KEYS[5], now, d)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now - 86400)
  redis.call('HSET', KEYS[1], 'reserved', reserved)
end

local req = level(rpm, 'rt', 'rts')
local tok = level(tpm, 'tt', 'tts')
local prior = redis.call('HGET', KEYS[3], id)
if prior then       -- this lease id was taken already: the same answer, nothing taken again
  return {1, '', '', '', num(req), num(tok), tonumber(prior)}
end
if redis.call('ZSCORE', KEYS[6], id) then   -- settled before it began: take nothing
  return {0, 'lease_expired', num(1.0), num(0), num(req), num(tok), 0}
end
local running = redis.call('ZCARD', KEYS[2])
if max_concurrent >= 0 and running >= max_concurrent then
  return {0, 'max_concurrent', num(1.0), num(running), num(req), num(tok), 0}
end
if req and req + EPS < 1 then
  return {0, 'requests_per_minute', num((1 - req) * 60 / rpm), num(0), num(req), num(tok), 0}
end
if req then
  req = req - 1
  redis.call('HSET', KEYS[1], 'rt', num(req), 'rts', num(now))
end
local prepaid = 0
if estimate > 0 and (not tok or tok + EPS >= headroom * estimate) then
  local reserved = tonumber(redis.call('HGET', KEYS[1], 'reserved') or '0')
  local fits = true
  if daily >= 0 then
    local billed = tonumber(redis.call('HGET', KEYS[4], math.floor(now / 86400)) or '0')
    fits = daily - billed - reserved >= headroom * estimate
  end
  if fits then
    prepaid = estimate
    if tok then
      tok = tok - estimate
      redis.call('HSET', KEYS[1], 'tt', num(tok), 'tts', num(now))
    end
    redis.call('HSET', KEYS[1], 'reserved', reserved + estimate)
  end
end
redis.call('ZADD', KEYS[2], now_ms + ttl_ms, id)
redis.call('HSET', KEYS[3], id, prepaid)
return {1, '', '', '', num(req), num(tok), prepaid}
"""

# KEYS: q, leases, held, billed
# ARGV: rpm, tpm, daily_tokens (-1 = unlimited), tokens, lease id, total
# Adds `tokens` to a live lease from tokens/min and the daily budget, or nothing; `total`
# is what the lease will hold in all (more than `tokens` after a prepaid estimate that fell
# short): a total above a limit can never fit.
# Returns BEGIN's shape; reason 'lease_expired' if the lease's heartbeat stopped meanwhile.
TOKENS = _PRELUDE + """
local rpm, tpm, daily = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, id, total = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local EPS = 1e-9
local req = level(rpm, 'rt', 'rts')
local tok = level(tpm, 'tt', 'tts')
local function refuse(reason, retry, info)
  return {0, reason, num(retry), num(info), num(req), num(tok), 0}
end
local held = redis.call('HGET', KEYS[3], id)
if not held then return refuse('lease_expired', 1.0, 0) end
if tok and total > tpm then return refuse('tokens_per_minute', nil, tpm) end
if tok and tok + EPS < tokens then
  return refuse('tokens_per_minute', (tokens - tok) * 60 / tpm, math.floor(tok + EPS))
end
local reserved = tonumber(redis.call('HGET', KEYS[1], 'reserved') or '0')
if daily >= 0 then
  local day = math.floor(now / 86400)
  local billed = tonumber(redis.call('HGET', KEYS[4], day) or '0')
  if billed + reserved + tokens > daily then
    local retry = nil
    if total <= daily then retry = (day + 1) * 86400 - now end
    return refuse('daily_tokens', retry, math.max(0, daily - billed - reserved))
  end
end
if tok then
  tok = tok - tokens
  redis.call('HSET', KEYS[1], 'tt', num(tok), 'tts', num(now))
end
redis.call('HSET', KEYS[1], 'reserved', reserved + tokens)
redis.call('HSET', KEYS[3], id, tonumber(held) + tokens)
return {1, '', '', '', num(req), num(tok), 0}
"""

# KEYS: q, held.  ARGV: lease id, tokens to keep, tpm (-1 = unlimited)
# Gives back what a prepaid lease holds beyond `keep` (its exact count, known once the
# prompt is tokenized) to tokens/min and the daily budget. A no-op for a lease that holds
# no more than that, or none (settled or expired meanwhile): a lost or late trim only
# leaves the excess held until the settlement gives it back.
TRIM = _PRELUDE + """
local id, keep, tpm = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local held = tonumber(redis.call('HGET', KEYS[2], id) or '-1')
if held <= keep then return 0 end
redis.call('HSET', KEYS[2], id, keep)
redis.call('HINCRBY', KEYS[1], 'reserved', keep - held)
local tok = level(tpm, 'tt', 'tts')
if tok then
  redis.call('HSET', KEYS[1], 'tt', num(math.min(tpm, tok + held - keep)), 'tts', num(now))
end
return 1
"""

# KEYS: q, leases, held, billed, expired, settled
# ARGV: lease id, used tokens, tpm (-1 = unlimited)
# Returns 1 when this call settled the lease, 0 when it was settled before.
SETTLE = _PRELUDE + """
local id, used, tpm = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local held = redis.call('HGET', KEYS[3], id)
if not held then
  -- An expired lease already gave back its slot and hold: only bill it. Neither: settled,
  -- or its BEGIN has not arrived yet: remember the id so that BEGIN takes nothing.
  if redis.call('ZREM', KEYS[5], id) == 0 then
    redis.call('ZADD', KEYS[6], now, id)
    redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now - 3600)
    return 0
  end
else
  held = tonumber(held)
  redis.call('HDEL', KEYS[3], id)
  redis.call('ZREM', KEYS[2], id)
  if held > 0 then redis.call('HINCRBY', KEYS[1], 'reserved', -held) end  -- (-0 is no integer)
  local tok = level(tpm, 'tt', 'tts')
  if tok then
    -- Refund at most what was taken; an overrun is charged, down to empty.
    tok = math.max(0, math.min(tpm, tok + held - used))
    redis.call('HSET', KEYS[1], 'tt', num(tok), 'tts', num(now))
  end
end
if used > 0 then
  local day = math.floor(now / 86400)
  redis.call('HINCRBY', KEYS[4], day, used)
  redis.call('HDEL', KEYS[4], day - 3)
end
return 1
"""

# KEYS: leases.  ARGV: ttl ms, lease ids...
# Pushes the expiry of the tenant's live leases; returns how many were still live.
RENEW = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local live = 0
for i = 2, #ARGV do
  live = live + redis.call('ZADD', KEYS[1], 'XX', 'CH', expiry, ARGV[i])
end
return live
"""


def limit_arg(value: int | None) -> int:
    """A limit as the scripts take it: -1 for unlimited."""
    return -1 if value is None else value


def reply_float(raw: bytes) -> float | None:
    """A number from a script's reply; '' (nil) is None."""
    return float(raw) if raw else None


def headers_from_levels(tenant: Tenant, req: float | None, tok: float | None) -> dict[str, str]:
    """The embedded backend's x-ratelimit-* headers from the levels the script returned."""
    out: dict[str, str] = {}
    lim = tenant.limits
    for kind, cap, level in (("requests", lim.requests_per_minute, req),
                             ("tokens", lim.tokens_per_minute, tok)):
        if cap is not None and level is not None:
            out[f"x-ratelimit-limit-{kind}"] = str(cap)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level + EPS)))
            out[f"x-ratelimit-reset-{kind}"] = format_duration((cap - level) * 60 / cap)
    return out


def refusal(tenant: Tenant, reason: str, retry: float | None, info: float | None,
               tokens: int, headers: dict[str, str]) -> QuotaExceeded:
    """The embedded backend's QuotaExceeded for a refusal the script returned."""
    lim = tenant.limits
    if reason == "max_concurrent":
        msg = f"{info:.0f} requests already in flight (limit {lim.max_concurrent})"
        retry = CONCURRENCY_RETRY_S
    elif reason == "requests_per_minute":
        msg = f"the limit of {lim.requests_per_minute} requests per minute is used up"
    elif reason == "tokens_per_minute":
        left = (f"the limit is {lim.tokens_per_minute} per minute" if retry is None
                else f"{info:.0f} are left")
        msg = f"this request reserves {tokens} tokens but {left}"
    else:
        detail = (f"{info:.0f} of the daily budget of {lim.daily_tokens} are left "
                  "(resets at 00:00 UTC)" if retry is not None
                  else f"the whole daily budget is {lim.daily_tokens}")
        msg = f"this request reserves {tokens} tokens but {detail}"
    when = "it can never fit" if retry is None else f"retry in {retry:.1f} s"
    return QuotaExceeded(reason, f"{reason}: {msg}; {when}", retry, headers)
