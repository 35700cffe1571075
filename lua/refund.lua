-- refund.lua: give back what acquire.lua charged, from the same buckets.
--
-- KEYS[i]   the counters, as given to acquire.lua
-- ARGV[1]   now in unix ms, or "" to read Redis TIME
-- ARGV[2]   cost in units
-- then four per counter: algorithm (1 buckets, 2 log, 3 gcra), limit,
--           window ms, precision ms (buckets) or burst (gcra); then its mark
--           (bucket index, or the log nonce)
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
local function int(x)
  return string.format('%.0f', x)
end

local changed = 0
for i = 1, #KEYS do
  local key = KEYS[i]
  local at = 2 + (i - 1) * 5
  local alg = tonumber(ARGV[at + 1])
  local limit = tonumber(ARGV[at + 2])
  local window = tonumber(ARGV[at + 3])
  local param = tonumber(ARGV[at + 4])
  local mark = ARGV[at + 5]
  if alg == 1 then
    local n = window / param
    if tonumber(mark) + n > math.floor(now / param) then
      local units = tonumber(redis.call('HGET', key, mark) or '0')
      if units > 0 then
        redis.call('HINCRBY', key, mark, -math.min(units, cost))
        changed = changed + 1
      end
    end
  elseif alg == 2 then
    local members = {}
    for u = 1, cost do members[#members + 1] = mark .. ':' .. u end
    local start = 1
    while start <= #members do
      local last = math.min(start + 999, #members)
      changed = changed + redis.call('ZREM', key, unpack(members, start, last))
      start = last + 1
    end
  else
    local tat = tonumber(redis.call('GET', key) or '0')
    if tat > 0 then
      local t = math.max(1, math.floor(window * 1000 / limit))
      local back = math.max(now * 1000, tat - cost * t)
      redis.call('SET', key, int(back), 'KEEPTTL')
      changed = changed + 1
    end
  end
end
return changed
