-- batch.lua: several acquire.lua decisions in one call, each one whole and
-- atomic, one after another, in the order given.
--
-- Not loaded as written: src/store/redis.rs puts acquire.lua's text in place
-- of the `--@acquire.lua` line below, when sluice starts, so that this runs
-- whatever acquire.lua is. The proxy sends the decisions that queued for its
-- Redis connection while it was writing (src/store/pipe.rs; on a cluster,
-- those of one identity that queued behind one in flight): one call instead
-- of one each saves Redis the per-call work (reading and parsing the
-- command, setting up the script, the reply), reads TIME once, and reads and
-- writes a key that several of the call's decisions use once.
--
-- KEYS     every decision's keys (as for acquire.lua), one decision after the
--          other
-- ARGV[1]  a byte, 1 when a key is more than one decision's (else 0), then
--          one byte per decision: how many of KEYS are its own
-- ARGV[2+] each decision's argument (as for acquire.lua)
--
-- Returns an array: each decision's answer as acquire.lua gives it, or the
-- error it met (one decision's error is its own; the others are answered).
--
-- acquire.lua reaches Redis through `redis.call`; here that is a stand-in
-- that answers TIME once per call. When decisions share a key, it also
-- answers GET and SET from a table: a key is read once, and written once at
-- the end with the TTL its last write asked for (PX, else KEEPTTL). Nothing
-- else can see a key between two decisions (Redis runs a script alone), so
-- that is what each decision would have read and written on its own. Any
-- other command first writes what is held and forgets what was read, so it
-- sees and changes Redis as it is. (Keeping keys costs more than it saves
-- when none is shared: then GET and SET go to Redis.)

local rcall, rpcall = redis.call, redis.pcall
-- held[key]: the key's value as read or written (false: none); ttl[key]:
-- the PX of a write not made yet (false: KEEPTTL).
local time, held, ttl = nil, {}, {}

local function now()
  time = time or rcall('TIME')
  return time
end

local function flush()
  for key, px in pairs(ttl) do
    if px then
      rcall('SET', key, held[key], 'PX', px)
    else
      rcall('SET', key, held[key], 'KEEPTTL')
    end
  end
  ttl = {}
end

local function passed(f, ...)
  if next(ttl) then flush() end
  if next(held) then held = {} end
  return f(...)
end

local direct = setmetatable({
  call = function(cmd, ...)
    if cmd == 'TIME' and ... == nil then return now() end
    return rcall(cmd, ...)
  end,
}, {__index = redis})

local kept = setmetatable({
  call = function(cmd, ...)
    local key, value, opt, px, more = ...
    if cmd == 'GET' and value == nil then
      local v = held[key]
      if v == nil then
        v = rcall('GET', key)
        held[key] = v
      end
      return v
    elseif cmd == 'SET' and more == nil
        and ((opt == 'KEEPTTL' and px == nil) or (opt == 'PX' and px ~= nil)) then
      held[key] = value
      if px then
        ttl[key] = px
      elseif ttl[key] == nil then
        ttl[key] = false
      end
      return true
    elseif cmd == 'TIME' and key == nil then
      return now()
    end
    return passed(rcall, cmd, ...)
  end,
  pcall = function(...)
    return passed(rpcall, ...)
  end,
}, {__index = redis})

local shared = string.byte(ARGV[1]) == 1
local redis = shared and kept or direct

local function acquire(KEYS, ARGV)
--@acquire.lua
end

-- One KEYS and ARGV table for all decisions (a table costs more than the
-- rest of a small decision): acquire.lua only reads them.
local sizes, keys, argv, out, at, last = ARGV[1], {}, {}, {}, 0, 0
for d = 1, #sizes - 1 do
  local n = string.byte(sizes, d + 1)
  for j = 1, n do keys[j] = KEYS[at + j] end
  for j = n + 1, last do keys[j] = nil end
  at, last = at + n, n
  argv[1] = ARGV[d + 1]
  local ok, answer = pcall(acquire, keys, argv)
  if not ok and type(answer) ~= 'table' then answer = {err = tostring(answer)} end
  if answer == nil then answer = false end
  out[d] = answer
end
if next(ttl) then flush() end
return out
