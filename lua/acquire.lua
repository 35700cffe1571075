-- acquire.lua: check, and charge, several counters at once, all or nothing.
--
-- KEYS     the keys the counters live in: one packed string per identity and
--          policy (fixed, sliding and gcra counters are records in it), and
--          one sorted set per log counter
-- ARGV[1]  big-endian binary: the call, '>Bddd': mode (0 = check only, 1 =
--          check and charge if all pass, 2 = charge without checking), now in
--          unix ms (negative: read Redis TIME, for clock = "redis"), cost in
--          units, nonce (log entries of this call are "<nonce>:<unit>", so a
--          refund removes exactly them); then the counters, 34 bytes each,
--          '>BBdddc8': key index (into KEYS), algorithm (1 buckets, 2 log,
--          3 gcra, 4 calendar window, 5 concurrency), limit, window ms,
--          precision ms (buckets), capacity in us (gcra: burst times the
--          emission interval, plus the delay a request may be held), or for
--          concurrency the lease in ms in place of the window and, in mode
--          2, the slot to free (the mark its acquire returned) in place of
--          the parameter, record tag (64 bits); for a calendar
--          window ("1w", "1mo", "1d" outside UTC: a fixed window whose
--          bounds are no multiple of anything), in place of the window and
--          precision, the unix ms at which the current window ends and the
--          next one ends, as the proxy's clock saw it: the window is the
--          first of the two that `now` is before (src/store/mod.rs, Ends)
--
-- Returns a binary string: '>B' allowed (0/1), '>d' now, then per counter
-- '>ddd' remaining, reset ms, mark (bucket index or nonce; 0 when nothing was
-- charged), then, only when refused, '>d' per counter: retry ms (an allowed
-- call's are all 0).
--
-- A concurrency counter is a sorted set of slots: member the acquire's
-- nonce, score the unix ms its lease ends. Every request takes one slot,
-- whatever its cost; mode 2 (a settlement charging more) frees the slot
-- instead of taking one. A log counter charged in mode 2 (possibly past
-- its limit) gets at most limit + 1 entries: past the limit, more entries
-- of the same instant change no decision.
--
-- Binary both ways: parsing decimals was a third of this script's cost, and
-- parsing an array of integers in the proxy cost more than the script's
-- packing them. A packed string is "\1", '>d' the unix ms it expires at, then
-- records: '>c8I2' tag, payload length, payload:
--   fixed (one bucket of the whole window): '>dd' bucket index, units; a
--     calendar window is a fixed one named by its end instead of an index
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
-- step.
--
-- Written for speed (docs/redis.md): Redis's Lua hashes every byte of every
-- string it makes, and a table costs about 2,000 instructions with its
-- collection. So a key's state and the answer live in locals, the usual call
-- makes no table, tags are compared as 8-byte strings, records are expected in
-- the order the last call wrote them, and the biggest piece (a sliding ring)
-- is copied once, into the string written.

local unpack_, pack_, max = struct.unpack, struct.pack, math.max

local spec = ARGV[1]  -- the call's 25 bytes, then the counters' 34 bytes each
local mode, now, cost = unpack_('>Bdd', spec)  -- (the nonce, for logs, at 18)
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local count = (#spec - 25) / 34

-- The answer per counter: remaining, reset, mark. The first three counters'
-- are in locals (most policies have at most three limits, and the table
-- would cost more than the rest of the answer), the others in `more`;
-- retries (by counter) only once one is refused.
local a1, a2, a3, b1, b2, b3, c1, c2, c3
local more, retries
local allowed, logs = true, false
-- The packed string being worked on. pk: its key index; raw: the stored
-- string; stored: the expiry it has; cursor: the offset of the record
-- expected next (false once out of order); index: records by tag (or false);
-- value: this call's records; need: the expiry they need. A sliding record's
-- pieces are held back (p1..p4) until the next record or the write, so that
-- its ring is copied once, into the string written.
local pk, raw, stored, cursor, index, value, need, p1, p2, p3, p4
-- The same for the packed strings before it, if any (a table each).
local writes

-- Key by key, so that a key's state lives in locals; counters in spec order.
for ki = 1, #KEYS do
  for i = 1, count do
    local k, alg, limit, window, param, tag = unpack_('>BBdddc8', spec, i * 34 - 8)
    if k == ki then
      local remaining, reset, mark
      local retry = 0

      if alg == 2 then
        local key = KEYS[ki]
        redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
        local used = redis.call('ZCARD', key)
        local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
        if #first > 0 then reset = tonumber(first[2]) + window else reset = now + window end
        if used + cost <= limit then
          remaining = limit - used - cost
        else
          remaining, retry = max(limit - used, 0), window
          local need_ = used + cost - limit
          if need_ <= used then
            local e = redis.call('ZRANGE', key, need_ - 1, need_ - 1, 'WITHSCORES')
            retry = tonumber(e[2]) + window - now
          end
        end
        mark, logs = unpack_('>d', spec, 18), true
      elseif alg == 5 then
        local key = KEYS[ki]
        redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
        local used = redis.call('ZCARD', key)
        local unit = cost
        if unit > 1 then unit = 1 end
        if used + unit <= limit then
          remaining, reset = limit - used - unit, now
        else
          remaining, reset, retry = 0, now + 1000, 1000
        end
        mark, logs = unpack_('>d', spec, 18), true
      else
        if pk ~= ki then
          if pk then
            writes = writes or {}
            writes[#writes + 1] = {pk, raw, stored, cursor, value, need, p1, p2, p3, p4}
          end
          -- (One assignment a line: a multiple assignment copies each value
          -- once more.)
          pk = ki
          raw = redis.call('GET', KEYS[ki])
          cursor = 10
          index = false
          need = 0
          p1 = nil
          value = ''  -- (a piece of raw to start with would be copied again)
          local format = 0
          if raw and #raw >= 9 then format, stored = unpack_('>Bd', raw) end
          if format ~= 1 then raw, cursor, stored = '', false, 0 end
        end
        -- The record's format and payload size, known before it is read.
        local fixed = alg == 4 or (alg == 1 and window == param)
        local fmt, want, n, w, cfmt, most = '>c8I2d', 8  -- gcra
        if fixed then
          fmt = '>c8I2dd'
          want = 16
        elseif alg == 1 then
          n = window / param
          -- Slot width: room for four times the limit (charge = "after" may
          -- overshoot it), and the largest count a slot holds.
          w = 2
          cfmt = '>I2'
          most = 65535
          if limit > 1073741823 then
            w, cfmt, most = 8, '>d', 2 ^ 53
          elseif limit > 16383 then
            w, cfmt, most = 4, '>I4', 4294967295
          end
          fmt = '>c8I2ddd'
          want = 24 + n * w
        end
        -- Records are usually stored in the order calls ask for them: try the
        -- next one first, and look records up by tag only when it is not that.
        -- f1..f3: the payload's fields, nil when there is no such record.
        local off, f1, f2, f3
        if cursor and cursor + 9 + want <= #raw then
          local t, size, g1, g2, g3 = unpack_(fmt, raw, cursor)
          if t == tag and size == want then
            off = cursor
            cursor = cursor + 10 + want
            f1 = g1
            f2 = g2
            f3 = g3
          end
        end
        if off == nil and #raw > 9 then
          cursor = false
          if not index then
            -- The offset of each record, by tag.
            index = {}
            local o, len = 10, #raw
            while o + 9 <= len do
              local t, size = unpack_('>c8I2', raw, o)
              if o + 9 + size > len then break end
              index[t] = o
              o = o + 10 + size
            end
          end
          off = index[tag]
          if off and off + 9 + want <= #raw and unpack_('>I2', raw, off + 8) == want then
            local _
            _, _, f1, f2, f3 = unpack_(fmt, raw, off)
          end
        end

        local expiry
        if fixed then
          local b
          if alg == 4 then
            b = window
            if now >= window then b = param end
            reset = b
          else
            b = (now - now % param) / param  -- floor(now / param), without a call
            reset = (b + 1) * param
          end
          local used = 0
          if f1 == b then used = f2 end
          if used + cost <= limit then
            remaining = limit - used - cost
          else
            remaining = max(limit - used, 0)
            if cost > limit and alg == 1 then retry = window else retry = max(reset - now, 1) end
          end
          local rec = pack_('>c8I2dd', tag, 16, b, used + cost)
          if p1 then value, p1 = value .. p1 .. p2 .. p3 .. p4 .. rec, nil
          elseif value == '' then value = rec  -- ('' .. rec would be a copy)
          else value = value .. rec end
          -- (A calendar window both of whose ends have passed, as for a
          -- late `charge = "after"`, is not kept.)
          expiry = max(reset, now + 1)
          mark = b
        elseif alg == 1 then
          local b = (now - now % param) / param
          local len = n * w
          -- The ring is `ring` from byte `r`: at first a part of the stored string.
          local pos, total, nz, ring, r = f1, f2, f3, raw, 1
          if f1 then
            r = off + 34
          else
            pos, total, nz, ring = b, 0, -1, string.rep('\0', len)
          end
          -- Time only moves forward here: a clock behind the newest bucket counts
          -- into the newest bucket.
          if b < pos then b = pos end
          -- stale: bucket b's slot still holds the count of bucket b - n.
          local stale = false
          if b > pos then
            if b - pos >= n then
              ring, r, total = string.rep('\0', len), 1, 0
            elseif b - pos == 1 then
              -- One bucket on (the usual step): the slot that leaves the
              -- window is the one this call writes, so the ring is not copied
              -- to empty it.
              total = total - unpack_(cfmt, ring, r + (b % n) * w)
              stale = true
            else
              -- Empty the buckets that left the window: slots pos+1 .. b, at
              -- most two runs of the ring.
              for idx = pos + 1, b do
                total = total - unpack_(cfmt, ring, r + (idx % n) * w)
              end
              local from, kk = (pos + 1) % n, b - pos
              local head = math.min(kk, n - from)
              local rest = kk - head
              ring = string.rep('\0', rest * w) .. ring:sub(r + rest * w, r + from * w - 1)
                .. string.rep('\0', head * w) .. ring:sub(r + (from + head) * w, r + len - 1)
              r = 1
            end
            pos = b
          end
          if nz ~= -1 and nz <= b - n then nz = -1 end
          if total + cost <= limit then
            remaining = limit - total - cost
            reset = (b + n) * param
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
          local units = had + cost
          if units > most then units = most end
          if p1 then value = value .. p1 .. p2 .. p3 .. p4 end
          p1, p2, p3, p4 = pack_('>c8I2ddd', tag, 24 + len, pos, total + units - had, b),
            ring:sub(r, at - 1), pack_(cfmt, units), ring:sub(at + w, r + len - 1)
          expiry = (b + n) * param
          mark = b
        else
          local t = max(1, math.floor(window * 1000 / limit))
          local cap = param
          local now_us = now * 1000
          local tat = now_us
          if f1 then tat = max(now_us, f1) end
          local new_tat = tat + cost * t
          if new_tat - now_us <= cap then
            remaining, reset = math.floor((cap - (new_tat - now_us)) / t), math.ceil(new_tat / 1000)
          else
            local wait = new_tat - cap - now_us
            if cost * t > cap then wait = window * 1000 end
            remaining = math.floor(max(cap - (tat - now_us), 0) / t)
            reset, retry = math.ceil(tat / 1000), math.ceil(wait / 1000)
          end
          local rec = pack_('>c8I2d', tag, 8, new_tat)
          if p1 then value, p1 = value .. p1 .. p2 .. p3 .. p4 .. rec, nil
          elseif value == '' then value = rec
          else value = value .. rec end
          expiry, mark = math.ceil(new_tat / 1000), 0
        end
        if expiry > need then need = expiry end
      end

      if retry > 0 then
        allowed = false
        retries = retries or {}
        retries[i] = max(retry, 1)
      end
      if i == 1 then a1 = remaining; a2 = reset; a3 = mark
      elseif i == 2 then b1 = remaining; b2 = reset; b3 = mark
      elseif i == 3 then c1 = remaining; c2 = reset; c3 = mark
      else
        more = more or {}
        more[i * 3 - 11], more[i * 3 - 10], more[i * 3 - 9] = remaining, reset, mark
      end
    end
  end
end

local charged = mode == 2 or (mode == 1 and allowed)
if charged then
  -- Log counters: one entry per unit, added in slices to stay within Lua's stack.
  for i = 1, logs and count or 0 do
    local ki, alg, limit, window, param = unpack_('>BBddd', spec, i * 34 - 8)
    if alg == 5 and mode == 2 then
      redis.call('ZREM', KEYS[ki], string.format('%d', param))
    elseif alg == 5 then
      redis.call('ZADD', KEYS[ki], now + window, string.format('%d', unpack_('>d', spec, 18)))
      redis.call('PEXPIRE', KEYS[ki], string.format('%d', window + 1000))
    elseif alg == 2 then
      local key, unit, prefix = KEYS[ki], 0, string.format('%d:', unpack_('>d', spec, 18))
      local units = cost
      if mode == 2 and units > limit + 1 then units = limit + 1 end
      while unit < units do
        local args = {}
        local last = math.min(unit + 1000, units)
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
  -- Packed strings: the one in the locals, then those in `writes`. Each is
  -- this call's records (value, then p1..p4), then the stored ones it did
  -- not rewrite. The TTL is set only when the string must live longer.
  local j = 0
  while pk do
    if not p1 then p1, p2, p3, p4 = '', '', '', '' end
    -- Unless the call rewrote every stored record in order, keep the others,
    -- in their order.
    if #raw > 9 and cursor ~= #raw + 1 then
      value, p1, p2, p3, p4 = value .. p1 .. p2 .. p3 .. p4, '', '', '', ''
      local mine = {}
      for i = 1, count do
        local k, alg, _, _, _, tag = unpack_('>BBdddc8', spec, i * 34 - 8)
        if k == pk and alg ~= 2 then mine[tag] = true end
      end
      local off, len = 10, #raw
      while off + 9 <= len do
        local tag, size = unpack_('>c8I2', raw, off)
        if off + 9 + size > len then break end
        if not mine[tag] then value = value .. raw:sub(off, off + 9 + size) end
        off = off + 10 + size
      end
    end
    if need > stored then
      -- The string is kept a sixteenth of its life longer than its records
      -- need, so that an identity calling once a bucket (once a minute, for
      -- an hour of minutes) moves its expiry every fourth call, not every
      -- call: a SET with PX costs 14,600 instructions, one with KEEPTTL
      -- 6,100. And a second of slack: with clock = "local", another
      -- instance's clock may be behind this one's.
      local life = need - now
      need = need + (life - life % 16) / 16
      redis.call('SET', KEYS[pk], pack_('>Bd', 1, need) .. value .. p1 .. p2 .. p3 .. p4,
        'PX', need - now + 1000)
    else
      redis.call('SET', KEYS[pk], raw:sub(1, 9) .. value .. p1 .. p2 .. p3 .. p4, 'KEEPTTL')
    end
    j, pk = j + 1, nil
    if writes and writes[j] then
      pk, raw, stored, cursor, value, need, p1, p2, p3, p4 = unpack(writes[j], 1, 10)
    end
  end
else
  a3, b3, c3 = 0, 0, 0
  for i = 3, more and #more or 0, 3 do more[i] = 0 end
end

-- The answer; an allowed call's retries are all 0, so it has none.
-- (Arguments beyond the format's are ignored.)
if allowed then
  local fmt = count == 3 and '>Bdddddddddd' or '>Bd' .. string.rep('ddd', count)
  if more then return pack_(fmt, 1, now, a1, a2, a3, b1, b2, b3, c1, c2, c3, unpack(more)) end
  return pack_(fmt, 1, now, a1, a2, a3, b1, b2, b3, c1, c2, c3)
end
local out = {0, now, a1, a2, a3, b1, b2, b3, c1, c2, c3, unpack(more or {})}
for i = 1, count do out[2 + 3 * count + i] = retries and retries[i] or 0 end
return pack_('>Bd' .. string.rep('dddd', count), unpack(out, 1, 2 + 4 * count))
