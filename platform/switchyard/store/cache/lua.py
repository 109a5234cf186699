"""The Lua scripts of the Redis response cache: one per operation, each atomic on the server.

Keys under the cache's prefix ``P`` (``R`` a rule's label, ``K`` an entry's key, ``C`` a context):

- ``P cache:R:K``: an entry (:meth:`CacheEntry.encode`), a string with the rule's TTL (``PX``).
- ``P cache-lru:R``: a sorted set of the rule's keys by last use (a logical clock), to evict the
  least recently used beyond ``max_entries``.
- ``P cache-exp:R``: a sorted set of the rule's keys by expiry (server time, ms), to sweep the
  bookkeeping of entries Redis expired.
- ``P cache-meta:R``: a hash ``K`` → ``[size, model, tenant?]`` (JSON).
- ``P cache-tenant:<tenant>`` / ``P cache-model:<model>``: sets of members ``<len(R)>:R K`` for purge.
- ``P cache-rules``: the set of rule labels; ``P cache-stats``: a hash of ``entries``, ``bytes``,
  ``evicted_ttl``, ``evicted_size`` and ``tick`` (the logical clock).
- ``P cache-vec:R:C``: a hash ``K`` → unit vector (float32); ``P cache-vecord:R:C``: its keys by
  insertion, to keep the hash within its bound. Both carry the TTL of their newest vector.

Keys are derived on the server from the prefix, so the cache needs one Redis server, not a
cluster. Every put evicts within the same script, so replicas racing never leave a rule above
its bound.
"""

from __future__ import annotations

_COMMON = """
local P = ARGV[1]
local STATS = P .. 'cache-stats'

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function tick()
  return redis.call('HINCRBY', STATS, 'tick', 1)
end

local function member(rule, key)
  return string.len(rule) .. ':' .. rule .. key
end

local function unpack_member(m)
  local n, rest = string.match(m, '^(%d+):(.*)$')
  n = tonumber(n)
  return string.sub(rest, 1, n), string.sub(rest, n + 1)
end

-- Remove an entry and its bookkeeping. reason: 'ttl' or 'size' (counted), 'purge' (counted as
-- 'ttl' when the entry had already expired), or false. Returns 1 when the entry was live.
local function drop(rule, key, reason)
  local meta = P .. 'cache-meta:' .. rule
  local live = redis.call('DEL', P .. 'cache:' .. rule .. ':' .. key)
  redis.call('ZREM', P .. 'cache-lru:' .. rule, key)
  redis.call('ZREM', P .. 'cache-exp:' .. rule, key)
  local raw = redis.call('HGET', meta, key)
  if not raw then return live end
  redis.call('HDEL', meta, key)
  local m = cjson.decode(raw)
  local mem = member(rule, key)
  redis.call('SREM', P .. 'cache-model:' .. m[2], mem)
  if m[3] then redis.call('SREM', P .. 'cache-tenant:' .. m[3], mem) end
  redis.call('HINCRBY', STATS, 'entries', -1)
  redis.call('HINCRBY', STATS, 'bytes', -m[1])
  if reason == 'purge' then reason = (live == 0) and 'ttl' or false end
  if reason then redis.call('HINCRBY', STATS, 'evicted_' .. reason, 1) end
  return live
end

local function sweep(rule, now, most)
  local keys = redis.call('ZRANGEBYSCORE', P .. 'cache-exp:' .. rule, '-inf', now, 'LIMIT', 0, most)
  for _, key in ipairs(keys) do drop(rule, key, 'ttl') end
  return #keys
end
"""

#: ARGV: prefix, rule, key, encoded entry, ttl (ms), max entries, meta JSON ``[size, model,
#: tenant?]``, sweep batch. Stores the entry, sweeps expired ones, evicts beyond the bound. Returns 1.
PUT = _COMMON + """
local rule, key, ttl, most = ARGV[2], ARGV[3], tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()
drop(rule, key, false)
local m = cjson.decode(ARGV[7])
local lru = P .. 'cache-lru:' .. rule
redis.call('SET', P .. 'cache:' .. rule .. ':' .. key, ARGV[4], 'PX', ttl)
redis.call('ZADD', lru, tick(), key)
redis.call('ZADD', P .. 'cache-exp:' .. rule, now + ttl, key)
redis.call('HSET', P .. 'cache-meta:' .. rule, key, ARGV[7])
redis.call('SADD', P .. 'cache-model:' .. m[2], member(rule, key))
if m[3] then redis.call('SADD', P .. 'cache-tenant:' .. m[3], member(rule, key)) end
redis.call('SADD', P .. 'cache-rules', rule)
redis.call('HINCRBY', STATS, 'entries', 1)
redis.call('HINCRBY', STATS, 'bytes', m[1])
sweep(rule, now, tonumber(ARGV[8]))
while redis.call('ZCARD', lru) > most do
  drop(rule, redis.call('ZRANGE', lru, 0, 0)[1], 'size')
end
return 1
"""

#: ARGV: prefix, rule, key. Returns the entry (nil when absent) and marks it used.
GET = _COMMON + """
local rule, key = ARGV[2], ARGV[3]
local value = redis.call('GET', P .. 'cache:' .. rule .. ':' .. key)
if value then redis.call('ZADD', P .. 'cache-lru:' .. rule, 'XX', tick(), key) end
return value
"""

#: ARGV: prefix, rule, most. Sweeps up to ``most`` expired entries of the rule; returns how many.
SWEEP = _COMMON + """
return sweep(ARGV[2], now_ms(), tonumber(ARGV[3]))
"""

#: ARGV: prefix, mode, most, then per mode: ``rule`` R (the rule's entries), ``set`` S (the
#: members of index set S), ``both`` S1 S2 (members of both). Removes up to ``most`` entries;
#: returns {live entries removed, entries looked at}.
PURGE = _COMMON + """
local mode, most = ARGV[2], tonumber(ARGV[3])
local removed, todo = 0, {}
if mode == 'rule' then
  for _, key in ipairs(redis.call('ZRANGE', P .. 'cache-lru:' .. ARGV[4], 0, most - 1)) do
    todo[#todo + 1] = {ARGV[4], key}
  end
else
  local members
  if mode == 'set' then
    members = redis.call('SRANDMEMBER', ARGV[4], most)
  else
    members = redis.call('SINTER', ARGV[4], ARGV[5])
  end
  for i = 1, math.min(#members, most) do
    local rule, key = unpack_member(members[i])
    redis.call('SREM', ARGV[4], members[i])
    if ARGV[5] then redis.call('SREM', ARGV[5], members[i]) end
    todo[#todo + 1] = {rule, key}
  end
end
for _, item in ipairs(todo) do
  removed = removed + drop(item[1], item[2], 'purge')
end
return {removed, #todo}
"""

#: ARGV: prefix, rule, context, key, unit vector (float32), ttl (ms), bound. Returns 1.
PUT_VECTOR = _COMMON + """
local rule, context, key, ttl, bound = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[6]), tonumber(ARGV[7])
local vectors = P .. 'cache-vec:' .. rule .. ':' .. context
local order = P .. 'cache-vecord:' .. rule .. ':' .. context
redis.call('HSET', vectors, key, ARGV[5])
redis.call('ZADD', order, tick(), key)
while redis.call('ZCARD', order) > bound do
  local oldest = redis.call('ZRANGE', order, 0, 0)[1]
  redis.call('ZREM', order, oldest)
  redis.call('HDEL', vectors, oldest)
end
for _, name in ipairs({vectors, order}) do
  if redis.call('PTTL', name) < ttl then redis.call('PEXPIRE', name, ttl) end
end
return 1
"""

#: ARGV: prefix, rule, context, then keys. Forgets those keys' vectors in the context. Returns 1.
DROP_VECTORS = _COMMON + """
local vectors = P .. 'cache-vec:' .. ARGV[2] .. ':' .. ARGV[3]
local order = P .. 'cache-vecord:' .. ARGV[2] .. ':' .. ARGV[3]
for i = 4, #ARGV do
  redis.call('HDEL', vectors, ARGV[i])
  redis.call('ZREM', order, ARGV[i])
end
return 1
"""

#: ARGV: prefix, rule, context. Returns the context's vectors as a flat list: key, vector, ...
VECTORS = _COMMON + """
return redis.call('HGETALL', P .. 'cache-vec:' .. ARGV[2] .. ':' .. ARGV[3])
"""

#: ARGV: prefix. Returns the rule labels and {entries, bytes, evicted_ttl, evicted_size}.
STATS_READ = _COMMON + """
local values = redis.call('HMGET', STATS, 'entries', 'bytes', 'evicted_ttl', 'evicted_size')
for i = 1, 4 do values[i] = values[i] or '0' end
return {redis.call('SMEMBERS', P .. 'cache-rules'), values}
"""
