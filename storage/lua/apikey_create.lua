-- apikey_create: store a new API key under the hash of its secret.
-- Returns 1, or 0 (nothing written) if a key with this hash exists.
-- KEYS[1] = API key record (hash)
-- KEYS[2] = key id -> key hash (string)
-- KEYS[3] = every key id (set)
-- ARGV[1] = key id
-- ARGV[2] = key hash
-- ARGV[3] = name
-- ARGV[4] = admin: '1' or '0'
-- ARGV[5] = max queued jobs of the key ('' for the server's default)
-- ARGV[6] = max running jobs of the key ('' for the server's default)
local record_key, id_key, ids_key = KEYS[1], KEYS[2], KEYS[3]
local key_id, key_hash, name, admin = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local max_queued, max_running = ARGV[5], ARGV[6]

if redis.call('EXISTS', record_key) == 1 then return 0 end
redis.call('HSET', record_key, 'id', key_id, 'name', name, 'admin', admin,
  'created_at', (clock()), 'revoked', '0')
if max_queued ~= '' then redis.call('HSET', record_key, 'max_queued', max_queued) end
if max_running ~= '' then redis.call('HSET', record_key, 'max_running', max_running) end
redis.call('SET', id_key, key_hash)
redis.call('SADD', ids_key, key_id)
return 1
