-- plan.lua: one change of the plan assignments made at run time, kept and
-- announced together, so that no instance can see one without the other.
--
-- KEYS[1]  the hash of assignments: field "POLICY\0VALUE", value the plan
-- KEYS[2]  the stream of changes every instance reads (capped, oldest first
--          dropped: an instance that falls behind reloads the hash whole)
-- ARGV[1]  "set" (assign ARGV[3]), "del" (back to the file's or the
--          default plan) or "unban" (counters reset: drop local denials)
-- ARGV[2]  the field ("POLICY\0VALUE"; for "unban", "POLICY\0SPEC\0VALUE")
-- ARGV[3]  the plan ("set"), else empty
--
-- Returns the change's stream id.

if ARGV[1] == 'set' then
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
elseif ARGV[1] == 'del' then
  redis.call('HDEL', KEYS[1], ARGV[2])
end
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', '100000', '*',
  'op', ARGV[1], 'field', ARGV[2], 'plan', ARGV[3])
