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
-- step. Written for speed (README, Cost): a key's state in locals, no table
-- per counter or key, no closure over the script's locals, strings joined
-- with `..` (table.concat and struct.pack copy byte by byte).

local unpack_, pack_, floor, max = struct.unpack, struct.pack, math.floor, math.max

local mode, now, cost, nonce = unpack_('>Bddd', ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
end
local spec = ARGV[2]
local count = #spec / 34

-- The offset of each record of a packed string, by tag. (No upvalues: a
-- closure that captures locals costs a call more than a table.)
local function scan(raw)
  local index, off, len = {}, 10, #raw
  while off + 9 <= len do
    local hi, lo, size = struct.unpack('>I4I4I2', raw, off)
    if off + 9 + size > len then break end
    index[hi * 4294967296 + lo] = off
    off = off + 10 + size
  end
  return index
end

-- Room for three counters: growing a table costs more than filling it.
local reply = {0, now, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
local allowed, logs = true, false
-- Per packed string, what a charge writes: {key index, stored string,
-- this call's records, expiry they need, stored expiry, offset after the last
-- record read in order (or false), records by tag (or false)}.
local writes = {}

-- Key by key, so that a key's state lives in locals; counters in spec order.
for ki = 1, #KEYS do
  -- raw: the stored string (nil until read); cursor: the offset of the
  -- record expected next (false once out of order); index: records by tag;
  -- value: this call's records; need: the expiry they need.
  local raw, stored, cursor, index, value, need = nil, 0, 10, false, nil, 0

  for i = 1, count do
    local k, alg, limit, window, param, hi, lo = unpack_('>BBdddI4I4', spec, (i - 1) * 34 + 1)
    if k == ki then
      local remaining, reset, retry, mark

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
          local need_ = used + cost - limit
          if need_ <= used then
            local e = redis.call('ZRANGE', key, need_ - 1, need_ - 1, 'WITHSCORES')
            retry = tonumber(e[2]) + window - now
          end
        end
        mark, logs = nonce, true
      else
        if raw == nil then
          raw = redis.call('GET', KEYS[ki])
          if raw and raw:byte(1) == 1 and #raw >= 9 then
            stored = unpack_('>d', raw, 2)
          else
            raw, cursor = '', false
          end
          value = ''  -- (a piece of raw to start with would be copied again)
        end
        -- The record's format and payload size, known before it is read.
        local fmt, want, n, w, cfmt, most
        if alg == 1 and window == param then
          fmt, want = '>I4I4I2dd', 16
        elseif alg == 1 then
          n = window / param
          -- Slot width: room for four times the limit (charge = "after" may
          -- overshoot it), and the largest count a slot holds.
          w, cfmt, most = 2, '>I2', 65535
          if limit > 1073741823 then
            w, cfmt, most = 8, '>d', 2 ^ 53
          elseif limit > 16383 then
            w, cfmt, most = 4, '>I4', 4294967295
          end
          fmt, want = '>I4I4I2ddd', 24 + n * w
        else
          fmt, want = '>I4I4I2d', 8
        end
        -- Records are usually stored in the order calls ask for them: try the
        -- next one first, and look records up by tag only when it is not that.
        -- f1..f3: the payload's fields, nil when there is no such record.
        local off, f1, f2, f3
        if cursor and cursor + 9 + want <= #raw then
          local thi, tlo, tsize
          thi, tlo, tsize, f1, f2, f3 = unpack_(fmt, raw, cursor)
          if thi == hi and tlo == lo and tsize == want then
            off, cursor = cursor, cursor + 10 + want
          else
            f1 = nil
          end
        end
        if off == nil and #raw > 9 then
          cursor = false
          if not index then index = scan(raw) end
          off = index[hi * 4294967296 + lo]
          if off and off + 9 + want <= #raw and unpack_('>I2', raw, off + 8) == want then
            local _
            _, _, _, f1, f2, f3 = unpack_(fmt, raw, off)
          end
        end

        local expiry
        if alg == 1 and window == param then
          local b = floor(now / param)
          local used = 0
          if f1 == b then used = f2 end
          reset = (b + 1) * param
          if used + cost <= limit then
            remaining, retry = limit - used - cost, 0
          else
            remaining = max(limit - used, 0)
            if cost > limit then retry = window else retry = reset - now end
          end
          value = value .. pack_('>I4I4I2dd', hi, lo, 16, b, used + cost)
          expiry, mark = reset, b
        elseif alg == 1 then
          local b = floor(now / param)
          local len = n * w
          -- The ring is `ring` from byte `r`: at first a part of the stored string.
          local pos, total, nz, ring, r
          if f1 then
            pos, total, nz, ring, r = f1, f2, f3, raw, off + 34
          else
            pos, total, nz, ring, r = b, 0, -1, string.rep('\0', len), 1
          end
          -- Time only moves forward here: a clock behind the newest bucket counts
          -- into the newest bucket.
          if b < pos then b = pos end
          -- stale: bucket b's slot still holds the count of bucket b - n.
          local stale = false
          if b > pos then
            if b - pos >= n then
              ring, r, total = string.rep('\0', len), 1, 0
            else
              -- Empty the buckets that left the window: slots pos+1 .. b, at
              -- most two runs of the ring.
              for idx = pos + 1, b do
                total = total - unpack_(cfmt, ring, r + (idx % n) * w)
              end
              if b - pos == 1 then
                -- One bucket on (the usual step): its slot is the one this
                -- call writes, so the ring is not copied to empty it.
                stale = true
              else
                local from, kk = (pos + 1) % n, b - pos
                local head = math.min(kk, n - from)
                local rest = kk - head
                ring = string.rep('\0', rest * w) .. ring:sub(r + rest * w, r + from * w - 1)
                  .. string.rep('\0', head * w) .. ring:sub(r + (from + head) * w, r + len - 1)
                r = 1
              end
            end
            pos = b
          end
          if nz ~= -1 and nz <= b - n then nz = -1 end
          if total + cost <= limit then
            remaining, retry, reset = limit - total - cost, 0, (b + n) * param
          else
            remaining, retry = max(limit - total, 0), window
            if nz ~= -1 then reset = (nz + n) * param else reset = (b + n) * param end
            local short, freed = total + cost - limit, 0
            for idx = b - n + 1, b do
              if idx < b or not stale then freed = freed + unpack_(cfmt, ring, r + (idx % n) * w) end
              if freed >= short then
                retry = (idx + n) * param - now
                break
              end
            end
          end
          -- A slot saturates rather than wraps (only an absurd overshoot gets
          -- there); the total stays the sum of the slots.
          local at = r + (b % n) * w
          local had = 0
          if not stale then had = unpack_(cfmt, ring, at) end
          local units = math.min(had + cost, most)
          value = value .. pack_('>I4I4I2ddd', hi, lo, 24 + len, pos, total + units - had, b)
            .. ring:sub(r, at - 1) .. pack_(cfmt, units) .. ring:sub(at + w, r + len - 1)
          expiry, mark = (b + n) * param, b
        else
          local t = max(1, floor(window * 1000 / limit))
          local cap = t * param
          local now_us = now * 1000
          local tat = now_us
          if f1 then tat = max(now_us, f1) end
          local new_tat = tat + cost * t
          if new_tat - now_us <= cap then
            remaining, reset, retry = floor((cap - (new_tat - now_us)) / t), math.ceil(new_tat / 1000), 0
          else
            local wait = new_tat - cap - now_us
            if cost * t > cap then wait = window * 1000 end
            remaining = floor(max(cap - (tat - now_us), 0) / t)
            reset, retry = math.ceil(tat / 1000), math.ceil(wait / 1000)
          end
          value = value .. pack_('>I4I4I2d', hi, lo, 8, new_tat)
          expiry, mark = math.ceil(new_tat / 1000), 0
        end
        if expiry > need then need = expiry end
      end

      if retry > 0 then
        allowed = false
        if retry < 1 then retry = 1 end
      end
      local at = 2 + (i - 1) * 4
      reply[at + 1], reply[at + 2], reply[at + 3], reply[at + 4] = remaining, reset, retry, mark
    end
  end
  if value then
    writes[#writes + 1] = {ki, raw, value, need, stored, cursor, index}
  end
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
  for _, wr in ipairs(writes) do
    local ki, raw, value, need, stored, cursor = wr[1], wr[2], wr[3], wr[4], wr[5], wr[6]
    -- Unless the call rewrote every stored record in order, keep the others.
    if #raw > 9 and cursor ~= #raw + 1 then
      local mine = {}
      for i = 1, count do
        local k, alg, _, _, _, hi, lo = unpack_('>BBdddI4I4', spec, (i - 1) * 34 + 1)
        if k == ki and alg ~= 2 then mine[hi * 4294967296 + lo] = true end
      end
      for tag, off in pairs(wr[7] or scan(raw)) do
        if not mine[tag] then
          value = value .. raw:sub(off, off + 9 + unpack_('>I2', raw, off + 8))
        end
      end
    end
    if need > stored then
      -- A second of slack: with clock = "local", another instance's clock
      -- may be behind this one's.
      redis.call('SET', KEYS[ki], '\1' .. pack_('>d', need) .. value, 'PX', need - now + 1000)
    else
      redis.call('SET', KEYS[ki], raw:sub(1, 9) .. value, 'KEEPTTL')
    end
  end
else
  for i = 1, count do reply[2 + i * 4] = 0 end
end

if allowed then reply[1] = 1 end
-- The format's text for three counters is a constant; others are made.
local fmt = '>Bddddddddddddd'
if count ~= 3 then fmt = '>Bd' .. string.rep('dddd', count) end
return pack_(fmt, unpack(reply, 1, 2 + 4 * count))
