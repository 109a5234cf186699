"""The Lua scripts of the Redis limit store: one per operation, each atomic on the server.

Keys under the store's prefix ``P``:

- ``P b:<bucket key>``: a hash ``{level, since}``. Absent means full. Its TTL is the time it
  takes to fill up plus the time to fill from empty, so an idle bucket vanishes only once it is
  full (a debt is never forgiven); a bucket that never refills has none.
- ``P r:<id>``: a reservation, a hash ``{expires, "b:<bucket key>": "amount capacity refill"}``
  with a TTL of the reservation's lifetime.
- ``P expiries``: a sorted set of outstanding reservation ids by expiry, for the sweep.

The reconcile and sweep scripts derive keys from the prefix (a reservation's buckets are known
only on the server), so the store needs one Redis server, not a cluster.

Numbers travel as text that round-trips (Python's ``repr`` in, ``%.17g`` out) and the
arithmetic repeats :mod:`switchyard.store.limits.arithmetic` operation for operation, so both
stores reach the same levels to the last bit.
"""

from __future__ import annotations

_COMMON = """
local function clock(given)
  if given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function num(x)
  return string.format('%.17g', x)
end

-- arithmetic.refilled, with an absent bucket read as full
local function refilled(key, capacity, rate, now)
  local held = redis.call('HMGET', key, 'level', 'since')
  if not held[1] then return capacity, now end
  local level, since = tonumber(held[1]), tonumber(held[2])
  if now > since then
    return math.min(capacity, level + (now - since) * rate), now
  end
  return math.min(capacity, level), since
end

local function store(key, level, since, capacity, rate)
  redis.call('HSET', key, 'level', num(level), 'since', num(since))
  if rate > 0 then
    local ms = math.ceil(((capacity - level) / rate + capacity / rate) * 1000)
    redis.call('PEXPIRE', key, string.format('%d', math.min(ms, 1e12)))
  else
    redis.call('PERSIST', key)
  end
end

local function forget_expired(index, prefix, now, most)
  local ids = redis.call('ZRANGEBYSCORE', index, '-inf', num(now), 'LIMIT', 0, most)
  for _, id in ipairs(ids) do
    redis.call('DEL', prefix .. 'r:' .. id)
  end
  if #ids > 0 then redis.call('ZREM', index, unpack(ids)) end
  return #ids
end
"""

#: KEYS: expiry index, the new reservation, then one bucket per charge.
#: ARGV: now ('' reads the server clock), ttl_s, reservation id, sweep batch, key prefix, then
#: per charge: bucket key, amount, capacity, refill_per_s.
#: Returns 1 or 0 (admitted), then each bucket's level before taking.
RESERVE = _COMMON + """
local now = clock(ARGV[1])
forget_expired(KEYS[1], ARGV[5], now, tonumber(ARGV[4]))
local n = #KEYS - 2
local levels, sinces, admitted = {}, {}, true
for i = 1, n do
  local a = 5 + (i - 1) * 4
  local amount, capacity, rate = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  levels[i], sinces[i] = refilled(KEYS[i + 2], capacity, rate, now)
  -- arithmetic.fits
  if not (amount <= capacity and levels[i] >= amount) then admitted = false end
end
local reply = {admitted and 1 or 0}
for i = 1, n do reply[i + 1] = num(levels[i]) end
if not admitted then return reply end
local expires = now + tonumber(ARGV[2])
local fields = {'expires', num(expires)}
for i = 1, n do
  local a = 5 + (i - 1) * 4
  local amount, capacity, rate = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  store(KEYS[i + 2], levels[i] - amount, sinces[i], capacity, rate)
  fields[#fields + 1] = 'b:' .. ARGV[a + 1]
  fields[#fields + 1] = ARGV[a + 2] .. ' ' .. ARGV[a + 3] .. ' ' .. ARGV[a + 4]
end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('PEXPIRE', KEYS[2], string.format('%d', math.min(math.ceil(tonumber(ARGV[2]) * 1000), 1e12)))
redis.call('ZADD', KEYS[1], num(expires), ARGV[3])
return reply
"""

#: KEYS: expiry index, the reservation. ARGV: now, key prefix, reservation id, then pairs of
#: bucket key and amount used. Returns 1 when settled, 0 when the reservation is unknown or expired.
RECONCILE = _COMMON + """
local now = clock(ARGV[1])
local held = redis.call('HGETALL', KEYS[2])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[3])
local fields = {}
for i = 1, #held, 2 do fields[held[i]] = held[i + 1] end
if not fields['expires'] or tonumber(fields['expires']) <= now then return 0 end
local used = {}
for i = 4, #ARGV, 2 do used[ARGV[i]] = tonumber(ARGV[i + 1]) end
for name, value in pairs(fields) do
  if string.sub(name, 1, 2) == 'b:' then
    local key = string.sub(name, 3)
    local a, c, r = string.match(value, '^(%S+) (%S+) (%S+)$')
    local amount, capacity, rate = tonumber(a), tonumber(c), tonumber(r)
    local spent = used[key] or amount
    local bucket = ARGV[2] .. 'b:' .. key
    local level, since = refilled(bucket, capacity, rate, now)
    -- arithmetic.settled
    level = math.min(capacity, level + (amount - spent))
    store(bucket, level, since, capacity, rate)
  end
end
return 1
"""

#: KEYS: expiry index. ARGV: now, key prefix, most to forget. Returns how many were forgotten.
SWEEP = _COMMON + """
return forget_expired(KEYS[1], ARGV[2], clock(ARGV[1]), tonumber(ARGV[3]))
"""

#: KEYS: buckets. ARGV: now, then per bucket: capacity, refill_per_s. Returns each level.
PEEK = _COMMON + """
local now = clock(ARGV[1])
local reply = {}
for i = 1, #KEYS do
  local level = refilled(KEYS[i], tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1]), now)
  reply[i] = num(level)
end
return reply
"""
