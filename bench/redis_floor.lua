-- redis_floor.lua: a cost floor for bench/redis_cost.py, not used by sluice.
--
-- What any script must do that keeps an identity's counters in one key, as
-- lua/acquire.lua does, with none of the counting: read the key, write a new
-- string of the same bytes back, and answer as acquire.lua answers. Run with
-- acquire.lua's arguments on strings of its size, it tells what part of a
-- decision's Redis CPU is Redis itself (the call, the GET, the SET, Lua making
-- the strings) on the machine at hand, and so what no script could go below.
--
-- KEYS[1]  the identity's string (made by redis_cost.py, of acquire.lua's size)
-- ARGV[1]  acquire.lua's argument (only `now` is read)
-- Returns acquire.lua's answer for three counters, allowed, all zeros.

local _, now = struct.unpack('>Bd', ARGV[1])
local raw = redis.call('GET', KEYS[1])
if raw then
  -- A new string (as acquire.lua writes one): one copy and a join.
  redis.call('SET', KEYS[1], raw:sub(1, 9) .. raw:sub(10), 'KEEPTTL')
end
return struct.pack('>Bdddddddddd', 1, now, 0, 0, 0, 0, 0, 0, 0, 0, 0)
