-- acquire.lua: check, and charge, several counters at once, all or nothing.
--
-- KEYS      the keys the counters live in: one packed string per identity and
--           policy (fixed, sliding and gcra counters are records in it), and
--           one sorted set per log counter
-- ARGV[1]   mode: 0 = check only, 1 = check and charge if all pass,
--           2 = charge without checking (charge = "after", once the status is known)
-- ARGV[2]   now in unix ms, or "" to read Redis TIME (clock = "redis")
-- ARGV[3]   cost in units
-- ARGV[4]   nonce: log entries of this call are "<nonce>:<unit>", so a refund
--           removes exactly them
-- ARGV[5]   number of counters; then six per counter: key index (into KEYS),
--           algorithm (1 buckets, 2 log, 3 gcra), limit, window ms,
--           precision ms (buckets) or burst (gcra), record id
--
-- Returns {allowed, now, then per counter: remaining, reset ms, retry ms, mark}.
--
-- A packed string is a msgpack map, record id -> state:
--   fixed (one bucket of the whole window): {bucket index, units}
--   sliding (window/precision buckets): {newest index, units in the window,
--     newest index holding units or -1, ring}: the ring is a binary string of
--     window/precision big-endian counts, 2 bytes wide when the limit fits
--     (else 4, or 8 as a double), so a decision reads and writes only the
--     buckets it needs
--   gcra: {theoretical arrival time in us}
-- Bucket index = floor(now / precision). A sliding window keeps a running
-- total, so a decision touches only the buckets that just expired. The same
-- definitions are in src/store/memory.rs; keep them in step.

local mode = tonumber(ARGV[1])
local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(ARGV[2])
end
local cost = tonumber(ARGV[3])
local nonce = ARGV[4]
local count = tonumber(ARGV[5])

local groups = {}
local function group(ki)
  local g = groups[ki]
  if g == nil then
    local raw = redis.call('GET', KEYS[ki])
    if raw then g = cmsgpack.unpack(raw) else g = {} end
    groups[ki] = g
  end
  return g
end

-- Ring slot j (1-based) of a ring whose counts are `w` bytes wide.
local formats = {[2] = '>I2', [4] = '>I4', [8] = '>d'}
local maxima = {[2] = 65535, [4] = 4294967295, [8] = 2 ^ 53}
-- Room for four times the limit: charge = "after" may overshoot it.
local function width(limit)
  if limit <= 16383 then return 2 elseif limit <= 1073741823 then return 4 else return 8 end
end
local function slot(ring, w, j)
  return (struct.unpack(formats[w], ring, (j - 1) * w + 1))
end
local function set_slot(ring, w, j, v)
  local at = (j - 1) * w
  return ring:sub(1, at) .. struct.pack(formats[w], v) .. ring:sub(at + w + 1)
end

local out = {0, now}
local plans = {}
local allowed = true

for i = 1, count do
  local at = 5 + (i - 1) * 6
  local ki = tonumber(ARGV[at + 1])
  local alg = tonumber(ARGV[at + 2])
  local limit = tonumber(ARGV[at + 3])
  local window = tonumber(ARGV[at + 4])
  local param = tonumber(ARGV[at + 5])
  local id = ARGV[at + 6]
  local p = {alg = alg, ki = ki, id = id, window = window, mark = 0}
  local remaining, reset, retry

  if alg == 1 and window == param then
    local b = math.floor(now / param)
    local st = group(ki)[id]
    local used = 0
    if st and st[1] == b then used = st[2] end
    reset = (b + 1) * param
    if used + cost <= limit then
      remaining, retry = limit - used - cost, 0
    else
      remaining = math.max(limit - used, 0)
      if cost > limit then retry = window else retry = reset - now end
    end
    p.state, p.ttl, p.mark = {b, used + cost}, reset - now, b
  elseif alg == 1 then
    local n = window / param
    local b = math.floor(now / param)
    local w = width(limit)
    local st = group(ki)[id]
    local pos, total, nz, ring
    if st and #st[4] == n * w then
      pos, total, nz, ring = st[1], st[2], st[3], st[4]
    else
      pos, total, nz, ring = b, 0, -1, string.rep('\0', n * w)
    end
    -- Time only moves forward here: a clock behind the newest bucket counts
    -- into the newest bucket.
    if b < pos then b = pos end
    if b > pos then
      if b - pos >= n then
        ring, total = string.rep('\0', n * w), 0
      else
        for idx = pos + 1, b do
          local j = idx % n + 1
          local units = slot(ring, w, j)
          if units > 0 then
            total = total - units
            ring = set_slot(ring, w, j, 0)
          end
        end
      end
      pos = b
    end
    if nz ~= -1 and nz <= b - n then nz = -1 end
    local used = total
    if used + cost <= limit then
      remaining, retry, reset = limit - used - cost, 0, (b + n) * param
    else
      remaining, retry = math.max(limit - used, 0), window
      if nz ~= -1 then reset = (nz + n) * param else reset = (b + n) * param end
      local need, freed = used + cost - limit, 0
      for idx = b - n + 1, b do
        freed = freed + slot(ring, w, idx % n + 1)
        if freed >= need then
          retry = (idx + n) * param - now
          break
        end
      end
    end
    -- A slot saturates rather than wraps (only an absurd overshoot gets there);
    -- the total stays the sum of the slots.
    local j = b % n + 1
    local had = slot(ring, w, j)
    local now_units = math.min(had + cost, maxima[w])
    ring = set_slot(ring, w, j, now_units)
    p.state, p.ttl, p.mark = {pos, total + now_units - had, b, ring}, (b + n) * param - now, b
  elseif alg == 2 then
    local key = KEYS[ki]
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
    local used = redis.call('ZCARD', key)
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    if #first > 0 then reset = tonumber(first[2]) + window else reset = now + window end
    if used + cost <= limit then
      remaining, retry = limit - used - cost, 0
    else
      remaining, retry = math.max(limit - used, 0), window
      local need = used + cost - limit
      if need <= used then
        local e = redis.call('ZRANGE', key, need - 1, need - 1, 'WITHSCORES')
        retry = tonumber(e[2]) + window - now
      end
    end
    p.mark = tonumber(nonce)
  else
    local t = math.max(1, math.floor(window * 1000 / limit))
    local cap = t * param
    local now_us = now * 1000
    local st = group(ki)[id]
    local tat = now_us
    if st and st[1] > now_us then tat = st[1] end
    local new_tat = tat + cost * t
    if new_tat - now_us <= cap then
      remaining, reset, retry = math.floor((cap - (new_tat - now_us)) / t), math.ceil(new_tat / 1000), 0
    else
      local wait = new_tat - cap - now_us
      if cost * t > cap then wait = window * 1000 end
      remaining = math.floor(math.max(cap - (tat - now_us), 0) / t)
      reset, retry = math.ceil(tat / 1000), math.ceil(wait / 1000)
    end
    p.state, p.ttl = {new_tat}, math.ceil(new_tat / 1000) - now
  end

  if retry > 0 then
    allowed = false
    if retry < 1 then retry = 1 end
  end
  plans[i] = p
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = retry
  out[#out + 1] = 0
end

if mode == 2 or (mode == 1 and allowed) then
  local ttl, written = {}, {}
  for i = 1, count do
    local p = plans[i]
    if p.alg == 2 then
      -- One entry per unit, added in slices to stay within Lua's stack.
      local key, unit = KEYS[p.ki], 0
      while unit < cost do
        local args = {}
        local last = math.min(unit + 1000, cost)
        for u = unit + 1, last do
          args[#args + 1] = now
          args[#args + 1] = nonce .. ':' .. u
        end
        redis.call('ZADD', key, unpack(args))
        unit = last
      end
      redis.call('PEXPIRE', key, p.window)
    else
      groups[p.ki][p.id] = p.state
      ttl[p.ki] = math.max(ttl[p.ki] or 1, p.ttl)
      written[p.ki] = written[p.ki] or {}
      written[p.ki][p.id] = true
    end
    out[2 + (i - 1) * 4 + 4] = p.mark
  end
  for ki, ms in pairs(ttl) do
    -- Records this call did not touch (another key's fallback to this
    -- identity, a longer window) keep the string alive as long as before.
    for id in pairs(groups[ki]) do
      if not written[ki][id] then
        ms = math.max(ms, redis.call('PTTL', KEYS[ki]))
        break
      end
    end
    redis.call('SET', KEYS[ki], cmsgpack.pack(groups[ki]), 'PX', ms)
  end
end

if allowed then out[1] = 1 end
return out
