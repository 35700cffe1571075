-- refund.lua: give back what acquire.lua charged, from the same buckets.
--
-- KEYS     as for acquire.lua
-- ARGV[1]  '>dd': now in unix ms (negative: read Redis TIME), cost in units
-- ARGV[2]  the counters, as for acquire.lua (34 bytes each)
-- ARGV[3]  '>d' per counter: the mark acquire.lua returned (bucket index, or
--          the log nonce)
--
-- Units whose bucket has left the window are not given back (they no longer
-- count anyway). Concurrency slots (algorithm 5) are freed, whatever the cost. Records are as acquire.lua describes them. Returns the number
-- of counters changed.

local unpack_ = struct.unpack
local pack_ = struct.pack
local floor = math.floor

local now, cost = unpack_('>dd', ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
end
local spec, marks = ARGV[2], ARGV[3]
local count = #spec / 34

-- groups[ki] = {raw, tag -> offset of its record, tag -> new record}.
local groups = {}
local function group(ki)
  local g = groups[ki]
  if g == nil then
    local raw = redis.call('GET', KEYS[ki])
    local at = {}
    if raw and raw:byte(1) == 1 and #raw >= 9 then
      local off, len = 10, #raw
      while off + 9 <= len do
        local hi, lo, size = unpack_('>I4I4I2', raw, off)
        if off + 9 + size > len then break end
        at[hi * 4294967296 + lo] = off
        off = off + 10 + size
      end
    else
      raw = ''
    end
    g = {raw, at, {}}
    groups[ki] = g
  end
  return g
end

local formats = {[2] = '>I2', [4] = '>I4', [8] = '>d'}
local function width(limit)
  if limit <= 16383 then return 2 elseif limit <= 1073741823 then return 4 else return 8 end
end

local changed = 0
for i = 1, count do
  local ki, alg, limit, window, param, hi, lo = unpack_('>BBdddI4I4', spec, (i - 1) * 34 + 1)
  local tag = hi * 4294967296 + lo
  local mark = unpack_('>d', marks, (i - 1) * 8 + 1)
  if alg == 5 then
    -- A concurrency slot: freed whatever the cost.
    changed = changed + redis.call('ZREM', KEYS[ki], string.format('%d', mark))
  elseif cost == 0 then
    -- Only slots to free (a settlement that gives nothing back).
  elseif alg == 2 then
    local members, prefix = {}, string.format('%d:', mark)
    for u = 1, cost do members[#members + 1] = prefix .. u end
    local start = 1
    while start <= #members do
      local last = math.min(start + 999, #members)
      changed = changed + redis.call('ZREM', KEYS[ki], unpack(members, start, last))
      start = last + 1
    end
  else
    local g = group(ki)
    local raw, off = g[1], g[2][tag]
    local size = off and unpack_('>I2', raw, off + 8)
    if alg == 4 or (alg == 1 and window == param) then
      if size == 16 then
        local b, units = unpack_('>dd', raw, off + 10)
        if b == mark and units > 0 then
          g[3][tag] = pack_('>I4I4I2dd', hi, lo, 16, b, units - math.min(units, cost))
          changed = changed + 1
        end
      end
    elseif alg == 1 then
      local n = window / param
      local w = width(limit)
      local fmt = formats[w]
      if size == 24 + n * w then
        local pos, total, nz = unpack_('>ddd', raw, off + 10)
        local r = off + 34
        if mark > floor(now / param) - n and mark > pos - n and mark <= pos then
          local at = r + (mark % n) * w
          local units = unpack_(fmt, raw, at)
          local back = math.min(units, cost)
          if back > 0 then
            -- The newest bucket holding units may now be an older one.
            if units == back and nz == mark then
              nz = -1
              for idx = mark - 1, pos - n + 1, -1 do
                if unpack_(fmt, raw, r + (idx % n) * w) > 0 then
                  nz = idx
                  break
                end
              end
            end
            g[3][tag] = pack_('>I4I4I2ddd', hi, lo, size, pos, total - back, nz)
              .. raw:sub(r, at - 1) .. pack_(fmt, units - back) .. raw:sub(at + w, r + n * w - 1)
            changed = changed + 1
          end
        end
      end
    elseif size == 8 then
      local t = math.max(1, floor(window * 1000 / limit))
      local tat = unpack_('>d', raw, off + 10)
      g[3][tag] = pack_('>I4I4I2d', hi, lo, 8, math.max(now * 1000, tat - cost * t))
      changed = changed + 1
    end
  end
end

for ki, g in pairs(groups) do
  if next(g[3]) ~= nil then
    local raw = g[1]
    local parts = {raw:sub(1, 9)}
    for tag, off in pairs(g[2]) do
      parts[#parts + 1] = g[3][tag] or raw:sub(off, off + 9 + unpack_('>I2', raw, off + 8))
    end
    redis.call('SET', KEYS[ki], table.concat(parts), 'KEEPTTL')
  end
end
return changed
