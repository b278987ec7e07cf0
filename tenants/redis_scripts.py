"""The Redis quota backend's Lua scripts: each runs atomically on the server, so each
admission step (BEGIN: lease + request; TOKENS: tokens/min + daily budget) and each
settlement is one round trip, with no check-then-act race between replicas. Time is the server's `TIME`, never a replica's clock.

Keys of one tenant share the hash tag `{sg:<tenant>}` (one Redis Cluster slot):
    q        hash  rt/rts, tt/tts: requests/tokens bucket level and when it was computed;
                   reserved: daily-budget tokens held by leases in flight
    leases   zset  lease id -> expiry (ms); a heartbeat pushes expiry forward
    held     hash  lease id -> tokens it reserved
    billed   hash  UTC day number -> tokens billed that day
    expired  zset  lease id -> when its heartbeat was found stopped (kept a day), so that
                   its late settlement (replayed from an outbox) is still billed, once
A settlement bills its lease if the lease is in `held` or `expired`, and removes it from
there in the same script: sent twice, the second finds it in neither and does nothing.
Memory is in proportion to the leases in flight and recently expired, not to traffic.

The buckets are token buckets holding up to the per-minute limit, refilled continuously
(the embedded backend's rule), so one tenant sees the same limits from 1 or N replicas.
"""

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

# KEYS: q, leases, held, billed, expired
# ARGV: rpm, tpm (-1 = unlimited), max_concurrent (-1 = unlimited), lease id, ttl ms
# Takes a concurrency lease and one request, or nothing.
# Returns {1|0, reason, retry_after ('' = never), info, requests level, tokens level}.
BEGIN = _PRELUDE + """
local rpm, tpm, max_concurrent = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local id, ttl_ms = ARGV[4], tonumber(ARGV[5])
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
local running = redis.call('ZCARD', KEYS[2])
if max_concurrent >= 0 and running >= max_concurrent then
  return {0, 'max_concurrent', num(1.0), num(running), num(req), num(tok)}
end
if req and req + EPS < 1 then
  return {0, 'requests_per_minute', num((1 - req) * 60 / rpm), num(0), num(req), num(tok)}
end
if req then
  req = req - 1
  redis.call('HSET', KEYS[1], 'rt', num(req), 'rts', num(now))
end
redis.call('ZADD', KEYS[2], now_ms + ttl_ms, id)
redis.call('HSET', KEYS[3], id, 0)
return {1, '', '', '', num(req), num(tok)}
"""

# KEYS: q, leases, held, billed
# ARGV: rpm, tpm, daily_tokens (-1 = unlimited), tokens, lease id
# Adds `tokens` to a live lease from tokens/min and the daily budget, or nothing.
# Returns BEGIN's shape; reason 'lease_expired' if the lease's heartbeat stopped meanwhile.
TOKENS = _PRELUDE + """
local rpm, tpm, daily = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, id = tonumber(ARGV[4]), ARGV[5]
local EPS = 1e-9
local req = level(rpm, 'rt', 'rts')
local tok = level(tpm, 'tt', 'tts')
local function refuse(reason, retry, info)
  return {0, reason, num(retry), num(info), num(req), num(tok)}
end
local held = redis.call('HGET', KEYS[3], id)
if not held then return refuse('lease_expired', 1.0, 0) end
if tok and tok + EPS < tokens then
  if tokens > tpm then return refuse('tokens_per_minute', nil, tpm) end
  return refuse('tokens_per_minute', (tokens - tok) * 60 / tpm, math.floor(tok + EPS))
end
local reserved = tonumber(redis.call('HGET', KEYS[1], 'reserved') or '0')
if daily >= 0 then
  local day = math.floor(now / 86400)
  local billed = tonumber(redis.call('HGET', KEYS[4], day) or '0')
  if billed + reserved + tokens > daily then
    local retry = nil
    if tokens <= daily then retry = (day + 1) * 86400 - now end
    return refuse('daily_tokens', retry, math.max(0, daily - billed - reserved))
  end
end
if tok then
  tok = tok - tokens
  redis.call('HSET', KEYS[1], 'tt', num(tok), 'tts', num(now))
end
redis.call('HSET', KEYS[1], 'reserved', reserved + tokens)
redis.call('HSET', KEYS[3], id, tonumber(held) + tokens)
return {1, '', '', '', num(req), num(tok)}
"""

# KEYS: q, leases, held, billed, expired
# ARGV: lease id, used tokens, tpm (-1 = unlimited)
# Returns 1 when this call settled the lease, 0 when it was settled before.
SETTLE = _PRELUDE + """
local id, used, tpm = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local held = redis.call('HGET', KEYS[3], id)
if not held then
  -- An expired lease already gave back its slot and hold: only bill it. Neither: settled.
  if redis.call('ZREM', KEYS[5], id) == 0 then return 0 end
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
