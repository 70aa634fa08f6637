/* Server-side Lua of the Redis metadata store (mstore_redis.c). Every script takes its
 * timestamps as arguments (never TIME), so replicas and Redis replication see the same
 * values, and every per-tick action is idempotent, so several masters may run it at once.
 * Key names are built by the master and passed in; the scripts only read and write them. */
#ifndef LMCACHE_MASTER_MSTORE_REDIS_LUA_H
#define LMCACHE_MASTER_MSTORE_REDIS_LUA_H

/* Helpers shared by the block scripts: a block hash keeps meta fields beside its
 * locations ("l|<node>|<tier>"); without a location it is deleted. */
#define RLUA_BLOCK_HELPERS                                                                         \
    "local function has_loc(bk)\n"                                                                 \
    "  local n = redis.call('HLEN', bk)\n"                                                         \
    "  if n == 0 then return false end\n"                                                          \
    "  for _, f in ipairs({'_created','_lacc','_acnt','_lease'}) do\n"                             \
    "    n = n - redis.call('HEXISTS', bk, f)\n"                                                   \
    "  end\n"                                                                                      \
    "  return n > 0\n"                                                                             \
    "end\n"                                                                                        \
    "local function has_node(bk, node)\n"                                                          \
    "  for t = 0, 3 do\n"                                                                          \
    "    if redis.call('HEXISTS', bk, 'l|' .. node .. '|' .. t) == 1 then return true end\n"       \
    "  end\n"                                                                                      \
    "  return false\n"                                                                             \
    "end\n"                                                                                        \
    "local function apply_events(node, now, full, base)\n"                                         \
    "  for i = base, #ARGV - 4, 5 do\n"                                                            \
    "    local bk, ns = ARGV[i+1], ARGV[i+2]\n"                                                    \
    "    local f = 'l|' .. node .. '|' .. ARGV[i+3]\n"                                             \
    "    if ARGV[i] == '1' then\n"                                                                 \
    "      if full ~= '1' and redis.call('HDEL', bk, f) == 1 then\n"                               \
    "        if not has_node(bk, node) then redis.call('SREM', ns, bk) end\n"                      \
    "        if not has_loc(bk) then redis.call('DEL', bk) end\n"                                  \
    "      end\n"                                                                                  \
    "    elseif full == '1' or redis.call('HEXISTS', bk, f) == 0 then\n"                           \
    "      if redis.call('EXISTS', bk) == 0 then\n"                                                \
    "        redis.call('HSET', bk, '_created', now, '_lacc', now, '_acnt', 0)\n"                  \
    "      end\n"                                                                                  \
    "      redis.call('HSET', bk, f, ARGV[i+4])\n"                                                 \
    "      redis.call('SADD', ns, bk)\n"                                                           \
    "    end\n"                                                                                    \
    "  end\n"                                                                                      \
    "end\n"

/* KEYS node, alive, peers, expired. ARGV id, now, stale_after, addr, peer, caps, engine,
 * tags. 1: ALIVE and fresh (nothing written); 0: (re)registered. */
#define RLUA_REGISTER                                                                              \
    "local st = redis.call('HGET', KEYS[1], 'status')\n"                                           \
    "if st == '1' then\n"                                                                          \
    "  local hb = tonumber(redis.call('HGET', KEYS[1], 'last_hb') or '0')\n"                       \
    "  if tonumber(ARGV[2]) - hb <= tonumber(ARGV[3]) then return 1 end\n"                         \
    "end\n"                                                                                        \
    "redis.call('DEL', KEYS[1])\n"                                                                 \
    "redis.call('HSET', KEYS[1], 'addr', ARGV[4], 'peer', ARGV[5], 'status', '1', 'last_hb',\n"    \
    "  ARGV[2], 'reg_at', ARGV[2], 'seq', '0', 'caps', ARGV[6], 'engine', ARGV[7], 'tags',\n"      \
    "  ARGV[8])\n"                                                                                 \
    "redis.call('SADD', KEYS[2], ARGV[1])\n"                                                       \
    "redis.call('HSET', KEYS[3], ARGV[1], ARGV[5])\n"                                              \
    "redis.call('SREM', KEYS[4], ARGV[1])\n"                                                       \
    "return 0\n"

/* The heartbeat CAS. KEYS node, alive, peers, expired. ARGV id, now, seq, seq-1 (both
 * decimal strings: sequences are 64-bit, Lua numbers are not), caps, full, then events
 * (kind, block key, node-set key, tier, size)... Returns {0 APPLIED | 1 SEQ_GAP |
 * 2 UNKNOWN, acked, revived (1: the record was EXPIRED, its placements wiped)}. A full sync
 * writes no events here: the caller wipes, then adds. */
#define RLUA_HEARTBEAT                                                                             \
    RLUA_BLOCK_HELPERS                                                                             \
    "local rec = redis.call('HMGET', KEYS[1], 'seq', 'peer', 'status')\n"                          \
    "if not rec[1] then return {2, '0', 0} end\n"                                                  \
    "local rv = 0\n"                                                                               \
    "if rec[3] == '2' then rv = 1 end\n"                                                           \
    "redis.call('HSET', KEYS[1], 'status', '1', 'last_hb', ARGV[2])\n"                             \
    "redis.call('SADD', KEYS[2], ARGV[1])\n"                                                       \
    "redis.call('HSET', KEYS[3], ARGV[1], rec[2] or '')\n"                                         \
    "redis.call('SREM', KEYS[4], ARGV[1])\n"                                                       \
    "if ARGV[6] ~= '1' and rec[1] ~= ARGV[4] then return {1, rec[1], rv} end\n"                    \
    "redis.call('HSET', KEYS[1], 'seq', ARGV[3], 'caps', ARGV[5])\n"                               \
    "if ARGV[6] ~= '1' then apply_events(ARGV[1], ARGV[2], '0', 7) end\n"                          \
    "return {0, ARGV[3], rv}\n"

/* A further chunk of events. KEYS[1] the shard's node-set key (routes the call in cluster
 * mode). ARGV node, now, full, events... */
#define RLUA_EVENTS RLUA_BLOCK_HELPERS "apply_events(ARGV[1], ARGV[2], ARGV[3], 4)\nreturn 0\n"

/* Pops up to ARGV[2] block keys of a node's reverse index and drops the node's locations
 * there. KEYS node-set; ARGV node, chunk. Returns how many were popped (0: done). */
#define RLUA_WIPE_BLOCKS                                                                           \
    RLUA_BLOCK_HELPERS                                                                             \
    "local ks = redis.call('SPOP', KEYS[1], tonumber(ARGV[2]))\n"                                  \
    "for _, bk in ipairs(ks) do\n"                                                                 \
    "  for t = 0, 3 do redis.call('HDEL', bk, 'l|' .. ARGV[1] .. '|' .. t) end\n"                  \
    "  if not has_loc(bk) then redis.call('DEL', bk) end\n"                                        \
    "end\n"                                                                                        \
    "return #ks\n"

#define RLUA_POPCOUNT                                                                              \
    "local function bits(m)\n"                                                                     \
    "  local c = 0\n"                                                                              \
    "  while m > 0 do c = c + m % 2; m = math.floor(m / 2) end\n"                                  \
    "  return c\n"                                                                                 \
    "end\n"

/* The same for a node's external-KV entries. KEYS node-set, count; ARGV node, chunk. */
#define RLUA_WIPE_EXTKV                                                                            \
    RLUA_POPCOUNT                                                                                  \
    "local ks = redis.call('SPOP', KEYS[1], tonumber(ARGV[2]))\n"                                  \
    "local gone = 0\n"                                                                             \
    "for _, k in ipairs(ks) do\n"                                                                  \
    "  local m = tonumber(redis.call('HGET', k, ARGV[1]) or '0')\n"                                \
    "  if m > 0 then gone = gone + bits(m); redis.call('HDEL', k, ARGV[1]) end\n"                  \
    "end\n"                                                                                        \
    "if gone > 0 then redis.call('DECRBY', KEYS[2], gone) end\n"                                   \
    "return #ks\n"

/* KEYS[1] the alive set (gate '1') or the shard's count key (routes the call in cluster
 * mode). ARGV node, bit (2^tier), gate, then (extkv key, node-set key, count key)...
 * 0: the node is not ALIVE, nothing written. */
#define RLUA_EXT_REPORT                                                                            \
    "if ARGV[3] == '1' and redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then return 0 end\n"     \
    "local b = tonumber(ARGV[2])\n"                                                                \
    "for i = 4, #ARGV - 2, 3 do\n"                                                                 \
    "  local m = tonumber(redis.call('HGET', ARGV[i], ARGV[1]) or '0')\n"                          \
    "  if math.floor(m / b) % 2 == 0 then\n"                                                       \
    "    redis.call('HSET', ARGV[i], ARGV[1], m + b)\n"                                            \
    "    redis.call('SADD', ARGV[i+1], ARGV[i])\n"                                                 \
    "    redis.call('INCR', ARGV[i+2])\n"                                                          \
    "  end\n"                                                                                      \
    "end\n"                                                                                        \
    "return 1\n"

#define RLUA_EXT_CLEAR_BIT                                                                         \
    "local function clear(k, node, b, ns, cnt)\n"                                                  \
    "  local m = tonumber(redis.call('HGET', k, node) or '0')\n"                                   \
    "  if math.floor(m / b) % 2 == 0 then return end\n"                                            \
    "  if m == b then\n"                                                                           \
    "    redis.call('HDEL', k, node)\n"                                                            \
    "    redis.call('SREM', ns, k)\n"                                                              \
    "  else\n"                                                                                     \
    "    redis.call('HSET', k, node, m - b)\n"                                                     \
    "  end\n"                                                                                      \
    "  redis.call('DECR', cnt)\n"                                                                  \
    "end\n"

/* KEYS[1] the shard's count key (routes the call). ARGV node, bit, then (extkv key,
 * node-set key, count key)... */
#define RLUA_EXT_REVOKE                                                                            \
    RLUA_EXT_CLEAR_BIT                                                                             \
    "local b = tonumber(ARGV[2])\n"                                                                \
    "for i = 3, #ARGV - 2, 3 do clear(ARGV[i], ARGV[1], b, ARGV[i+1], ARGV[i+2]) end\n"            \
    "return 0\n"

/* One SSCAN step over a node's entries of one shard, clearing one tier. KEYS node-set,
 * count; ARGV node, bit, cursor, chunk. Returns the next cursor ("0": done). */
#define RLUA_EXT_REVOKE_TIER                                                                       \
    RLUA_EXT_CLEAR_BIT                                                                             \
    "local r = redis.call('SSCAN', KEYS[1], ARGV[3], 'COUNT', ARGV[4])\n"                          \
    "local b = tonumber(ARGV[2])\n"                                                                \
    "for _, k in ipairs(r[2]) do clear(k, ARGV[1], b, KEYS[1], KEYS[2]) end\n"                     \
    "return r[1]\n"

/* The match of one shard, hit counting fused in. KEYS n extkv keys, then (count) n hit
 * keys and the shard's hit index. ARGV n, count, now, alive-peers key ("" in split modes:
 * not on this shard's instance; the caller reads it there). Returns
 * {{node, peer, ...}, "codes of key 1;codes of key 2;..."}: each node name once per reply
 * (its peer "" unless ALIVE), a key's placements as comma-separated
 * (node number - 1) * 16 + tier mask; one string, so the reply stays small to parse. */
#define RLUA_MATCH                                                                                 \
    "local n = tonumber(ARGV[1])\n"                                                                \
    "local cnt = ARGV[2] == '1'\n"                                                                 \
    "local now = tonumber(ARGV[3])\n"                                                              \
    "local nodes, num, parts = {}, {}, {}\n"                                                       \
    "for i = 1, n do\n"                                                                            \
    "  local h = redis.call('HGETALL', KEYS[i])\n"                                                 \
    "  local r = {}\n"                                                                             \
    "  for j = 1, #h, 2 do\n"                                                                      \
    "    local k = num[h[j]]\n"                                                                    \
    "    if not k then\n"                                                                          \
    "      k = #nodes / 2\n"                                                                       \
    "      num[h[j]] = k\n"                                                                        \
    "      nodes[#nodes + 1] = h[j]\n"                                                             \
    "      nodes[#nodes + 1] = ARGV[4] ~= '' and redis.call('HGET', ARGV[4], h[j]) or ''\n"        \
    "    end\n"                                                                                    \
    "    r[#r + 1] = k * 16 + tonumber(h[j + 1]) % 16\n"                                           \
    "  end\n"                                                                                      \
    "  parts[i] = table.concat(r, ',')\n"                                                          \
    "  if #h > 0 and cnt then\n"                                                                   \
    "    local hk = KEYS[n + i]\n"                                                                 \
    "    local c = redis.call('HINCRBY', hk, 'c', 1)\n"                                            \
    "    local ls = tonumber(redis.call('HGET', hk, 'ls') or '0')\n"                               \
    "    if now > ls then redis.call('HSET', hk, 'ls', ARGV[3]) end\n"                             \
    "    if c == 1 then redis.call('SADD', KEYS[2 * n + 1], hk) end\n"                             \
    "  end\n"                                                                                      \
    "end\n"                                                                                        \
    "return {nodes, table.concat(parts, ';')}\n"

/* One SSCAN step of the hit GC. KEYS hit index; ARGV cursor, cutoff, chunk.
 * Returns {next cursor, dropped}. */
#define RLUA_HIT_GC                                                                                \
    "local r = redis.call('SSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[3])\n"                          \
    "local cut, n = tonumber(ARGV[2]), 0\n"                                                        \
    "for _, hk in ipairs(r[2]) do\n"                                                               \
    "  local ls = redis.call('HGET', hk, 'ls')\n"                                                  \
    "  if not ls or tonumber(ls) < cut then\n"                                                     \
    "    redis.call('DEL', hk)\n"                                                                  \
    "    redis.call('SREM', KEYS[1], hk)\n"                                                        \
    "    n = n + 1\n"                                                                              \
    "  end\n"                                                                                      \
    "end\n"                                                                                        \
    "return {r[1], n}\n"

/* Block routing of one shard. KEYS block keys; ARGV now, lease_until (0: no lease),
 * n_excl, excluded nodes... Returns per key {node, tier, size, ...}. */
#define RLUA_ROUTE_GET                                                                             \
    "local ex = {}\n"                                                                              \
    "for i = 4, 3 + tonumber(ARGV[3]) do ex[ARGV[i]] = true end\n"                                 \
    "local lease = tonumber(ARGV[2])\n"                                                            \
    "local out = {}\n"                                                                             \
    "for i, k in ipairs(KEYS) do\n"                                                                \
    "  local h = redis.call('HGETALL', k)\n"                                                       \
    "  local r = {}\n"                                                                             \
    "  for j = 1, #h, 2 do\n"                                                                      \
    "    local f = h[j]\n"                                                                         \
    "    if string.sub(f, 1, 2) == 'l|' then\n"                                                    \
    "      local node = string.sub(f, 3, -3)\n"                                                    \
    "      if not ex[node] then\n"                                                                 \
    "        r[#r + 1] = node; r[#r + 1] = string.sub(f, -1); r[#r + 1] = h[j + 1]\n"              \
    "      end\n"                                                                                  \
    "    end\n"                                                                                    \
    "  end\n"                                                                                      \
    "  if #r > 0 and lease > 0 then\n"                                                             \
    "    redis.call('HSET', k, '_lease', ARGV[2], '_lacc', ARGV[1])\n"                             \
    "    redis.call('HINCRBY', k, '_acnt', 1)\n"                                                   \
    "  end\n"                                                                                      \
    "  out[i] = r\n"                                                                               \
    "end\n"                                                                                        \
    "return out\n"

/* KEYS block keys. Returns per key 1 (has a location) or 0. */
#define RLUA_EXISTS                                                                                \
    RLUA_BLOCK_HELPERS                                                                             \
    "local out = {}\n"                                                                             \
    "for i, k in ipairs(KEYS) do out[i] = has_loc(k) and 1 or 0 end\n"                             \
    "return out\n"

/* KEYS alive; ARGV node-key prefix. Returns {id, peer, caps, ...}. */
#define RLUA_LIST_ALIVE                                                                            \
    "local out = {}\n"                                                                             \
    "for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do\n"                                    \
    "  local r = redis.call('HMGET', ARGV[1] .. id, 'peer', 'caps')\n"                             \
    "  out[#out + 1] = id; out[#out + 1] = r[1] or ''; out[#out + 1] = r[2] or ''\n"               \
    "end\n"                                                                                        \
    "return out\n"

/* KEYS node, alive, peers, expired; ARGV id. 1 when a record existed (now deleted). */
#define RLUA_UNREGISTER                                                                            \
    "if redis.call('DEL', KEYS[1]) == 0 then return 0 end\n"                                       \
    "redis.call('SREM', KEYS[2], ARGV[1])\n"                                                       \
    "redis.call('HDEL', KEYS[3], ARGV[1])\n"                                                       \
    "redis.call('SREM', KEYS[4], ARGV[1])\n"                                                       \
    "return 1\n"

/* The reaper's control step. KEYS alive, peers, expired; ARGV node-key prefix, cutoff,
 * forget_before. Returns {expired ids, forgotten ids}; a second replica running it at the
 * same time finds nothing left to do. */
#define RLUA_EXPIRE                                                                                \
    "local cut, fb = tonumber(ARGV[2]), tonumber(ARGV[3])\n"                                       \
    "local ex, fg = {}, {}\n"                                                                      \
    "for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do\n"                                    \
    "  local nk = ARGV[1] .. id\n"                                                                 \
    "  local hb = redis.call('HGET', nk, 'last_hb')\n"                                             \
    "  if not hb then\n"                                                                           \
    "    redis.call('SREM', KEYS[1], id); redis.call('HDEL', KEYS[2], id)\n"                       \
    "  elseif tonumber(hb) < cut then\n"                                                           \
    "    redis.call('HSET', nk, 'status', '2')\n"                                                  \
    "    redis.call('HDEL', nk, 'engine')\n"                                                       \
    "    redis.call('SREM', KEYS[1], id); redis.call('HDEL', KEYS[2], id)\n"                       \
    "    redis.call('SADD', KEYS[3], id)\n"                                                        \
    "    ex[#ex + 1] = id\n"                                                                       \
    "  end\n"                                                                                      \
    "end\n"                                                                                        \
    "for _, id in ipairs(redis.call('SMEMBERS', KEYS[3])) do\n"                                    \
    "  local nk = ARGV[1] .. id\n"                                                                 \
    "  local r = redis.call('HMGET', nk, 'status', 'last_hb')\n"                                   \
    "  if r[1] ~= '2' then\n"                                                                      \
    "    redis.call('SREM', KEYS[3], id)\n"                                                        \
    "  elseif tonumber(r[2]) < fb then\n"                                                          \
    "    redis.call('DEL', nk); redis.call('SREM', KEYS[3], id)\n"                                 \
    "    fg[#fg + 1] = id\n"                                                                       \
    "  end\n"                                                                                      \
    "end\n"                                                                                        \
    "return {ex, fg}\n"

#endif
