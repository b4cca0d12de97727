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

local VERSION = 4
local FIELD = 'e' -- events/codec.py FIELD: the one stream field holding an event
local LAST_ID = '18446744073709551615-18446744073709551615' -- the largest a stream allows
local MOVED_FIELDS = 64 -- names and values an entry moved by cohort_repair_inbox keeps
local DEAD_FIELDS = 7 -- coordinator/stores.py DeadLetter: the fields of one dead letter

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
--      fact_1 .. fact_n, (inbox_id, reason, kind, sender, size, sha256, head) * n_dead]
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
  if rest < 0 or rest % DEAD_FIELDS ~= 0 then
    return bad_args('cohort_append', 'after ' .. n_facts .. ' facts, ' .. rest
      .. ' args remain; dead letters come as (inbox_id, reason, kind, sender, size, sha256, '
      .. 'head) groups of ' .. DEAD_FIELDS)
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
  for i = 6 + n_facts, #args, DEAD_FIELDS do
    redis.call('XADD', keys[4], 'MAXLEN', '~', maxlen, '*',
      'inbox_id', args[i], 'reason', args[i + 1], 'kind', args[i + 2], 'sender', args[i + 3],
      'size', args[i + 4], 'sha256', args[i + 5], 'raw', args[i + 6])
  end
  return ids
end

-- Stream IDs compared as Redis orders them: 'ms-seq' parts may exceed a Lua number's
-- exact range (up to 2^64-1), so each part is compared by length, then as text.
local function id_cmp(a, b)
  local ams, aseq = string.match(a, '^(%d+)-(%d+)$')
  local bms, bseq = string.match(b, '^(%d+)-(%d+)$')
  local function part(x, y)
    x = string.gsub(x, '^0+(%d)', '%1')
    y = string.gsub(y, '^0+(%d)', '%1')
    if #x ~= #y then return #x < #y and -1 or 1 end
    if x == y then return 0 end
    return x < y and -1 or 1
  end
  local ms = part(ams, bms)
  if ms ~= 0 then return ms end
  return part(aseq, bseq)
end

-- XINFO STREAM's flat reply as a table of its scalar fields.
local function stream_info(key)
  local flat = redis.call('XINFO', 'STREAM', key)
  local info = {}
  for i = 1, #flat, 2 do
    info[flat[i]] = flat[i + 1]
  end
  return info
end

-- KEYS[leader, inbox, cursor] ARGV[token, cursor_id, limit_id]
-- -> {cursor, moved, dropped}: the inbox put back in order, only if `token` leads.
-- Entries with IDs after `limit_id` (the server's clock, plus a skew) are ahead: every
-- entry after the cursor is deleted and added again with an ID the server assigns (its
-- fields kept, plus 'o' = its old ID), in order; entries ahead at or before the cursor
-- (read before, so decided) are dropped; the stream's last ID goes back to its newest
-- entry left, which becomes the cursor. A stream recreated below the cursor (deleted,
-- then appended to) is read from its start. Unread entries deleted by someone else
-- (max-deleted-entry-id after the cursor) are acknowledged: the mark goes back to the
-- cursor, so the loss is reported once.
local function repair_inbox(keys, args)
  if #keys ~= 3 or #args ~= 3 then
    return bad_args('cohort_repair_inbox', 'expects 3 keys (leader, inbox, cursor) and 3 args '
      .. '(token, cursor_id, limit_id)')
  end
  local fenced = fence(keys[1], args[1])
  if fenced then
    return fenced
  end
  local cursor, limit = args[2], args[3]
  if redis.call('EXISTS', keys[2]) == 0 then
    return {cursor, 0, 0}
  end
  local info = stream_info(keys[2])
  local last = info['last-generated-id']
  if id_cmp(last, cursor) < 0 then
    cursor = '0-0'
  end
  local moved, dropped = {}, 0
  if id_cmp(last, limit) > 0 then
    if cursor == '0-0' then
      moved = redis.call('XRANGE', keys[2], '-', '+')
    elseif cursor ~= LAST_ID then -- nothing can follow the last ID a stream allows
      moved = redis.call('XRANGE', keys[2], '(' .. cursor, '+')
    end
    for _, entry in ipairs(moved) do
      redis.call('XDEL', keys[2], entry[1])
    end
    if id_cmp(cursor, limit) > 0 then
      local stale = redis.call('XRANGE', keys[2], '(' .. limit, cursor)
      for _, entry in ipairs(stale) do
        redis.call('XDEL', keys[2], entry[1])
      end
      dropped = #stale
    end
    local top = redis.call('XREVRANGE', keys[2], '+', '-', 'COUNT', 1)
    cursor = top[1] and top[1][1] or '0-1'
    last = cursor
  end
  local mark = info['max-deleted-entry-id'] or '0-0'
  if id_cmp(mark, cursor) > 0 or #moved > 0 or dropped > 0 then
    redis.call('XSETID', keys[2], last, 'MAXDELETEDID', cursor)
  end
  for _, entry in ipairs(moved) do
    local fields = entry[2]
    while #fields > MOVED_FIELDS do -- a hostile entry's thousands of fields stay behind
      table.remove(fields)
    end
    fields[#fields + 1] = 'o'
    fields[#fields + 1] = entry[1]
    redis.call('XADD', keys[2], '*', unpack(fields))
  end
  redis.call('SET', keys[3], cursor)
  return {cursor, #moved, dropped}
end

-- KEYS[inbox] ARGV[cursor] -> {last-generated-id, max-deleted-entry-id, first entry's ID,
-- 1 if the cursor's entry is there else 0}, or nil if there is no inbox. XINFO STREAM's
-- reply also carries the first and last entries, which a worker can make megabytes long:
-- only the marks leave the server.
local function inbox_marks(keys, args)
  if #keys ~= 1 or #args ~= 1 then
    return bad_args('cohort_inbox_marks', 'expects 1 key (inbox) and 1 arg (cursor)')
  end
  if redis.call('EXISTS', keys[1]) == 0 then
    return nil
  end
  local info = stream_info(keys[1])
  local first = redis.call('XRANGE', keys[1], '-', '+', 'COUNT', 1)
  local held = 0
  if args[1] ~= '0-0' and #redis.call('XRANGE', keys[1], args[1], args[1]) > 0 then
    held = 1
  end
  return {info['last-generated-id'], info['max-deleted-entry-id'] or '0-0',
    first[1] and first[1][1] or '0-0', held}
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

-- KEYS[leader, journal, archive] ARGV[token, keep_id, index]
-- -> entries trimmed, or a FENCED error. Drops the journal's entries before `keep_id`, which
-- must be in the journal (the last archived entry: it stays, so a reader that read up to it
-- finds it held), and sets the archive index that names where the dropped ones are.
local function trim_journal(keys, args)
  if #keys ~= 3 or #args ~= 3 then
    return bad_args('cohort_trim_journal',
      'expects 3 keys (leader, journal, archive) and 3 args (token, keep_id, index)')
  end
  local fenced = fence(keys[1], args[1])
  if fenced then
    return fenced
  end
  if #redis.call('XRANGE', keys[2], args[2], args[2], 'COUNT', 1) == 0 then
    return bad_args('cohort_trim_journal', 'entry ' .. args[2] .. ' is not in the journal')
  end
  redis.call('SET', keys[3], args[3])
  return redis.call('XTRIM', keys[2], 'MINID', args[2])
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
-- 'allow-oom': trimming is what frees the journal's memory.
redis.register_function{
  function_name = 'cohort_trim_journal', callback = trim_journal, flags = {'allow-oom'}
}
redis.register_function{
  function_name = 'cohort_inbox_marks', callback = inbox_marks, flags = {'no-writes'}
}
-- 'allow-oom': an inbox whose IDs ran ahead refuses every worker's XADD until repaired.
redis.register_function{
  function_name = 'cohort_repair_inbox', callback = repair_inbox, flags = {'allow-oom'}
}
