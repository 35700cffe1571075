-- redis_null.lua: a stand-in for lua/acquire.lua in bench/bench.py's
-- `sluice-redis-null` setup, not used by sluice.
--
-- It answers every call as acquire.lua answers an allowed one (see that file),
-- and reads and writes nothing: no TIME, no key. The bench runs a copy of the
-- measured sluice binary with this text in place of acquire.lua's, against
-- the same redis-server, so that the proxy's code, its Redis connection, the
-- EVALSHA it sends and the answer it parses are the same as `sluice-redis`'s,
-- and only what Redis spends a decision differs. The proxy's CPU a request
-- there is its own part of a Redis policy, whatever Redis costs on the
-- machine at hand.
--
-- ARGV[1]  acquire.lua's argument (25 bytes, then 34 bytes a counter)
-- Returns  '>Bd' allowed and now (a fixed time), then '>ddd' per counter:
--          remaining (a limit's worth), reset (a second on), mark (0)

local count = (#ARGV[1] - 25) / 34
local now = 1800000000000
local out = {1, now}
for i = 1, count do
  out[#out + 1] = 999999999
  out[#out + 1] = now + 1000
  out[#out + 1] = 0
end
return struct.pack('>Bd' .. string.rep('ddd', count), unpack(out))
