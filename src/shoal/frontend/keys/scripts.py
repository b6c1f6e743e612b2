"""The Lua scripts Redis runs for the limits (`shoal.frontend.keys.limits`): `LEASE`, a key's
sliding windows read and counted at once on Redis' own clock, and `BEAT_SCRIPT`, a frontend's
report that counts the frontends alive."""

from __future__ import annotations

# KEYS[1]: the key's prefix. ARGV: window, rpm, tpm (0: none), requests wanted (0: only
# settle), tokens reserved per request, tokens owed (to this minute), then an allowance given
# back: requests, tokens, its window; then reservations given back: pairs of (window, tokens).
# Answers {admitted, requests granted, requests left, tokens left, wait (s), reset (s), window,
# refused by (1 requests, 2 tokens), the other limit's reset when refused (s)}.
LEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local W = tonumber(ARGV[1])
local cur = math.floor(now / W)
local keep = 1 - (now - cur * W) / W
local turn = math.ceil(keep * W)
local p = KEYS[1]
local rpm, tpm, want, per = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local function add(k, n)
  if n > 0 then
    redis.call('INCRBY', k, n)
    redis.call('EXPIRE', k, 2 * W)
  elseif n < 0 then
    if redis.call('DECRBY', k, -n) < 0 then redis.call('SET', k, 0) end
    redis.call('EXPIRE', k, 2 * W)
  end
end
add(p .. ':t:' .. cur, tonumber(ARGV[6]))
local back = tonumber(ARGV[7])
if back > 0 then
  add(p .. ':r:' .. ARGV[9], -back)
  add(p .. ':t:' .. ARGV[9], -tonumber(ARGV[8]))
end
for i = 10, #ARGV - 1, 2 do
  local w = tonumber(ARGV[i])
  if w >= cur - 1 and w <= cur then add(p .. ':t:' .. w, -tonumber(ARGV[i + 1])) end
end
if want == 0 then return {1, 0, 0, 0, 0, turn, cur, 0, 0} end
local rc = tonumber(redis.call('GET', p .. ':r:' .. cur) or '0')
local rp = tonumber(redis.call('GET', p .. ':r:' .. (cur - 1)) or '0')
local tc = tonumber(redis.call('GET', p .. ':t:' .. cur) or '0')
local tp = tonumber(redis.call('GET', p .. ':t:' .. (cur - 1)) or '0')
local r, tk = rp * keep + rc, tp * keep + tc
local function wait(prev, c, bound)
  local at = keep * W
  if prev > 0 and c < bound then at = (prev * keep + c - bound) / prev * W
  elseif c > 0 then at = keep * W + W * (1 - bound / c) end
  return math.floor(at) + 1
end
if rpm > 0 and r + 1 > rpm then
  local reset_t = turn
  if tpm > 0 and tk >= tpm then reset_t = wait(tp, tc, tpm) end
  return {0, 0, 0, math.max(tpm - tk, 0), wait(rp, rc, rpm - 1), turn, cur, 1, reset_t}
end
if tpm > 0 and tk >= tpm then
  return {0, 0, math.max(rpm - r, 0), 0, wait(tp, tc, tpm), turn, cur, 2, turn}
end
local n = want
if rpm > 0 then n = math.min(n, math.floor(rpm - r)) end
if tpm > 0 and per > 0 then n = math.min(n, math.ceil((tpm - tk) / per)) end
n = math.max(n, 1)
add(p .. ':r:' .. cur, n)
add(p .. ':t:' .. cur, n * per)
return {1, n, math.max(rpm - r - n, 0), math.max(tpm - tk - n * per, 0), 0, turn, cur, 0, 0}
"""

# KEYS[1]: the sorted set of frontends. ARGV: this frontend's id, FRONTENDS_TTL. Answers N.
BEAT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('EXPIRE', KEYS[1], math.ceil(3 * ttl))
return redis.call('ZCARD', KEYS[1])
"""
