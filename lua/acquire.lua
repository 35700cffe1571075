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

-- The offset of each record of a packed string, by tag.
local function scan(raw)
  local at, off, len = {}, 10, #raw
  while off + 9 <= len do
    local hi, lo, size = unpack_('>I4I4I2', raw, off)
    if off + 9 + size > len then break end
    at[hi * 4294967296 + lo] = off
    off = off + 10 + size
  end
  return at
end

-- Per key index, read on first use (see below).
local groups = {}


local reply = {0, now}
local allowed, logs = true, false

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
    mark, logs = nonce, true
  else
    local g = groups[ki]
    if g == nil then
      local raw, expiry, cursor = redis.call('GET', KEYS[ki]), 0, false
      if raw and raw:byte(1) == 1 and #raw >= 9 then
        expiry, cursor = unpack_('>d', raw, 2), 10
      else
        raw = ''
      end
      -- One table per key (tables are what a call spends most on): the
      -- string, its expiry, the offset of the record expected next (false
      -- once out of order), records by tag (false until needed), the expiry
      -- this call needs, and the parts of the string to write: "\1", the
      -- expiry, then this call's records.
      g = {raw, expiry, cursor, false, 0, {'\1', ''}}
      groups[ki] = g
    end
    local raw, tag = g[1], hi * 4294967296 + lo
    -- Records are usually stored in the order calls ask for them: try the
    -- next one first, and look records up by tag only when it is not that.
    local off, size
    local cursor = g[3]
    if cursor and cursor + 9 <= #raw then
      local thi, tlo, tsize = unpack_('>I4I4I2', raw, cursor)
      if thi == hi and tlo == lo and cursor + 9 + tsize <= #raw then
        off, size, g[3] = cursor, tsize, cursor + 10 + tsize
      end
    end
    if off == nil and #raw > 9 then
      g[3] = false
      if not g[4] then g[4] = scan(raw) end
      off = g[4][tag]
      size = off and unpack_('>I2', raw, off + 8)
    end

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
      -- Slot width: room for four times the limit (charge = "after" may
      -- overshoot it), and the largest count a slot holds.
      local w, fmt, most = 2, '>I2', 65535
      if limit > 1073741823 then
        w, fmt, most = 8, '>d', 2 ^ 53
      elseif limit > 16383 then
        w, fmt, most = 4, '>I4', 4294967295
      end
      local len = n * w
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
      local units = math.min(had + cost, most)
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
    local parts = g[6]
    parts[#parts + 1] = record
    g[5] = max(g[5], expiry)
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
  for i = 1, logs and count or 0 do
    local ki, alg, _, window = unpack_('>BBdd', spec, (i - 1) * 34 + 1)
    if alg == 2 then
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
  for ki, g in pairs(groups) do
    local raw, stored_expiry = g[1], g[2]
    local expiry = max(g[5], stored_expiry)
    local parts = g[6]
    parts[2] = pack_('>d', expiry)
    -- Unless the call rewrote every stored record in order, keep the others.
    if #raw > 9 and g[3] ~= #raw + 1 then
      local mine = {}
      for i = 1, count do
        local k, alg, _, _, _, hi, lo = unpack_('>BBdddI4I4', spec, (i - 1) * 34 + 1)
        if k == ki and alg ~= 2 then mine[hi * 4294967296 + lo] = true end
      end
      for tag, off in pairs(g[4] or scan(raw)) do
        if not mine[tag] then
          parts[#parts + 1] = raw:sub(off, off + 9 + unpack_('>I2', raw, off + 8))
        end
      end
    end
    if expiry > stored_expiry then
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
