-- acquire.lua: check, and charge, several counters at once, all or nothing.
--
-- KEYS[i]   one key per counter (all of one identity share a hash tag)
-- ARGV[1]   mode: 0 = check only, 1 = check and charge if all pass,
--           2 = charge without checking (charge = "after", once the status is known)
-- ARGV[2]   now in unix ms, or "" to read Redis TIME (clock = "redis")
-- ARGV[3]   cost in units
-- ARGV[4]   nonce: log entries of this call are "<nonce>:<unit>", so a refund
--           removes exactly them
-- then four per counter: algorithm (1 buckets, 2 log, 3 gcra), limit,
--           window ms, and precision ms (buckets) or burst (gcra)
--
-- Returns {allowed, now, then per counter: remaining, reset ms, retry ms, mark}.
--
-- Fixed windows are buckets with precision = window: one HASH per counter maps
-- bucket index (floor(now / precision)) to units; a bucket counts while
-- index + window/precision > current index. A log is a sorted set of units
-- scored by time. GCRA keeps its theoretical arrival time (µs) in a string.
-- The same definitions are in src/store/memory.rs; keep them in step.

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

-- Lua 5.1 prints large numbers in exponent form; Redis wants digits.
local function int(x)
  return string.format('%.0f', x)
end

local out = {0, now}
local plans = {}
local allowed = true

for i = 1, #KEYS do
  local key = KEYS[i]
  local at = 4 + (i - 1) * 4
  local alg = tonumber(ARGV[at + 1])
  local limit = tonumber(ARGV[at + 2])
  local window = tonumber(ARGV[at + 3])
  local param = tonumber(ARGV[at + 4])
  local p = {alg = alg, key = key, window = window}
  local remaining, reset, retry

  if alg == 1 then
    local n = window / param
    local b = math.floor(now / param)
    local flat = redis.call('HGETALL', key)
    local live, stale, used = {}, {}, 0
    for j = 1, #flat, 2 do
      local idx = tonumber(flat[j])
      local units = tonumber(flat[j + 1])
      if idx + n <= b then
        stale[#stale + 1] = flat[j]
      elseif units > 0 then
        -- A bucket refunded to zero counts for nothing, not even the reset.
        used = used + units
        live[#live + 1] = {idx, units}
      end
    end
    table.sort(live, function(x, y) return x[1] < y[1] end)
    local oldest = b
    if #live > 0 and live[1][1] < b then oldest = live[1][1] end
    reset = (oldest + n) * param
    if used + cost <= limit then
      remaining, retry = limit - used - cost, 0
    else
      remaining, retry = math.max(limit - used, 0), window
      local need, freed = used + cost - limit, 0
      for j = 1, #live do
        freed = freed + live[j][2]
        if freed >= need then
          retry = (live[j][1] + n) * param - now
          break
        end
      end
    end
    p.bucket, p.stale, p.ttl = b, stale, (b + n) * param - now
  elseif alg == 2 then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - window))
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
  else
    local t = math.max(1, math.floor(window * 1000 / limit))
    local cap = t * param
    local now_us = now * 1000
    local tat = tonumber(redis.call('GET', key) or '0')
    if tat < now_us then tat = now_us end
    local new_tat = tat + cost * t
    if new_tat - now_us <= cap then
      remaining, reset, retry = math.floor((cap - (new_tat - now_us)) / t), math.ceil(new_tat / 1000), 0
    else
      local wait = new_tat - cap - now_us
      if cost * t > cap then wait = window * 1000 end
      remaining = math.floor(math.max(cap - (tat - now_us), 0) / t)
      reset, retry = math.ceil(tat / 1000), math.ceil(wait / 1000)
    end
    p.tat = new_tat
    p.ttl = math.ceil(new_tat / 1000) - now
  end

  if retry > 0 then
    allowed = false
    if retry < 1 then retry = 1 end
  end
  p.mark = 0
  plans[i] = p
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = retry
  out[#out + 1] = 0
end

if mode == 2 or (mode == 1 and allowed) then
  for i = 1, #plans do
    local p = plans[i]
    if p.alg == 1 then
      redis.call('HINCRBY', p.key, int(p.bucket), cost)
      if #p.stale > 0 then redis.call('HDEL', p.key, unpack(p.stale)) end
      redis.call('PEXPIRE', p.key, int(p.ttl))
      out[2 + (i - 1) * 4 + 4] = p.bucket
    elseif p.alg == 2 then
      -- One entry per unit, added in slices to stay within Lua's stack.
      local unit = 0
      while unit < cost do
        local args = {}
        local last = math.min(unit + 1000, cost)
        for u = unit + 1, last do
          args[#args + 1] = now
          args[#args + 1] = nonce .. ':' .. u
        end
        redis.call('ZADD', p.key, unpack(args))
        unit = last
      end
      redis.call('PEXPIRE', p.key, p.window)
      out[2 + (i - 1) * 4 + 4] = tonumber(nonce)
    else
      redis.call('SET', p.key, int(p.tat), 'PX', int(math.max(p.ttl, 1)))
    end
  end
end

if allowed then out[1] = 1 end
return out
