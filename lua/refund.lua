-- refund.lua: give back what acquire.lua charged, from the same buckets.
--
-- KEYS      as for acquire.lua
-- ARGV[1]   now in unix ms, or "" to read Redis TIME
-- ARGV[2]   cost in units
-- ARGV[3]   number of counters; then seven per counter: key index, algorithm
--           (1 buckets, 2 log, 3 gcra), limit, window ms, precision ms or
--           burst, record id, mark (bucket index, or the log nonce)
--
-- Units whose bucket has left the window are not given back (they no longer
-- count anyway). Returns the number of counters changed.

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(ARGV[1])
end
local cost = tonumber(ARGV[2])
local count = tonumber(ARGV[3])

local groups, dirty = {}, {}
local function group(ki)
  local g = groups[ki]
  if g == nil then
    local raw = redis.call('GET', KEYS[ki])
    if raw then g = cmsgpack.unpack(raw) else g = {} end
    groups[ki] = g
  end
  return g
end

-- Ring slots, as in acquire.lua.
local formats = {[2] = '>I2', [4] = '>I4', [8] = '>d'}
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

local changed = 0
for i = 1, count do
  local at = 3 + (i - 1) * 7
  local ki = tonumber(ARGV[at + 1])
  local alg = tonumber(ARGV[at + 2])
  local limit = tonumber(ARGV[at + 3])
  local window = tonumber(ARGV[at + 4])
  local param = tonumber(ARGV[at + 5])
  local id = ARGV[at + 6]
  local mark = ARGV[at + 7]
  if alg == 1 and window == param then
    local st = group(ki)[id]
    if st and st[1] == tonumber(mark) and st[2] > 0 then
      st[2] = st[2] - math.min(st[2], cost)
      dirty[ki], changed = true, changed + 1
    end
  elseif alg == 1 then
    local n = window / param
    local m = tonumber(mark)
    local st = group(ki)[id]
    local w = width(limit)
    if st and #st[4] == n * w and m > math.floor(now / param) - n and m > st[1] - n and m <= st[1] then
      local j = m % n + 1
      local units = slot(st[4], w, j)
      local back = math.min(units, cost)
      if back > 0 then
        st[4] = set_slot(st[4], w, j, units - back)
        st[2] = st[2] - back
        -- The newest bucket holding units may now be an older one.
        if units == back and st[3] == m then
          st[3] = -1
          for idx = m - 1, st[1] - n + 1, -1 do
            if slot(st[4], w, idx % n + 1) > 0 then
              st[3] = idx
              break
            end
          end
        end
        dirty[ki], changed = true, changed + 1
      end
    end
  elseif alg == 2 then
    local members = {}
    for u = 1, cost do members[#members + 1] = mark .. ':' .. u end
    local start = 1
    while start <= #members do
      local last = math.min(start + 999, #members)
      changed = changed + redis.call('ZREM', KEYS[ki], unpack(members, start, last))
      start = last + 1
    end
  else
    local st = group(ki)[id]
    if st then
      local t = math.max(1, math.floor(window * 1000 / limit))
      st[1] = math.max(now * 1000, st[1] - cost * t)
      dirty[ki], changed = true, changed + 1
    end
  end
end
for ki in pairs(dirty) do
  redis.call('SET', KEYS[ki], cmsgpack.pack(groups[ki]), 'KEEPTTL')
end
return changed
