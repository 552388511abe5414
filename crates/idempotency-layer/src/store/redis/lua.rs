//! The store's Lua scripts: each operation is one script, atomic on the server, timed by the
//! server's own clock.

use std::sync::OnceLock;

use redis::Script;

// The time in Redis's own clock, in ms (instances with skewed clocks agree).
pub(super) const NOW: &str = r#"
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
"#;

/// Claims the key: free (absent, expired by Redis, a claim whose lease lapsed, or the tombstone
/// of a forgotten claim) -> in flight; else reports what holds it (a record: `{3, record,
/// ms left, acknowledged by the replicas (see [`ACKNOWLEDGED`]), the token that completed it}`). A claim that already holds
/// this call's own token `ARGV[1]` is this call's: the command ran once already and is being
/// resent (a cluster connection resends after a lost reply), so it answers "claimed" again
/// rather than "in flight" (which would make the request wait for itself). A claim's lease end is its
/// field `e` (ms); the key itself lives `ARGV[4]` ms longer, so that a leader whose lease lapsed
/// with no takeover can still complete (as with the other stores). Taking over the tombstone of
/// a released claim keeps the released token (field `p`), so that a resent release of it is
/// still answered "released".
pub(super) const CLAIM: &str = r#"
local k = KEYS[1]
local function claim(released)
  redis.call('DEL', k)
  redis.call('HSET', k, 's', 'i', 't', ARGV[1], 'f', ARGV[2], 'e', now + tonumber(ARGV[3]))
  if released then redis.call('HSET', k, 'p', released) end
  redis.call('PEXPIRE', k, tonumber(ARGV[3]) + tonumber(ARGV[4]))
  return {1}
end
local t = redis.call('TYPE', k)['ok']
if t == 'none' then return claim() end
if t ~= 'hash' then return {4, 'the key holds a ' .. t .. ', not an idempotency entry'} end
local v = redis.call('HMGET', k, 's', 't', 'f', 'r', 'e', 'a')
if v[1] == 'c' and v[4] then return {3, v[4], redis.call('PTTL', k), v[6] and 1 or 0, v[2]} end
if v[1] == 'i' and v[2] == ARGV[1] then return {1} end
if v[1] == 'i' and v[2] and v[3] then
  if v[5] and tonumber(v[5]) <= now then return claim() end
  return {2, v[2], v[3]}
end
if v[1] == 'x' then return claim() end
if v[1] == 'r' then return claim(v[2]) end
return {4, 'the entry has no valid state'}
"#;

/// Marks the record that the token `ARGV[1]` completed as acknowledged by the replicas that
/// [`wait_for_replicas`](super::RedisStoreBuilder::wait_for_replicas) asks for (field `a`): set
/// only after a `WAIT` covering the record answered enough, so a replay of a marked record
/// needs no `WAIT` of its own. Anything else at the key (another record, a claim) is left alone.
pub(super) const ACKNOWLEDGED: &str = r#"
local k = KEYS[1]
if redis.call('TYPE', k)['ok'] ~= 'hash' then return 0 end
local v = redis.call('HMGET', k, 's', 't')
if v[1] ~= 'c' or v[2] ~= ARGV[1] then return 0 end
redis.call('HSET', k, 'a', '1')
return 1
"#;

/// Replaces the claim `ARGV[1]` (even one whose lease lapsed, if nobody took it over) with the
/// record `ARGV[2]`, kept `ARGV[3]` ms; wakes the waiters. The record keeps the token that
/// completed it, so that the same complete resent (its reply was lost, a cluster connection
/// resent it) is answered "completed" again rather than "fenced". The resend writes that token
/// again (the same value): a write that replicates, so that the `WAIT` after it covers the
/// record on every Redis version (from 7.2 a connection's `WAIT` covers only that connection's
/// own last replicated write, and a resend may come on another connection than the first write).
pub(super) const COMPLETE: &str = r#"
local k = KEYS[1]
if redis.call('TYPE', k)['ok'] ~= 'hash' then return 0 end
local v = redis.call('HMGET', k, 's', 't')
if v[1] == 'c' and v[2] == ARGV[1] then
  redis.call('HSET', k, 't', ARGV[1])
  return 1
end
if v[1] ~= 'i' or v[2] ~= ARGV[1] then return 0 end
redis.call('DEL', k)
redis.call('HSET', k, 's', 'c', 'r', ARGV[2], 't', ARGV[1])
redis.call('PEXPIRE', k, ARGV[3])
redis.call(PUBLISH, k, 'c')
return 1
"#;

/// How long the tombstone of a released claim keeps its token (ms), for a resent release.
pub(super) const RELEASED_TOMBSTONE_MS: u64 = 60_000;

/// Removes the claim `ARGV[1]`; wakes the waiters. It leaves a tombstone (state `r`, the token)
/// for `ARGV[2]` ms at most, which a new claim takes over at once: the same release resent (its
/// reply was lost) is answered "released" again rather than "fenced", also once a new claim
/// took the key (it keeps the released token as `p`).
pub(super) const RELEASE: &str = r#"
local k = KEYS[1]
if redis.call('TYPE', k)['ok'] ~= 'hash' then return 0 end
local v = redis.call('HMGET', k, 's', 't', 'p')
if v[1] == 'i' and v[2] == ARGV[1] then
  local ttl = redis.call('PTTL', k)
  local keep = tonumber(ARGV[2])
  if ttl > 0 and ttl < keep then keep = ttl end
  redis.call('DEL', k)
  redis.call('HSET', k, 's', 'r', 't', ARGV[1])
  redis.call('PEXPIRE', k, keep)
  redis.call(PUBLISH, k, 'r')
  return 1
end
-- Resent: write the token again (the same value), a write that replicates.
if v[1] == 'r' and v[2] == ARGV[1] then
  redis.call('HSET', k, 't', ARGV[1])
  return 1
end
if v[3] == ARGV[1] then
  redis.call('HSET', k, 'p', ARGV[1])
  return 1
end
return 0
"#;

/// Extends the lease of the claim `ARGV[1]` to `ARGV[2]` ms from now.
pub(super) const RENEW: &str = r#"
local k = KEYS[1]
if redis.call('TYPE', k)['ok'] ~= 'hash' then return 0 end
local v = redis.call('HMGET', k, 's', 't')
if v[1] ~= 'i' or v[2] ~= ARGV[1] then return 0 end
redis.call('HSET', k, 'e', now + tonumber(ARGV[2]))
redis.call('PEXPIRE', k, tonumber(ARGV[2]) + tonumber(ARGV[3]))
return 1
"#;

/// [`RENEW`] for every key of KEYS in one call: `ARGV[1]` is how long a key outlives its lease
/// (ms), and claim i's token and lease (ms) are `ARGV[2i]` and `ARGV[2i + 1]`; answers 1 (renewed)
/// or 0 (no longer held) per key.
pub(super) const RENEW_MANY: &str = r#"
local grace = tonumber(ARGV[1])
local out = {}
for i, k in ipairs(KEYS) do
  local token, lease = ARGV[2 * i], tonumber(ARGV[2 * i + 1])
  out[i] = 0
  if redis.call('TYPE', k)['ok'] == 'hash' then
    local v = redis.call('HMGET', k, 's', 't')
    if v[1] == 'i' and v[2] == token then
      redis.call('HSET', k, 'e', now + lease)
      redis.call('PEXPIRE', k, lease + grace)
      out[i] = 1
    end
  end
end
return out
"#;

/// The most claims one `RENEW_MANY` call carries: the script blocks the server while it runs,
/// so a tick with more claims sends several (each well under a millisecond).
pub(super) const RENEW_CHUNK: usize = 512;

/// Removes whatever the key holds; wakes the waiters. A claim leaves a tombstone with its
/// token for as long as its key would have lived, so its leader's late complete is refused.
/// A record's removal is also published on the store's invalidation channel `ARGV[1]` (plain
/// `PUBLISH`: on a cluster it reaches every node), with the scope `ARGV[2]`, for the instances'
/// near caches.
pub(super) const FORGET: &str = r#"
local k = KEYS[1]
local t = redis.call('TYPE', k)['ok']
if t == 'none' then return 0 end
if t == 'hash' then
  local v = redis.call('HMGET', k, 's', 't')
  if v[1] == 'x' or v[1] == 'r' then return 0 end
  if v[1] == 'i' then
    local ttl = redis.call('PTTL', k)
    redis.call('DEL', k)
    redis.call('HSET', k, 's', 'x', 't', v[2])
    if ttl > 0 then redis.call('PEXPIRE', k, ttl) end
    redis.call(PUBLISH, k, 'f')
    return 1
  end
end
redis.call('DEL', k)
redis.call(PUBLISH, k, 'f')
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"#;

/// The lease left (ms) of the claim `ARGV[1]`, or -2 if it no longer holds (ended, taken over,
/// or its lease lapsed: the waiter then begins again and takes it over).
pub(super) const PEEK: &str = r#"
local k = KEYS[1]
if redis.call('TYPE', k)['ok'] ~= 'hash' then return -2 end
local v = redis.call('HMGET', k, 's', 't', 'e')
if v[1] ~= 'i' or v[2] ~= ARGV[1] then return -2 end
if not v[3] then return redis.call('PTTL', k) end
local left = tonumber(v[3]) - now
if left <= 0 then return -2 end
return left
"#;

/// What the key holds, claiming nothing: `{0}` nothing (absent, a tombstone, a claim whose
/// lease lapsed), `{2, token, fingerprint}` a claim in flight, `{3, record}` a record, `{4, why}`
/// not an entry of this store.
pub(super) const LOOKUP: &str = r#"
local k = KEYS[1]
local t = redis.call('TYPE', k)['ok']
if t == 'none' then return {0} end
if t ~= 'hash' then return {4, 'the key holds a ' .. t .. ', not an idempotency entry'} end
local v = redis.call('HMGET', k, 's', 't', 'f', 'r', 'e')
if v[1] == 'c' and v[4] then return {3, v[4]} end
if v[1] == 'i' and v[2] and v[3] and (not v[5] or tonumber(v[5]) > now) then
  return {2, v[2], v[3]}
end
return {0}
"#;

/// A script's source for the server: the clock prelude where it needs one, and `PUBLISH` or
/// the cluster's `SPUBLISH` (sharded pub/sub: the message stays on the key's shard).
pub(super) fn source(body: &str, publish: &str) -> String {
    let body = body.replace("redis.call(PUBLISH,", &format!("redis.call('{publish}',"));
    if body.contains("now") {
        format!("{NOW}{body}")
    } else {
        body
    }
}

/// A script: its source and the SHA1 `EVALSHA` names it by.
pub(super) struct Lua {
    pub(super) source: String,
    pub(super) script: Script,
}

impl Lua {
    pub(super) fn new(body: &str, publish: &str) -> Lua {
        let source = source(body, publish);
        Lua {
            script: Script::new(&source),
            source,
        }
    }
}

pub(super) struct Scripts {
    pub(super) claim: Lua,
    pub(super) complete: Lua,
    pub(super) release: Lua,
    pub(super) renew: Lua,
    pub(super) renew_many: Lua,
    pub(super) forget: Lua,
    pub(super) peek: Lua,
    pub(super) lookup: Lua,
    pub(super) acknowledged: Lua,
}

impl Scripts {
    pub(super) fn new(publish: &str) -> Scripts {
        Scripts {
            claim: Lua::new(CLAIM, publish),
            complete: Lua::new(COMPLETE, publish),
            release: Lua::new(RELEASE, publish),
            renew: Lua::new(RENEW, publish),
            renew_many: Lua::new(RENEW_MANY, publish),
            forget: Lua::new(FORGET, publish),
            peek: Lua::new(PEEK, publish),
            lookup: Lua::new(LOOKUP, publish),
            acknowledged: Lua::new(ACKNOWLEDGED, publish),
        }
    }
}

/// The scripts for a standalone server (`PUBLISH`) or a cluster (`SPUBLISH`: the message is
/// delivered on the shard that owns the key's slot, where the waiters `SSUBSCRIBE`d).
pub(super) fn scripts(cluster: bool) -> &'static Scripts {
    static STANDALONE: OnceLock<Scripts> = OnceLock::new();
    static CLUSTER: OnceLock<Scripts> = OnceLock::new();
    if cluster {
        CLUSTER.get_or_init(|| Scripts::new("SPUBLISH"))
    } else {
        STANDALONE.get_or_init(|| Scripts::new("PUBLISH"))
    }
}
