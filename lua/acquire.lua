-- acquire.lua: check, and charge, several counters at once, all or nothing.
--
-- KEYS     the keys the counters live in: one packed string per identity and
--          policy (fixed, sliding and gcra counters are records in it), and
--          one sorted set per log counter
-- ARGV[1]  the call, big-endian binary '>Bddd': mode (0 = check only, 1 =
--          check and charge if all pass, 2 = charge without checking), now in
--          unix ms (negative: read Redis TIME, for clock = "redis"), cost in
--          units, nonce (log entries of this call are "<nonce>:<unit>", so a
--          refund removes exactly them)
-- ARGV[2]  the counters, 34 bytes each, '>BBdddI4I4': key index (into KEYS),
--          algorithm (1 buckets, 2 log, 3 gcra), limit, window ms, precision
--          ms (buckets) or burst (gcra), record tag (64 bits, two halves)
--
-- Returns a binary string: '>B' allowed (0/1), '>d' now, then per counter
-- '>dddd' remaining, reset ms, retry ms, mark (bucket index or nonce; 0 when
-- nothing was charged).
--
-- Binary both ways: parsing decimals was a third of this script's cost, and
-- parsing an array of integers in the proxy cost more than the script's
-- packing them. A packed string is "\1", '>d' the unix
-- ms it expires at, then records: '>I4I4I2' tag, payload length, payload:
--   fixed (one bucket of the whole window): '>dd' bucket index, units
--   sliding (window/precision buckets): '>ddd' newest index, units in the
--     window, newest index holding units or -1; then the ring of
--     window/precision big-endian counts, 2 bytes wide when the limit fits
--     (else 4, or 8 as a double)
--   gcra: '>d' theoretical arrival time in us
-- Records this call does not know (a limit removed by a reload, another key
-- spec's) are kept as they are, and the string lives as long as the longest
-- record needs. Bucket index = floor(now / precision). A sliding window keeps
-- a running total, so a decision reads and writes only the buckets it needs.
-- The same definitions are in src/store/memory.rs and refund.lua; keep them in
-- step. Written for speed: no table per counter, one string per record.

local unpack_, pack_, floor, max = struct.unpack, struct.pack, math.floor, math.max

local mode, now, cost, nonce = unpack_('>Bddd', ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
end
local spec = ARGV[2]
local count = #spec / 34

-- Per key index, read on first use: the stored string, its expiry, and the
-- offset of each record by tag, and how many records it holds.
local raws, expiries, offsets, stored = {}, {}, {}, {}
local function load(ki)
  local raw, at, expiry, n = redis.call('GET', KEYS[ki]), {}, 0, 0
  if raw and raw:byte(1) == 1 and #raw >= 9 then
    expiry = unpack_('>d', raw, 2)
    local off, len = 10, #raw
    while off + 9 <= len do
      local hi, lo, size = unpack_('>I4I4I2', raw, off)
      if off + 9 + size > len then break end
      at[hi * 4294967296 + lo] = off
      off = off + 10 + size
      n = n + 1
    end
  else
    raw = ''
  end
  raws[ki], expiries[ki], offsets[ki], stored[ki] = raw, expiry, at, n
end

local formats = {[2] = '>I2', [4] = '>I4', [8] = '>d'}
local maxima = {[2] = 65535, [4] = 4294967295, [8] = 2 ^ 53}

-- What the charge writes: per counter its key index and new record; per
-- key the expiry it needs and how many stored records this call rewrites.
local kis, records, needs, hits = {}, {}, {}, {}
local reply = {0, now}
local allowed = true

for i = 1, count do
  local ki, alg, limit, window, param, hi, lo = unpack_('>BBdddI4I4', spec, (i - 1) * 34 + 1)
  local remaining, reset, retry, mark, record, expiry

  if alg == 2 then
    local key = KEYS[ki]
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
    local used = redis.call('ZCARD', key)
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    if #first > 0 then reset = tonumber(first[2]) + window else reset = now + window end
    if used + cost <= limit then
      remaining, retry = limit - used - cost, 0
    else
      remaining, retry = max(limit - used, 0), window
      local need = used + cost - limit
      if need <= used then
        local e = redis.call('ZRANGE', key, need - 1, need - 1, 'WITHSCORES')
        retry = tonumber(e[2]) + window - now
      end
    end
    mark = nonce
  else
    if raws[ki] == nil then load(ki) end
    local raw, tag = raws[ki], hi * 4294967296 + lo
    local off = offsets[ki][tag]
    local size = off and unpack_('>I2', raw, off + 8)
    if off then hits[ki] = (hits[ki] or 0) + 1 end

    if alg == 1 and window == param then
      local b = floor(now / param)
      local used = 0
      if size == 16 then
        local sb, units = unpack_('>dd', raw, off + 10)
        if sb == b then used = units end
      end
      reset = (b + 1) * param
      if used + cost <= limit then
        remaining, retry = limit - used - cost, 0
      else
        remaining = max(limit - used, 0)
        if cost > limit then retry = window else retry = reset - now end
      end
      record, expiry, mark = pack_('>I4I4I2dd', hi, lo, 16, b, used + cost), reset, b
    elseif alg == 1 then
      local n = window / param
      local b = floor(now / param)
      local w = limit <= 16383 and 2 or (limit <= 1073741823 and 4 or 8)
      local fmt, len = formats[w], n * w
      -- The ring is `ring` from byte `r`: at first a part of the stored string.
      local pos, total, nz, ring, r
      if size == 24 + len then
        pos, total, nz = unpack_('>ddd', raw, off + 10)
        ring, r = raw, off + 34
      else
        pos, total, nz, ring, r = b, 0, -1, string.rep('\0', len), 1
      end
      -- Time only moves forward here: a clock behind the newest bucket counts
      -- into the newest bucket.
      if b < pos then b = pos end
      if b > pos then
        if b - pos >= n then
          ring, r, total = string.rep('\0', len), 1, 0
        else
          -- Empty the buckets that left the window: slots pos+1 .. b, at
          -- most two runs of the ring.
          for idx = pos + 1, b do
            total = total - unpack_(fmt, ring, r + (idx % n) * w)
          end
          local from, k = (pos + 1) % n, b - pos
          local head = math.min(k, n - from)
          local rest = k - head
          ring = string.rep('\0', rest * w) .. ring:sub(r + rest * w, r + from * w - 1)
            .. string.rep('\0', head * w) .. ring:sub(r + (from + head) * w, r + len - 1)
          r = 1
        end
        pos = b
      end
      if nz ~= -1 and nz <= b - n then nz = -1 end
      if total + cost <= limit then
        remaining, retry, reset = limit - total - cost, 0, (b + n) * param
      else
        remaining, retry = max(limit - total, 0), window
        if nz ~= -1 then reset = (nz + n) * param else reset = (b + n) * param end
        local need, freed = total + cost - limit, 0
        for idx = b - n + 1, b do
          freed = freed + unpack_(fmt, ring, r + (idx % n) * w)
          if freed >= need then
            retry = (idx + n) * param - now
            break
          end
        end
      end
      -- A slot saturates rather than wraps (only an absurd overshoot gets
      -- there); the total stays the sum of the slots.
      local at = r + (b % n) * w
      local had = unpack_(fmt, ring, at)
      local units = math.min(had + cost, maxima[w])
      record = pack_('>I4I4I2ddd', hi, lo, 24 + len, pos, total + units - had, b)
        .. ring:sub(r, at - 1) .. pack_(fmt, units) .. ring:sub(at + w, r + len - 1)
      expiry, mark = (b + n) * param, b
    else
      local t = max(1, floor(window * 1000 / limit))
      local cap = t * param
      local now_us = now * 1000
      local tat = now_us
      if size == 8 then tat = max(now_us, unpack_('>d', raw, off + 10)) end
      local new_tat = tat + cost * t
      if new_tat - now_us <= cap then
        remaining, reset, retry = floor((cap - (new_tat - now_us)) / t), math.ceil(new_tat / 1000), 0
      else
        local wait = new_tat - cap - now_us
        if cost * t > cap then wait = window * 1000 end
        remaining = floor(max(cap - (tat - now_us), 0) / t)
        reset, retry = math.ceil(tat / 1000), math.ceil(wait / 1000)
      end
      record, expiry, mark = pack_('>I4I4I2d', hi, lo, 8, new_tat), math.ceil(new_tat / 1000), 0
    end
    kis[i], records[i] = ki, record
    needs[ki] = max(needs[ki] or 0, expiry)
  end

  if retry > 0 then
    allowed = false
    if retry < 1 then retry = 1 end
  end
  local at = 2 + (i - 1) * 4
  reply[at + 1], reply[at + 2], reply[at + 3], reply[at + 4] = remaining, reset, retry, mark
end

local charged = mode == 2 or (mode == 1 and allowed)
if charged then
  -- Log counters: one entry per unit, added in slices to stay within Lua's stack.
  for i = 1, count do
    if kis[i] == nil then
      local ki, _, _, window = unpack_('>BBdd', spec, (i - 1) * 34 + 1)
      local key, unit, prefix = KEYS[ki], 0, string.format('%d:', nonce)
      while unit < cost do
        local args = {}
        local last = math.min(unit + 1000, cost)
        for u = unit + 1, last do
          args[#args + 1] = now
          args[#args + 1] = prefix .. u
        end
        redis.call('ZADD', key, unpack(args))
        unit = last
      end
      redis.call('PEXPIRE', key, string.format('%d', window))
    end
  end
  -- Packed strings: this call's records, then the stored ones it did not
  -- rewrite. The TTL is set only when the string must live longer.
  for ki, need in pairs(needs) do
    local raw, at = raws[ki], offsets[ki]
    local expiry = max(need, expiries[ki])
    local parts = {'\1', pack_('>d', expiry)}
    for i = 1, count do
      if kis[i] == ki then parts[#parts + 1] = records[i] end
    end
    if (hits[ki] or 0) < stored[ki] then
      local mine = {}
      for i = 1, count do
        if kis[i] == ki then
          local _, _, _, _, _, hi, lo = unpack_('>BBdddI4I4', spec, (i - 1) * 34 + 1)
          mine[hi * 4294967296 + lo] = true
        end
      end
      for tag, off in pairs(at) do
        if not mine[tag] then
          parts[#parts + 1] = raw:sub(off, off + 9 + unpack_('>I2', raw, off + 8))
        end
      end
    end
    if expiry > expiries[ki] then
      -- A second of slack: with clock = "local", another instance's clock
      -- may be behind this one's.
      redis.call('SET', KEYS[ki], table.concat(parts), 'PX', string.format('%d', expiry - now + 1000))
    else
      redis.call('SET', KEYS[ki], table.concat(parts), 'KEEPTTL')
    end
  end
else
  for i = 1, count do reply[2 + i * 4] = 0 end
end

if allowed then reply[1] = 1 end
return pack_('>Bd' .. string.rep('dddd', count), unpack(reply))
