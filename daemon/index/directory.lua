#!lua name=kvloop_directory
--[[
kvloop's block directory on Redis (>= 7.0): every call that reads and changes the directory is one
function, so it is atomic, replicated and persisted with the data (unlike EVALSHA's script cache).

Keys of one model share the hash tag of `base` ("kvl:{<model tag>}:"), so one call touches one slot.
Per model:  base.."w:"..W       hash  one worker: epoch, seq, state, seen, spec, layout, counters, uv
                                      ('1' while unverified: a puller's READ from it failed its digest
                                      check since it registered; none of its runs is served)
            base.."alive:"..W   string its epoch while a stream is attached, PX = lease
            base.."workers"     set   worker ids
            base.."wr:"..W      hash  retention handle -> run key (the worker's runs: no SCAN to clear)
            base.."wns:"..W     set   namespaces the worker stored blocks in
            base.."exp"         zset  run key by deadline;  base.."age": run key by creation order
            base.."stats"       hash  entries, runs, events, evictions, expired;  base.."next": run ids
            base.."resync"      set   workers still to re-push their state after a store failover:
                                      while it is not empty, lookups of the model answer
                                      "directory_resyncing"
Per namespace P = base..<lora hex>..":":
            P.."ret"            hash  block hash -> run id, or "id,id,..." when runs share the block
            P.."sto"            hash  block hash -> worker ids ("\n"-separated) holding it in prefix cache
            P.."ws:"..W         set   the worker's stored block hashes
            P.."run:"..id       hash  w, h (handle), hl (hash length), n, g, dl (deadline), su,
                                      cl (claimant), tier, tt / tb (partly filled last block),
                                      p (namespace), k ('1': its keys and ids are in the two strings
                                      below; runs stored before had fields 'hs' and 'ids' instead)
            P.."run:"..id..":hs"  string  its blocks' keys, concatenated
            P.."run:"..id..":ids" string  its block ids (uint32 LE, group-major)
            P.."run:"..id..":dg"  string  its block digests (kvloop.common.block_digests' blob), when
                                          it has any: read only by a lookup that hands the run out,
                                          which answers it whole
            The two strings stay out of Lua, where every string costs ~1 ns per byte to make: a lookup
            compares a run's keys with the prompt's in Redis (BITOP) and takes only the matched ids
            (GETRANGE).
            P.."scratch:*"      strings  a lookup's own, deleted before it returns and never replicated
States: 1 active, 2 resyncing, 3 expired, 4 draining (kvloop.v1.LeaseState).

Sharded (a Redis Cluster, kvloop.daemon.index.redis_cluster_store): the registry keys above stay in
the model's slot, and every block key moves to one of the model's buckets B = "kvl:{<tag>.<n>.<s>}:"
(kvloop.daemon.index.cluster_layout: a chain's first block picks a column of buckets, a run's handle
or a stored block's hash the bucket in it; a lookup asks each bucket of the column). A bucket has
the per-model block keys above (wr:W, wns:W, exp, age, stats, next and the namespaces) and, in
place of the worker hash, B.."wc:"..W (the worker's counters there) and B.."bw" (workers with
stored blocks there). Runs carry their worker's epoch (field e). The model's
slot adds base.."wb:"..W (buckets the worker wrote to) and base.."wh:"..W (handle -> bucket).
Bucket calls never read the registry: the caller passes the workers its view holds not live.
--]]

local ACTIVE, RESYNCING, EXPIRED = '1', '2', '3'
local DEVICE = 1  -- kvloop.v1.BlockTier: a run stored without a tier (0) is a device run

local function tier_of(value)
  local tier = tonumber(value) or 0
  if tier == 0 then return DEVICE end
  return tier
end

local function split(value, sep)
  local out = {}
  if not value then return out end
  local start = 1
  while true do
    local i = string.find(value, sep, start, true)
    if not i then
      out[#out + 1] = string.sub(value, start)
      return out
    end
    out[#out + 1] = string.sub(value, start, i - 1)
    start = i + #sep
  end
end

-- Remove `member` from the separated list in hash field `field`; true when it was there.
local function discard(key, field, member, sep)
  local current = redis.call('HGET', key, field)
  if not current then return false end
  if current == member then
    redis.call('HDEL', key, field)
    return true
  end
  local items, kept, found = split(current, sep), {}, false
  for _, item in ipairs(items) do
    if item == member and not found then found = true else kept[#kept + 1] = item end
  end
  if not found then return false end
  redis.call('HSET', key, field, table.concat(kept, sep))
  return true
end

-- The n hashes of `hs` (each hl bytes) in chunks small enough for one redis.call's arguments.
local CHUNK = 2000
local function chunks(hs, hl)
  local n, out = #hs / hl, {}
  for first = 0, n - 1, CHUNK do
    local part = {}
    for j = first, math.min(n, first + CHUNK) - 1 do part[#part + 1] = string.sub(hs, j * hl + 1, (j + 1) * hl) end
    out[#out + 1] = part
  end
  return out
end

-- Add `member` (new to every list) to the separated lists of every hash in `hs` (one HMGET and one
-- HSET per chunk: a block is usually new, and per-block calls would dominate ingest). Returns the
-- entries added: a hash `hs` repeats (a misbehaving agent) is added once, as discard_all removes it
-- once, so the entry count cannot drift.
local function add_all(key, hs, hl, member, sep)
  local seen, added = {}, 0
  for _, part in ipairs(chunks(hs, hl)) do
    local current = redis.call('HMGET', key, unpack(part))
    local fresh = {}
    for j, h in ipairs(part) do
      if not seen[h] then
        seen[h] = true
        added = added + 1
        if current[j] then
          redis.call('HSET', key, h, current[j] .. sep .. member)
        else
          fresh[#fresh + 1] = h
          fresh[#fresh + 1] = member
        end
      end
    end
    if #fresh > 0 then redis.call('HSET', key, unpack(fresh)) end
  end
  return added
end

-- Remove `member` from the lists of every hash in `hs`; returns how many held it.
local function discard_all(key, hs, hl, member, sep)
  local removed = 0
  for _, part in ipairs(chunks(hs, hl)) do
    local current = redis.call('HMGET', key, unpack(part))
    local gone = {}
    for j, h in ipairs(part) do
      if current[j] == member then
        gone[#gone + 1] = h
      elseif current[j] and discard(key, h, member, sep) then
        removed = removed + 1
      end
    end
    if #gone > 0 then removed = removed + redis.call('HDEL', key, unpack(gone)) end
  end
  return removed
end

local function stat(base, field, by)
  if by ~= 0 then redis.call('HINCRBY', base .. 'stats', field, by) end
end

-- The block ids at positions [first, first + count) of each of a run's groups, group-major.
local function run_ids(runkey, n, groups, first, count)
  local parts = {}
  for g = 0, groups - 1 do
    local from = (g * n + first) * 4
    parts[g + 1] = redis.call('GETRANGE', runkey .. ':ids', from, from + count * 4 - 1)
  end
  if parts[1] == '' then  -- a run stored before its ids had a key of their own
    local ids = redis.call('HGET', runkey, 'ids') or ''
    for g = 0, groups - 1 do
      local from = (g * n + first) * 4
      parts[g + 1] = string.sub(ids, from + 1, from + count * 4)
    end
  end
  local ids = groups == 1 and parts[1] or table.concat(parts)
  if #ids ~= groups * count * 4 then return nil end  -- not all there: never hand out a partial run
  return ids
end

-- A run's keys, whichever layout it was stored in.
local function run_keys(runkey, field)
  return field or redis.call('GET', runkey .. ':hs')
end

-- A run stored with its keys in the run hash: moved to their own string, as a lookup compares them.
local function move_keys_apart(runkey)
  local hs = redis.call('HGET', runkey, 'hs')
  if hs then redis.call('SET', runkey .. ':hs', hs) end
  redis.call('HDEL', runkey, 'hs')
  redis.call('HSET', runkey, 'k', '1')
end

-- Whether a worker's blocks may be served now (active, heard from within the lease, its liveness
-- key unexpired), and its epoch: the one rule for lookup, find and stored_prefixes.
local function worker_live(base, w, now, lease_s)
  local f = redis.call('HMGET', base .. 'w:' .. w, 'state', 'seen', 'epoch', 'uv')
  local live = f[1] == ACTIVE and (now - tonumber(f[2])) <= lease_s and not f[4]
    and redis.call('EXISTS', base .. 'alive:' .. w) == 1
  return live, f[3]
end

-- Where a call's block keys live and how it judges a worker: `single` when they share the model's
-- slot with the registry, `bucket` for one bucket of a sharded store (liveness from the caller).
local function single_ctx(base, now, lease_s)
  return {base = base, sharded = false, workers = base .. 'workers',
    counters = function(w) return base .. 'w:' .. w end,
    live = function(w) return worker_live(base, w, now, lease_s) end}
end

local function bucket_ctx(base, dead)
  local out = {}
  for _, w in ipairs(split(dead ~= '' and dead or nil, '\n')) do out[w] = true end
  return {base = base, sharded = true, workers = base .. 'bw',
    counters = function(w) return base .. 'wc:' .. w end,
    live = function(w) return not out[w], nil end}
end

local function drop_run(ctx, runkey)
  local run = redis.call('HMGET', runkey, 'w', 'h', 'hs', 'hl', 'n', 'p')
  if not run[1] then return 0 end
  local w, handle, hl, n, p = run[1], run[2], tonumber(run[4]), tonumber(run[5]), run[6]
  local hs = run_keys(runkey, run[3]) or ''
  local rid = string.match(runkey, '(%d+)$')
  local base = ctx.base
  local removed = discard_all(p .. 'ret', hs, hl, rid, ',')
  if redis.call('HGET', base .. 'wr:' .. w, handle) == runkey then redis.call('HDEL', base .. 'wr:' .. w, handle) end
  redis.call('HINCRBY', ctx.counters(w), 'rblocks', -n)
  redis.call('ZREM', base .. 'exp', runkey)
  redis.call('ZREM', base .. 'age', runkey)
  redis.call('DEL', runkey, runkey .. ':hs', runkey .. ':ids', runkey .. ':dg')
  stat(base, 'entries', -removed)
  stat(base, 'runs', -1)
  return n
end

local function purge(ctx, w)
  local base, touched = ctx.base, 0
  local runs = redis.call('HVALS', base .. 'wr:' .. w)
  for _, runkey in ipairs(runs) do touched = touched + drop_run(ctx, runkey) end
  local removed = 0
  for _, p in ipairs(redis.call('SMEMBERS', base .. 'wns:' .. w)) do
    local ws, sto = p .. 'ws:' .. w, p .. 'sto'
    for _, h in ipairs(redis.call('SMEMBERS', ws)) do
      if discard(sto, h, w, '\n') then removed = removed + 1 end
    end
    redis.call('DEL', ws)
  end
  redis.call('DEL', base .. 'wns:' .. w, base .. 'wr:' .. w)
  if ctx.sharded then redis.call('SREM', ctx.workers, w) end
  if redis.call('EXISTS', ctx.counters(w)) == 1 then
    redis.call('HSET', ctx.counters(w), 'rblocks', 0, 'sblocks', 0)
  end
  stat(base, 'entries', -removed)
  return touched + removed
end

local function drop_worker(base, w, sharded)
  if not sharded then purge(single_ctx(base), w) end
  redis.call('DEL', base .. 'w:' .. w, base .. 'alive:' .. w)
  redis.call('SREM', base .. 'workers', w)
  redis.call('SREM', base .. 'resync', w)
  if sharded then  -- its buckets are the caller's to purge (wb stays: a purge that failed is redone)
    redis.call('DEL', base .. 'wh:' .. w)
    return redis.call('SMEMBERS', base .. 'wb:' .. w)
  end
  return {}
end

-- register(keys: worker) base, w, epoch, last_sequence, now, lease_s, lease_ms, spec, layout, sharded
-- Sharded ('1'), a reply 'ok' has a fourth element: the buckets the caller must purge of the worker.
local function register(keys, args)
  local base, w, epoch, last_sequence = args[1], args[2], args[3], tonumber(args[4])
  local now, lease_s, lease_ms, spec, layout = tonumber(args[5]), tonumber(args[6]), args[7], args[8], args[9]
  local sharded = args[10] == '1'
  local wkey, alive = keys[1], base .. 'alive:' .. w
  local function stale_buckets()
    if sharded then return redis.call('SMEMBERS', base .. 'wb:' .. w) end
    return {}
  end
  for _, other in ipairs(redis.call('SMEMBERS', base .. 'workers')) do
    if other ~= w then
      local theirs = redis.call('HMGET', base .. 'w:' .. other, 'layout')[1]
      if theirs and theirs ~= layout then return {'incompatible', other, theirs} end
      if theirs then break end
    end
  end
  local cur = redis.call('HMGET', wkey, 'epoch', 'seq', 'state', 'seen')
  if cur[1] then
    local idle = now - tonumber(cur[4])
    -- a live worker may be taken over only by its own agent (same epoch: a reconnect)
    if cur[1] ~= epoch and redis.call('EXISTS', alive) == 1 and idle <= lease_s then
      return {'busy', cur[1], tostring(idle)}
    end
    if cur[1] == epoch then
      redis.call('HSET', wkey, 'spec', spec, 'layout', layout, 'seen', args[5])
      redis.call('HDEL', wkey, 'uv')
      redis.call('SET', alive, epoch, 'PX', lease_ms)
      local seq = tonumber(cur[2])
      if last_sequence < seq then
        if not sharded then purge(single_ctx(base), w) end
        redis.call('HSET', wkey, 'state', RESYNCING)
        return {'ok', 0, 1, stale_buckets()}
      end
      local state = cur[3]
      if state ~= RESYNCING then redis.call('HSET', wkey, 'state', ACTIVE) end
      return {'ok', seq, state == RESYNCING and 1 or 0, {}}
    end
    drop_worker(base, w, sharded)
  end
  local state = last_sequence > 0 and RESYNCING or ACTIVE
  redis.call('HSET', wkey, 'epoch', epoch, 'seq', 0, 'state', state, 'seen', args[5], 'spec', spec,
    'layout', layout, 'resyncs', 0, 'events', 0, 'rblocks', 0, 'sblocks', 0)
  redis.call('SADD', base .. 'workers', w)
  redis.call('SET', alive, epoch, 'PX', lease_ms)
  return {'ok', 0, last_sequence > 0 and 1 or 0, stale_buckets()}
end

-- disconnect(keys: worker) base, w, epoch, now
local function disconnect(keys, args)
  if redis.call('HGET', keys[1], 'epoch') == args[3] then
    redis.call('DEL', args[1] .. 'alive:' .. args[2])
    redis.call('HSET', keys[1], 'seen', args[4])
  end
  return 1
end

-- heartbeat(keys: worker) base, w, now, lease_ms
local function heartbeat(keys, args)
  local cur = redis.call('HMGET', keys[1], 'epoch', 'state')
  if not cur[1] then return 0 end
  redis.call('HSET', keys[1], 'seen', args[3])
  if cur[2] == EXPIRED then redis.call('HSET', keys[1], 'state', ACTIVE) end
  redis.call('SET', args[1] .. 'alive:' .. args[2], cur[1], 'PX', args[4])
  return 1
end

-- snapshot(keys: worker) base, w, "begin"|"end", now, sequence, sharded. Sharded, "begin" answers
-- the buckets the caller must purge (the worker is resyncing, so none of them is served meanwhile).
local function snapshot(keys, args)
  if redis.call('EXISTS', keys[1]) == 0 then return 0 end
  if args[3] == 'begin' then
    redis.call('HSET', keys[1], 'state', RESYNCING, 'seen', args[4])
    redis.call('HINCRBY', keys[1], 'resyncs', 1)
    if args[6] == '1' then return redis.call('SMEMBERS', args[1] .. 'wb:' .. args[2]) end
    purge(single_ctx(args[1]), args[2])
  else
    redis.call('HSET', keys[1], 'seq', args[5], 'state', ACTIVE, 'seen', args[4])
    redis.call('SREM', args[1] .. 'resync', args[2])
  end
  return 1
end

local function evict(ctx, max_entries)
  local base = ctx.base
  local target = math.floor(max_entries * 0.95)
  local evicted = 0
  local entries = tonumber(redis.call('HGET', base .. 'stats', 'entries') or '0')
  while entries > target do
    local oldest = redis.call('ZRANGE', base .. 'age', 0, 0)[1]
    if not oldest then break end
    drop_run(ctx, oldest)
    evicted = evicted + 1
    entries = tonumber(redis.call('HGET', base .. 'stats', 'entries'))
  end
  if entries > target then
    for _, w in ipairs(redis.call('SMEMBERS', ctx.workers)) do
      for _, p in ipairs(redis.call('SMEMBERS', base .. 'wns:' .. w)) do
        while entries > target do
          local h = redis.call('SPOP', p .. 'ws:' .. w)
          if not h then break end
          if discard(p .. 'sto', h, w, '\n') then
            entries = entries - 1
            evicted = evicted + 1
            stat(base, 'entries', -1)
            redis.call('HINCRBY', ctx.counters(w), 'sblocks', -1)
          end
        end
      end
    end
  end
  stat(base, 'evictions', evicted)
end

-- Drop the worker's runs retained under a registration generation older than `rg`.
local function withdraw_older(ctx, w, rg)
  local touched = 0
  for _, old in ipairs(redis.call('HVALS', ctx.base .. 'wr:' .. w)) do
    if (tonumber(redis.call('HGET', old, 'rg')) or 0) < rg then touched = touched + drop_run(ctx, old) end
  end
  return touched
end

-- Apply the events args[i..] of worker w to ctx's keys, counting them on the worker's counters and
-- the stats. `generation` reads and raises the worker's registration generation (see below).
--   'R' p hl hashes ids groups handle expires_ms single_use tier tail_tokens tail_blocks generation digests
--   'S' p hl hashes | 'D' p hl hashes | 'L' handle | 'C' | 'G' generation (sharded: withdraw older runs)
local function apply_events(ctx, w, epoch, now, args, i, max_entries, generation)
  local base = ctx.base
  local touched, added, n_args = 0, 0, #args
  local retained_blocks, stored_blocks, runs = 0, 0, 0
  while i <= n_args do
    local kind = args[i]
    -- A run's registration generation (vLLM >= 0.33 counts KV-cache re-registrations, e.g. sleep and
    -- wake): one older than the worker's latest in this epoch names freed memory and is not indexed;
    -- a newer one withdraws the worker's older runs first.
    local rg = kind == 'R' and (tonumber(args[i + 12]) or 0) or 0
    local wrg = 0
    if kind == 'R' then wrg = generation(nil) end
    if kind == 'R' and rg < wrg then
      i = i + 14
    elseif kind == 'R' then
      local p, hl, hs, handle = args[i + 1], tonumber(args[i + 2]), args[i + 3], args[i + 6]
      local n = #hs / hl
      local wr = base .. 'wr:' .. w
      if rg > wrg then
        generation(rg)
        touched = touched + withdraw_older(ctx, w, rg)
      end
      local previous = redis.call('HGET', wr, handle)
      if previous then touched = touched + drop_run(ctx, previous) end
      local rid = tostring(redis.call('INCR', base .. 'next'))
      local runkey = p .. 'run:' .. rid
      added = added + add_all(p .. 'ret', hs, hl, rid, ',')
      local deadline = now + tonumber(args[i + 7]) / 1000
      redis.call('HSET', runkey, 'w', w, 'h', handle, 'hl', hl, 'n', n, 'k', '1', 'g', args[i + 5],
        'dl', deadline, 'su', args[i + 8], 'tier', args[i + 9], 'tt', args[i + 10], 'tb', args[i + 11], 'p', p,
        'rg', rg)
      if ctx.sharded then redis.call('HSET', runkey, 'e', epoch) end
      redis.call('SET', runkey .. ':hs', hs)
      redis.call('SET', runkey .. ':ids', args[i + 4])
      if args[i + 13] ~= '' then redis.call('SET', runkey .. ':dg', args[i + 13]) end
      redis.call('HSET', wr, handle, runkey)
      redis.call('ZADD', base .. 'exp', deadline, runkey)
      redis.call('ZADD', base .. 'age', tonumber(rid), runkey)
      retained_blocks = retained_blocks + n
      runs = runs + 1
      touched = touched + n
      i = i + 14
    elseif kind == 'S' or kind == 'D' then
      local p, hl, hs = args[i + 1], tonumber(args[i + 2]), args[i + 3]
      local ws, sto, n = p .. 'ws:' .. w, p .. 'sto', #hs / hl
      if kind == 'S' then
        redis.call('SADD', base .. 'wns:' .. w, p)
        if ctx.sharded then redis.call('SADD', ctx.workers, w) end
        for j = 0, n - 1 do
          local h = string.sub(hs, j * hl + 1, (j + 1) * hl)
          if redis.call('SADD', ws, h) == 1 then
            if redis.call('HSETNX', sto, h, w) == 0 then
              redis.call('HSET', sto, h, redis.call('HGET', sto, h) .. '\n' .. w)
            end
            added = added + 1
            stored_blocks = stored_blocks + 1
          end
        end
        touched = touched + n
      else
        local removed = 0
        for j = 0, n - 1 do
          local h = string.sub(hs, j * hl + 1, (j + 1) * hl)
          if redis.call('SREM', ws, h) == 1 and discard(sto, h, w, '\n') then removed = removed + 1 end
        end
        added = added - removed
        stored_blocks = stored_blocks - removed
        touched = touched + removed
      end
      i = i + 4
    elseif kind == 'L' then
      local runkey = redis.call('HGET', base .. 'wr:' .. w, args[i + 1])
      if runkey then touched = touched + drop_run(ctx, runkey) end
      i = i + 2
    elseif kind == 'C' then
      touched = touched + purge(ctx, w)
      retained_blocks, stored_blocks = 0, 0
      i = i + 1
    elseif kind == 'G' then
      touched = touched + withdraw_older(ctx, w, tonumber(args[i + 1]))
      i = i + 2
    else
      return redis.error_reply('kvloop: unknown event kind ' .. tostring(kind))
    end
  end
  local counters = ctx.counters(w)
  redis.call('HINCRBY', counters, 'events', touched)
  if retained_blocks ~= 0 then redis.call('HINCRBY', counters, 'rblocks', retained_blocks) end
  if stored_blocks ~= 0 then redis.call('HINCRBY', counters, 'sblocks', stored_blocks) end
  stat(base, 'entries', added)
  stat(base, 'runs', runs)
  stat(base, 'events', touched)
  if tonumber(redis.call('HGET', base .. 'stats', 'entries') or '0') > max_entries then
    evict(ctx, max_entries)
  end
  return touched
end

-- The (epoch, sequence) fence of a worker's batch: nil when it applies, else the reply refusing it.
local function fence(wkey, epoch, sequence)
  local cur = redis.call('HMGET', wkey, 'epoch', 'seq')
  if not cur[1] then return {'unknown_worker', 0, 0} end
  local last = tonumber(cur[2])
  if cur[1] ~= epoch then return {'stale_epoch', last, 0} end
  if sequence > 0 then
    if sequence <= last then return {'duplicate', last, 0} end
    if sequence ~= last + 1 then return {'gap', last, 0} end
  end
  return nil, last
end

-- The batch is heard from the worker: its sequence, and a liveness as good as a heartbeat's (an agent
-- streaming without pause sends no heartbeats: they fill idle gaps).
local function accepted(base, wkey, w, epoch, sequence, now, lease_ms)
  if sequence > 0 then redis.call('HSET', wkey, 'seq', sequence) end
  redis.call('HSET', wkey, 'seen', now)
  redis.call('SET', base .. 'alive:' .. w, epoch, 'PX', lease_ms)
end

-- apply(keys: worker) base, w, epoch, sequence, now, lease_ms, max_entries, then the events
local function apply(keys, args)
  local base, w, epoch, sequence, now = args[1], args[2], args[3], tonumber(args[4]), tonumber(args[5])
  local wkey = keys[1]
  local refused, last = fence(wkey, epoch, sequence)
  if refused then return refused end
  local function generation(raised)
    if raised then redis.call('HSET', wkey, 'rg:' .. epoch, raised) return raised end
    return tonumber(redis.call('HGET', wkey, 'rg:' .. epoch)) or 0
  end
  local touched = apply_events(single_ctx(base), w, epoch, now, args, 8, tonumber(args[7]), generation)
  if type(touched) == 'table' then return touched end  -- an error reply
  accepted(base, wkey, w, epoch, sequence, args[5], args[6])
  if sequence > 0 then last = sequence end
  return {'applied', last, touched}
end

-- fence(keys: worker) base, w, epoch, sequence, now, lease_ms, generation, then the batch's buckets,
-- '|', then its handle moves: 'R' handle bucket | 'L' handle. A sharded batch's first call, in the
-- model's slot: fences it and records where its runs go. Answers {status, last, generation, whether
-- the generation rose, the bucket each move must release from ('' for none), the worker's buckets}.
local function sharded_fence(keys, args)
  local base, w, epoch, sequence = args[1], args[2], args[3], tonumber(args[4])
  local wkey = keys[1]
  local refused, last = fence(wkey, epoch, sequence)
  if refused then return refused end
  local rg = tonumber(args[7]) or 0
  local wrg = tonumber(redis.call('HGET', wkey, 'rg:' .. epoch)) or 0
  local rose = rg > wrg
  if rose then redis.call('HSET', wkey, 'rg:' .. epoch, rg) wrg = rg end
  local i, wb, wh = 8, base .. 'wb:' .. w, base .. 'wh:' .. w
  while args[i] ~= '|' do
    redis.call('SADD', wb, args[i])
    i = i + 1
  end
  i = i + 1
  local releases = {}
  while i <= #args do
    local previous = redis.call('HGET', wh, args[i + 1])
    if args[i] == 'R' then
      releases[#releases + 1] = (previous and previous ~= args[i + 2]) and previous or ''
      redis.call('HSET', wh, args[i + 1], args[i + 2])
      i = i + 3
    else
      releases[#releases + 1] = previous or ''
      if previous then redis.call('HDEL', wh, args[i + 1]) end
      i = i + 2
    end
  end
  accepted(base, wkey, w, epoch, sequence, args[5], args[6])
  if sequence > 0 then last = sequence end
  return {'applied', last, wrg, rose and 1 or 0, releases, redis.call('SMEMBERS', wb)}
end

-- bucket_apply(keys: bucket stats) bucket, w, epoch, now, max_entries, generation, then the events of
-- one bucket. Answers the entries touched.
local function bucket_apply(keys, args)
  local wrg = tonumber(args[6]) or 0
  local function generation(raised) return raised or wrg end
  return apply_events(bucket_ctx(args[1], ''), args[2], args[3], tonumber(args[4]), args, 7,
    tonumber(args[5]), generation)
end

-- bucket_purge(keys: bucket stats) bucket, w: drop everything the worker holds in the bucket.
local function bucket_purge(keys, args)
  return purge(bucket_ctx(args[1], ''), args[2])
end

-- lookup(keys: P.."ret") base, p, hashes, hl, local_blocks, requester, now, floor, lease_s, claim,
--   excluded worker ids ("\n"-separated); sharded (kvl_bucket_lookup) base is the bucket's, and one
--   more argument names the workers the caller's view holds not live. A holder's epoch is then its
--   run's, for the caller to check against its view.
-- The runs holding block i of a prompt also hold blocks 0..i-1 (chained hashes, runs start at block
-- 0), so every run holding a block past the local prefix holds block `local_blocks`: the runs that
-- block's entry names are the candidates. Each one's match is the common prefix of its keys and the
-- prompt's: Redis XORs the two (BITOP) and finds the first bit set (BITPOS), in C and without a key
-- of the run entering Lua; a binary search over the block index took a call per probe.
local function lookup_in(ctx, keys, args)
  local base, p, hs, hl = ctx.base, args[2], args[3], tonumber(args[4])
  local local_blocks, requester, now = tonumber(args[5]), args[6], tonumber(args[7])
  local floor, lease_s, claim = tonumber(args[8]), tonumber(args[9]), args[10] == '1'
  local excluded = {}
  for _, w in ipairs(split(args[11] ~= '' and args[11] or nil, '\n')) do excluded[w] = true end
  local ret = keys[1]
  local n = #hs / hl
  if local_blocks >= n then return {'none', ''} end
  if not ctx.sharded and redis.call('SCARD', base .. 'resync') > 0 then
    return {'none', 'directory_resyncing'}
  end
  local runs, verdicts, live, epochs = {}, {}, {}, {}

  local function run(rid)
    local r = runs[rid]
    if r == nil then
      -- every field a lookup reads, in one call: most prompts have one candidate, and it is answered
      local f = redis.call('HMGET', p .. 'run:' .. rid, 'w', 'dl', 'cl', 'n', 'k', 'h', 'g', 'su', 'tt', 'tb',
        'tier', 'rg', 'e')
      r = {w = f[1], dl = tonumber(f[2]), cl = f[3], n = tonumber(f[4]), k = f[5], h = f[6], g = tonumber(f[7]),
        su = f[8], tt = f[9], tb = f[10], tier = tier_of(f[11]), rg = tonumber(f[12]) or 0, e = f[13]}
      runs[rid] = r
    end
    return r
  end
  local function live_worker(w)
    local v = live[w]
    if v == nil then
      v, epochs[w] = ctx.live(w)
      live[w] = v
    end
    return v
  end
  local function servable(rid, ignore_exclusion)
    local v = verdicts[rid]
    if v == nil or ignore_exclusion then
      local r = run(rid)
      v = r.w ~= nil and r.dl > floor and not r.cl and r.w ~= requester and live_worker(r.w)
      if not ignore_exclusion then
        v = v and not excluded[r.w]
        verdicts[rid] = v
      end
    end
    return v
  end
  local entry = redis.call('HGET', ret, string.sub(hs, local_blocks * hl + 1, (local_blocks + 1) * hl))
  if not entry then return {'none', ''} end
  local held, servable_runs = split(entry, ','), {}
  for _, rid in ipairs(held) do
    if servable(rid) then servable_runs[#servable_runs + 1] = rid end
  end
  if #servable_runs == 0 then
    for _, rid in ipairs(held) do if run(rid).cl then return {'none', 'claimed'} end end
    for _, rid in ipairs(held) do if run(rid).dl <= floor then return {'none', 'expired'} end end
    for _, rid in ipairs(held) do
      if excluded[run(rid).w] and servable(rid, true) then return {'none', 'incompatible_layout'} end
    end
    return {'none', 'peer_unavailable'}
  end
  for _, rid in ipairs(servable_runs) do
    if run(rid).k ~= '1' then move_keys_apart(p .. 'run:' .. rid) end
  end
  -- The prompt and the XOR are scratch keys of this call alone: not replicated, gone when it returns.
  local prompt, xor = p .. 'scratch:prompt', p .. 'scratch:xor'
  redis.set_repl(redis.REPL_NONE)
  redis.call('SET', prompt, hs)
  local matched, reach = 0, {}
  for _, rid in ipairs(servable_runs) do
    redis.call('BITOP', 'XOR', xor, prompt, p .. 'run:' .. rid .. ':hs')
    local first_difference = redis.call('BITPOS', xor, 1)
    local common = math.min(n, runs[rid].n)
    if first_difference >= 0 then common = math.min(common, math.floor(first_difference / (8 * hl))) end
    if common > local_blocks then
      reach[rid] = common
      if common > matched then matched = common end
    end
  end
  redis.call('DEL', prompt, xor)
  redis.set_repl(redis.REPL_ALL)
  -- The runs reaching furthest, device runs before host ones (a device READ is the cheaper), then
  -- longest-lived first; a run short of its ids (a maxmemory policy
  -- evicted them) is never handed out, and when no run at a reach has its ids the next shorter
  -- reach is tried (every run reaching further holds that prefix too).
  while matched > local_blocks do
    local candidates = {}
    for _, rid in ipairs(servable_runs) do
      if (reach[rid] or 0) >= matched then candidates[#candidates + 1] = rid end
    end
    table.sort(candidates, function(a, b)
      local ra, rb = runs[a], runs[b]
      if (ra.tier == DEVICE) ~= (rb.tier == DEVICE) then return ra.tier == DEVICE end
      return ra.dl > rb.dl
    end)
    local out = {'found', matched}
    for _, rid in ipairs(candidates) do
      if #out == 10 then break end  -- 8 holders
      local runkey, r = p .. 'run:' .. rid, runs[rid]
      local ids = run_ids(runkey, r.n, r.g, 0, matched)
      if ids then
        if #out == 2 and claim and r.su == '1' then redis.call('HSET', runkey, 'cl', requester) end
        local whole = matched == r.n
        out[#out + 1] = {r.w, r.e or epochs[r.w], r.h, math.max(0, math.floor((r.dl - now) * 1000)), ids, r.g, r.su,
          whole and r.tt or '', whole and r.tb or '', r.tier, r.rg, redis.call('GET', runkey .. ':dg') or ''}
      end
    end
    if #out > 2 then return out end
    local shorter = local_blocks
    for _, rid in ipairs(servable_runs) do
      local c = reach[rid]
      if c and c < matched and c > shorter then shorter = c end
    end
    matched = shorter
  end
  return {'none', ''}
end

local function lookup(keys, args)
  return lookup_in(single_ctx(args[1], tonumber(args[7]), tonumber(args[9])), keys, args)
end

local function bucket_lookup(keys, args)
  return lookup_in(bucket_ctx(args[1], args[12]), keys, args)
end

-- release(keys: P..something) base, p, holder, handle, requester
local function release(keys, args)
  local base, p, holder, handle, requester = args[1], args[2], args[3], args[4], args[5]
  local runkey = redis.call('HGET', base .. 'wr:' .. holder, handle)
  if not runkey or redis.call('HGET', runkey, 'p') ~= p then return 0 end
  if redis.call('HGET', runkey, 'cl') ~= requester then return 0 end
  redis.call('HDEL', runkey, 'cl')
  return 1
end

-- find(keys: P.."ret") base, p, hash, now, floor, lease_s
local function find_in(ctx, args)
  local p, h, floor = args[2], args[3], tonumber(args[5])
  local out = {}
  for _, rid in ipairs(split(redis.call('HGET', p .. 'ret', h), ',')) do
    local runkey = p .. 'run:' .. rid
    local f = redis.call('HMGET', runkey, 'w', 'h', 'hs', 'hl', 'n', 'g', 'dl', 'cl', 'tier')
    local hl, n, hs = tonumber(f[4]), tonumber(f[5]), run_keys(runkey, f[3]) or ''
    local position = 0
    for i = 0, n - 1 do
      if string.sub(hs, i * hl + 1, (i + 1) * hl) == h then position = i break end
    end
    local dl = tonumber(f[7])
    local servable = dl > floor and not f[8] and ctx.live(f[1])
    out[#out + 1] = {'retained', f[1], position, run_ids(runkey, n, tonumber(f[6]), position, 1) or '', f[2],
      math.max(0, math.floor((dl - tonumber(args[4])) * 1000)), servable and 1 or 0, tier_of(f[9])}
  end
  for _, w in ipairs(split(redis.call('HGET', p .. 'sto', h), '\n')) do
    out[#out + 1] = {'stored', w}
  end
  return out
end

local function find(keys, args)
  return find_in(single_ctx(args[1], tonumber(args[4]), tonumber(args[6])), args)
end

-- bucket_find: find's arguments, then the workers the caller's view holds not live
local function bucket_find(keys, args)
  return find_in(bucket_ctx(args[1], args[7]), args)
end

-- stored_prefixes(keys: P.."sto") base, hashes, hl, now, lease_s, then worker ids. How many leading
-- blocks each live worker holds in its prefix cache: one walk for all, ending when none holds the next.
-- The walk reads the prompt's blocks STORED_CHUNK at a time with one HMGET: a call per block (a long
-- prompt has hundreds) was most of a Route's time on Redis.
local STORED_CHUNK = 128
local function stored_prefixes_in(ctx, keys, args)
  local hs, hl = args[2], tonumber(args[3])
  local alive, out, count = {}, {}, 0
  for i = 6, #args do
    local w = args[i]
    if ctx.live(w) then
      alive[w] = '\n' .. w .. '\n'  -- as it appears in a block's "\n"-separated holders, bounded
      count = count + 1
    end
    out[i - 5] = 0
  end
  local n = #hs / hl
  local first = 0
  while count > 0 and first < n do
    local part = {}
    for j = first, math.min(n, first + STORED_CHUNK) - 1 do
      part[#part + 1] = string.sub(hs, j * hl + 1, (j + 1) * hl)
    end
    local entries = redis.call('HMGET', keys[1], unpack(part))
    for k = 1, #entries do
      local holders = entries[k] and ('\n' .. entries[k] .. '\n')
      for w, bounded in pairs(alive) do
        if not holders or not string.find(holders, bounded, 1, true) then
          alive[w] = nil
          count = count - 1
        end
      end
      if count == 0 then break end
      for i = 6, #args do
        if alive[args[i]] then out[i - 5] = first + k end
      end
    end
    first = first + #part
  end
  return out
end

local function stored_prefixes(keys, args)
  return stored_prefixes_in(single_ctx(args[1], tonumber(args[4]), tonumber(args[5])), keys, args)
end

-- bucket_stored_prefixes: stored_prefixes' arguments with base the bucket's; the caller names only
-- workers its view holds live
local function bucket_stored_prefixes(keys, args)
  return stored_prefixes_in(bucket_ctx(args[1], ''), keys, args)
end

-- Drop the runs of ctx whose lease ended by `now`; appends an 'expired' change for each.
local function expire_runs(ctx, now, changes)
  for _, runkey in ipairs(redis.call('ZRANGEBYSCORE', ctx.base .. 'exp', '-inf', now)) do
    local f = redis.call('HMGET', runkey, 'w', 'h')
    local blocks = drop_run(ctx, runkey)
    if f[1] then
      stat(ctx.base, 'expired', 1)
      changes[#changes + 1] = {'expired', f[1], blocks, 'retention ' .. f[2] .. ' lease ended'}
    end
  end
  return changes
end

-- Lapse the leases of silent workers and drop long-silent ones. Sharded, a 'dropped' change carries
-- a fifth element: the buckets the caller must purge of the worker.
local function reap_workers(base, now, lease_s, drop_after, sharded, changes)
  for _, w in ipairs(redis.call('SMEMBERS', base .. 'workers')) do
    local wkey = base .. 'w:' .. w
    local f = redis.call('HMGET', wkey, 'state', 'seen', 'rblocks', 'sblocks')
    local idle = now - tonumber(f[2])
    local state = f[1]
    if state == ACTIVE and idle > lease_s then
      state = EXPIRED
      redis.call('HSET', wkey, 'state', EXPIRED)
      changes[#changes + 1] = {'lease', w, 0, string.format('no message for %.1fs: blocks no longer served', idle)}
    end
    local connected = redis.call('EXISTS', base .. 'alive:' .. w) == 1
    -- an agent gone for a whole lease will not re-push soon: lookups stop waiting for it (its
    -- blocks stay unserved until it does)
    if not connected and idle > lease_s then redis.call('SREM', base .. 'resync', w) end
    if (not connected or state == EXPIRED) and idle > drop_after then
      local blocks = tonumber(f[3]) + tonumber(f[4])
      local buckets = drop_worker(base, w, sharded)
      changes[#changes + 1] = {'dropped', w, blocks, string.format('silent for %.1fs: entries dropped', idle),
        buckets}
    end
  end
  return changes
end

-- reap(keys: base.."exp") base, now, lease_s, drop_after_s
local function reap(keys, args)
  local base, now = args[1], tonumber(args[2])
  local changes = expire_runs(single_ctx(base), args[2], {})
  return reap_workers(base, now, tonumber(args[3]), tonumber(args[4]), false, changes)
end

-- reap_workers(keys: base.."workers") base, now, lease_s, drop_after_s: a sharded store's registry
local function sharded_reap_workers(keys, args)
  return reap_workers(args[1], tonumber(args[2]), tonumber(args[3]), tonumber(args[4]), true, {})
end

-- bucket_reap(keys: bucket stats) bucket, now
local function bucket_reap(keys, args)
  return expire_runs(bucket_ctx(args[1], ''), args[2], {})
end

-- set_state(keys: worker) state ("resyncing" marks, "draining" drains); 0 when no such worker
local function set_state(keys, args)
  if redis.call('EXISTS', keys[1]) == 0 then return 0 end
  redis.call('HSET', keys[1], 'state', args[1])
  return 1
end

-- set_unverified(keys: worker): none of the worker's runs is served until it registers again (its
-- lease state, which its agent's messages change, is left as it is); 0 when no such worker
local function set_unverified(keys, args)
  if redis.call('EXISTS', keys[1]) == 0 then return 0 end
  redis.call('HSET', keys[1], 'uv', '1')
  return 1
end

-- epoch(keys: epoch key) sentinel epoch, then every model's base. Records the epoch; when it grew
-- past the recorded one (a failover), marks every worker resyncing and returns the old epoch (0 when
-- none was recorded although workers are: that record itself may be what the failover lost); -1 when
-- nothing changed or the store is new.
local function epoch(keys, args)
  local now = tonumber(args[1])
  local recorded = redis.call('GET', keys[1])
  if recorded and tonumber(recorded) >= now then return -1 end
  redis.call('SET', keys[1], args[1])
  local marked = 0
  for i = 2, #args do
    for _, w in ipairs(redis.call('SMEMBERS', args[i] .. 'workers')) do
      redis.call('HSET', args[i] .. 'w:' .. w, 'state', RESYNCING)
      redis.call('SADD', args[i] .. 'resync', w)
      marked = marked + 1
    end
  end
  if not recorded and marked == 0 then return -1 end
  return tonumber(recorded or '0')
end

-- resync_all(keys: base.."workers") base: every worker of one model must re-push its state (a
-- sharded store's epoch moved: kvl_epoch recorded it, and each model's slot is marked apart)
local function resync_all(keys, args)
  for _, w in ipairs(redis.call('SMEMBERS', keys[1])) do
    redis.call('HSET', args[1] .. 'w:' .. w, 'state', RESYNCING)
    redis.call('SADD', args[1] .. 'resync', w)
  end
  return 1
end

-- view(keys: base.."workers") base: what a sharded store's lookups judge workers by, read in one call:
-- whether any worker is still to re-push its state, then each worker's id, epoch, state, last seen,
-- whether its liveness key is set and whether it is unverified (1 or 0).
local function view(keys, args)
  local base = args[1]
  local out = {redis.call('SCARD', base .. 'resync')}
  for _, w in ipairs(redis.call('SMEMBERS', keys[1])) do
    local f = redis.call('HMGET', base .. 'w:' .. w, 'epoch', 'state', 'seen', 'uv')
    if f[1] then
      out[#out + 1] = {w, f[1], f[2], f[3], redis.call('EXISTS', base .. 'alive:' .. w), f[4] and 1 or 0}
    end
  end
  return out
end

redis.register_function('kvl_epoch', epoch)
redis.register_function{function_name = 'kvl_view', callback = view, flags = {'no-writes'}}
redis.register_function('kvl_resync_all', resync_all)
redis.register_function('kvl_register', register)
redis.register_function('kvl_disconnect', disconnect)
redis.register_function('kvl_heartbeat', heartbeat)
redis.register_function('kvl_snapshot', snapshot)
redis.register_function('kvl_apply', apply)
redis.register_function{function_name = 'kvl_lookup', callback = lookup, flags = {}}
redis.register_function('kvl_release', release)
redis.register_function{function_name = 'kvl_find', callback = find, flags = {'no-writes'}}
redis.register_function('kvl_reap', reap)
redis.register_function{function_name = 'kvl_stored_prefixes', callback = stored_prefixes, flags = {'no-writes'}}
redis.register_function('kvl_set_state', set_state)
redis.register_function('kvl_set_unverified', set_unverified)
redis.register_function('kvl_fence', sharded_fence)
redis.register_function('kvl_reap_workers', sharded_reap_workers)
redis.register_function('kvl_bucket_apply', bucket_apply)
redis.register_function('kvl_bucket_purge', bucket_purge)
redis.register_function('kvl_bucket_reap', bucket_reap)
redis.register_function{function_name = 'kvl_bucket_lookup', callback = bucket_lookup, flags = {}}
redis.register_function{function_name = 'kvl_bucket_find', callback = bucket_find, flags = {'no-writes'}}
redis.register_function{function_name = 'kvl_bucket_stored_prefixes', callback = bucket_stored_prefixes,
  flags = {'no-writes'}}
