-- lease.lua: renew concurrency slots (see acquire.lua, algorithm 5) whose
-- requests are still running, so that only a slot whose instance has died
-- runs out.
--
-- KEYS     the slots' sorted sets
-- ARGV[1]  '>d': now in unix ms (negative: read Redis TIME)
-- ARGV[2.. #KEYS + 1]  '>dd' for each key: the slot (the mark its acquire
--          returned), and its lease in ms
--
-- A slot that has run out (and may have been taken by another request
-- since) is not made again. Returns the number of slots renewed.

local now = struct.unpack('>d', ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local renewed = 0
for i = 1, #KEYS do
  local mark, lease = struct.unpack('>dd', ARGV[i + 1])
  local member = string.format('%d', mark)
  local score = redis.call('ZSCORE', KEYS[i], member)
  if score and tonumber(score) > now then
    redis.call('ZADD', KEYS[i], now + lease, member)
    redis.call('PEXPIRE', KEYS[i], string.format('%d', lease + 1000))
    renewed = renewed + 1
  end
end
return renewed
