-- seed_reference.lua: a cost reference for bench/redis_cost.py, not used by sluice.
--
-- The layout and Redis operations of the sliding-window script in the
-- articles sluice grew from (one HASH per identity; per limit a window total,
-- an "oldest block" marker and one field per precision block; old blocks read
-- one HGET at a time and deleted), so that the bench can report sluice's
-- script as a ratio to it, measured in the same run on the same machine.
-- Written for this measurement only: it keeps the articles' shortcomings
-- (for one, it refuses whenever its stored marker is ahead of `now`).
--
-- KEYS[1]  the identity's hash
-- ARGV[1]  JSON limits: [[window s, limit, precision s (optional)], ...]
-- ARGV[2]  now, unix seconds (may have a fraction)
-- ARGV[3]  weight
-- Returns 1 when refused, 0 when allowed and charged.

local limits = cjson.decode(ARGV[1])
local now = tonumber(ARGV[2])
local weight = tonumber(ARGV[3] or '1')
local key = KEYS[1]
local longest = 0
local plan = {}

-- First pass: drop the blocks that left each window, and check.
for i, limit in ipairs(limits) do
  local window, max = limit[1], limit[2]
  local precision = math.min(limit[3] or window, window)
  local blocks = math.ceil(window / precision)
  longest = math.max(longest, window)
  local p = {}
  plan[i] = p
  p.block = math.floor(now / precision)
  p.first = p.block - blocks + 1
  p.total = window .. ':' .. precision .. ':'
  p.marker = p.total .. 'o'

  local oldest = redis.call('HGET', key, p.marker)
  oldest = oldest and tonumber(oldest) or p.first
  if oldest > now then
    return 1
  end
  local gone, dropped = 0, {}
  for b = oldest, math.min(p.first, oldest + blocks) - 1 do
    local field = p.total .. b
    local units = redis.call('HGET', key, field)
    if units then
      gone = gone + tonumber(units)
      dropped[#dropped + 1] = field
    end
  end
  local used
  if #dropped > 0 then
    redis.call('HDEL', key, unpack(dropped))
    used = redis.call('HINCRBY', key, p.total, -gone)
  else
    used = redis.call('HGET', key, p.total)
  end
  if tonumber(used or '0') + weight > max then
    return 1
  end
end

-- Second pass: every limit has room; charge them all.
for _, p in ipairs(plan) do
  redis.call('HSET', key, p.marker, p.first)
  redis.call('HINCRBY', key, p.total, weight)
  redis.call('HINCRBY', key, p.total .. p.block, weight)
end
redis.call('EXPIRE', key, longest)
return 0
