#!lua name=cohort
--[[
cohort's fenced writes. Every write that only the leader may make goes through
one of these functions, which first check that the caller's token is still the
one in the leader key. Redis runs a function atomically, so a paused or
partitioned old leader is refused by Redis itself (invariant 4 of docs/design.md).

Keys always come in KEYS (never built here), so a job's hash tag keeps every
call in one Cluster slot. Bump VERSION whenever this file changes: Python
replaces a library whose cohort_version is older than its own.
]]

local VERSION = 2
local FIELD = 'e' -- events/codec.py FIELD: the one stream field holding an event

local function bad_args(fn, what)
  return redis.error_reply('ERR ' .. fn .. ': ' .. what)
end

-- A strictly positive or non-negative integer from an ARGV string, or nil.
local function to_int(s, min)
  local n = tonumber(s)
  if n == nil or n ~= math.floor(n) or n < min or n > 9007199254740991 then
    return nil
  end
  return n
end

-- Error reply naming who holds the lease instead, or nil if `token` does.
local function fence(leader_key, token)
  local current = redis.call('GET', leader_key)
  if current == token then
    return nil
  end
  return redis.error_reply('FENCED held by ' .. (current or 'none'))
end

local function version()
  return VERSION
end

-- KEYS[leader, epoch] ARGV[nonce, lease_ms] -> token "epoch:nonce", or nil if the lease is held.
local function acquire(keys, args)
  if #keys ~= 2 or #args ~= 2 then
    return bad_args('cohort_acquire', 'expects 2 keys (leader, epoch) and 2 args (nonce, lease_ms)')
  end
  local nonce = args[1]
  local lease_ms = to_int(args[2], 1)
  if nonce == '' then
    return bad_args('cohort_acquire', 'nonce is empty')
  end
  if lease_ms == nil then
    return bad_args('cohort_acquire', 'lease_ms ' .. args[2] .. ' is not a positive integer')
  end
  if redis.call('EXISTS', keys[1]) == 1 then
    return nil -- a nil reply on RESP2 and RESP3 alike (false would be a RESP3 boolean)
  end
  local epoch = redis.call('INCR', keys[2])
  local token = string.format('%d', epoch) .. ':' .. nonce
  redis.call('SET', keys[1], token, 'PX', lease_ms)
  return token
end

-- KEYS[leader] ARGV[token, lease_ms] -> 1 if still ours and extended, else 0.
local function renew(keys, args)
  if #keys ~= 1 or #args ~= 2 then
    return bad_args('cohort_renew', 'expects 1 key (leader) and 2 args (token, lease_ms)')
  end
  local lease_ms = to_int(args[2], 1)
  if lease_ms == nil then
    return bad_args('cohort_renew', 'lease_ms ' .. args[2] .. ' is not a positive integer')
  end
  if redis.call('GET', keys[1]) ~= args[1] then
    return 0
  end
  redis.call('PEXPIRE', keys[1], lease_ms)
  return 1
end

-- KEYS[leader] ARGV[token] -> 1 if it was ours and is now gone, else 0.
local function release(keys, args)
  if #keys ~= 1 or #args ~= 1 then
    return bad_args('cohort_release', 'expects 1 key (leader) and 1 arg (token)')
  end
  if redis.call('GET', keys[1]) ~= args[1] then
    return 0
  end
  redis.call('DEL', keys[1])
  return 1
end

-- KEYS[leader, journal, cursor, dead]
-- ARGV[token, expected_last_id, cursor_id, n_facts, dead_maxlen,
--      fact_1 .. fact_n, (inbox_id, reason, raw) * n_dead]
-- -> the new journal IDs, in order. Nothing is written unless every check passes.
local function append(keys, args)
  if #keys ~= 4 then
    return bad_args('cohort_append', 'expects 4 keys (leader, journal, cursor, dead), got ' .. #keys)
  end
  if #args < 5 then
    return bad_args('cohort_append', 'expects at least 5 args, got ' .. #args)
  end
  local token, expected, cursor_id = args[1], args[2], args[3]
  local n_facts = to_int(args[4], 0)
  local maxlen = to_int(args[5], 1)
  if n_facts == nil then
    return bad_args('cohort_append', 'n_facts ' .. args[4] .. ' is not a non-negative integer')
  end
  if maxlen == nil then
    return bad_args('cohort_append', 'dead_maxlen ' .. args[5] .. ' is not a positive integer')
  end
  local rest = #args - 5 - n_facts
  if rest < 0 or rest % 3 ~= 0 then
    return bad_args('cohort_append', 'after ' .. n_facts .. ' facts, ' .. rest
      .. ' args remain; dead letters come as (inbox_id, reason, raw) triples')
  end

  local fenced = fence(keys[1], token)
  if fenced then
    return fenced
  end
  local last = redis.call('XREVRANGE', keys[2], '+', '-', 'COUNT', 1)
  local actual = '0-0'
  if #last > 0 then
    actual = last[1][1]
  end
  if actual ~= expected then
    return redis.error_reply('CONFLICT last=' .. actual .. ' expected=' .. expected)
  end

  local ids = {}
  for i = 6, 5 + n_facts do
    ids[#ids + 1] = redis.call('XADD', keys[2], '*', FIELD, args[i])
  end
  if cursor_id ~= '' then
    redis.call('SET', keys[3], cursor_id)
  end
  for i = 6 + n_facts, #args, 3 do
    redis.call('XADD', keys[4], 'MAXLEN', '~', maxlen, '*',
      'inbox_id', args[i], 'reason', args[i + 1], 'raw', args[i + 2])
  end
  return ids
end

-- KEYS[leader, snapshot] ARGV[token, blob] -> 1, or a FENCED error.
local function snapshot(keys, args)
  if #keys ~= 2 or #args ~= 2 then
    return bad_args('cohort_snapshot', 'expects 2 keys (leader, snapshot) and 2 args (token, blob)')
  end
  local fenced = fence(keys[1], args[1])
  if fenced then
    return fenced
  end
  redis.call('SET', keys[2], args[2])
  return 1
end

redis.register_function{function_name = 'cohort_version', callback = version, flags = {'no-writes'}}
-- 'allow-oom': the lease and the journal keep working on a server that is over maxmemory
-- (noeviction refuses every other write): they are small, and without them nothing can
-- even say why training stopped. The snapshot, a cache that may be large, is refused.
redis.register_function{function_name = 'cohort_acquire', callback = acquire, flags = {'allow-oom'}}
redis.register_function{function_name = 'cohort_renew', callback = renew, flags = {'allow-oom'}}
redis.register_function{function_name = 'cohort_release', callback = release, flags = {'allow-oom'}}
redis.register_function{function_name = 'cohort_append', callback = append, flags = {'allow-oom'}}
redis.register_function('cohort_snapshot', snapshot)
