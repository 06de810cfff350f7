-- apikey_revoke: mark a live key revoked. Returns 1 if it was live, 0 if unknown or revoked.
-- KEYS[1] = key id -> key hash (string)
-- ARGV[1] = API key record prefix: completed with the hash read from KEYS[1]
local id_key = KEYS[1]
local record_prefix = ARGV[1]

local key_hash = redis.call('GET', id_key)
if not key_hash then return 0 end
local record = record_prefix .. key_hash
if redis.call('HGET', record, 'revoked') ~= '0' then return 0 end
redis.call('HSET', record, 'revoked', '1')
return 1
