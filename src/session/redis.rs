//! The Redis [`SessionStore`]: sessions, checkpoints, breakers and learned windows shared by
//! every replica that points at the same server and `store.key_prefix`
//! (docs/architecture.md, *Sessions across replicas*).
//!
//! **Layout.** Every key of a tenant carries its 32-digit hash in braces,
//! `{prefix}:{<tenant>}:…`, so two tenants never share a key (and a tenant's keys share one
//! cluster slot). Per tenant: `cp:<chain hash>` (a checkpoint as JSON), `lens` (the prefix
//! lengths its checkpoints cover, scored by expiry, so a lookup probes only those), and per
//! session (`<sid>`, a hash of the session id) a hash `s:<sid>` (counters and the breaker),
//! a list `s:<sid>:cps` (its checkpoints, oldest first, at most
//! [`MAX_CHECKPOINTS_PER_SESSION`]) and `s:<sid>:req` (its latest request, without
//! credentials). Beside them: `sessions` (a sorted set by last use, for the admin list),
//! `ids:<sid>` (the tenant of the session id most recently used, for the admin lookups by id),
//! `checkpoints` (for the gauge), `windows` (learned context windows, a hash by
//! `"<upstream> <model>"`) and `lock:…` (claims). Everything expires after `store.ttl_secs`
//! without use; Redis's own memory policy bounds the rest.
//!
//! **Multi-step updates run as Lua scripts**, so two replicas updating one session (its
//! breaker, its checkpoint list) never interleave.
//!
//! **Credentials never reach Redis.** Each session's latest request is shared without them;
//! the replica that received it keeps the whole request in its own memory. A manual
//! compaction on another replica runs without the agent's credentials.
//!
//! **Fails open.** Every call is bounded by `store.redis_timeout_secs`. A failing or slow
//! Redis marks the link down for a short backoff (up to [`MAX_BACKOFF`]); meanwhile, and for
//! any failed call, the store answers from a [`MemoryStore`] of this replica's own (which
//! every write also goes to), so requests go on as with the memory backend, and
//! `compactor_store_errors_total{op}` counts each call that did not reach Redis. After the
//! backoff one call probes the link; the client reconnects on its own.
//!
//! **One summary per compaction across replicas.** [`SessionStore::claim_compaction`] takes a
//! lock (`SET NX PX`) with a token, renewed while its [`Lease`] lives and deleted (if still
//! ours) when it drops; a replica that dies leaves it to expire. Others poll it, bounded.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use compactor_plugin_api::{BoxFuture, Caller};
use redis::aio::ConnectionManager;
use redis::{AsyncCommands, Script};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::breaker::{BreakerState, SESSION_BREAKER_THRESHOLD};
use super::hash::{ChainHash, TenantId};
use super::memory::{MemoryStore, MAX_CHECKPOINTS_PER_SESSION};
use super::store::{
    unix_now, Checkpoint, Claim, LatestRequest, Lease, MaskNeed, ProviderAnswer, SessionCost,
    SessionInfo, SessionStore, Staged, StoreError, StoreHealth, StoreStats,
};
use super::windows::MAX_LEARNED_WINDOWS;
use crate::compaction::models::{LearnedWindow, WindowKey};
use crate::compaction::CompactionResult;
use crate::dialect::DialectKind;
use crate::metrics::{Metrics, StoreOp};

/// How long a compaction claim lives without renewal: a replica that dies mid-compaction
/// holds its prefix at most this long.
pub const CLAIM_TTL: Duration = Duration::from_secs(10);

/// How often a waiter looks whether another replica's claim is gone.
const CLAIM_POLL: Duration = Duration::from_millis(50);

/// The longest a failing link is left alone before one call probes it again.
pub const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The first backoff after a failure (doubling up to [`MAX_BACKOFF`]).
const MIN_BACKOFF: Duration = Duration::from_millis(100);

/// How stale this replica's copy of the learned windows may be (they are read on every
/// request, from memory; a refresh from Redis runs in the background).
const WINDOWS_REFRESH: Duration = Duration::from_secs(1);

/// How often one session's latest request is written at most: agents wait seconds for each
/// answer, so this writes nearly every request of a real conversation, while a client
/// hammering one session cannot keep Redis busy copying its bodies. The newest request always
/// follows (a trailing write).
const LATEST_WRITE_INTERVAL: Duration = Duration::from_secs(1);

/// Per session being written, the newer latest request (and its message count) waiting.
type LatestWrites = HashMap<(TenantId, String), Option<(LatestRequest, usize)>>;

/// Settings of a [`RedisStore`] besides its connection.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    /// Prefix of every key.
    pub key_prefix: String,
    /// Sessions (and their checkpoints) unused for this long expire.
    pub ttl: Duration,
    /// Bound on each call.
    pub timeout: Duration,
    /// Latest-request bodies larger than this stay in this replica only.
    pub max_shared_request_bytes: usize,
    /// How long a session's breaker stays open.
    pub breaker_cooldown: Duration,
    /// How long a compaction claim lives unrenewed ([`CLAIM_TTL`]; shorter in tests).
    pub claim_ttl: Duration,
}

/// The shared store. See the module docs.
pub struct RedisStore {
    shared: Arc<Shared>,
}

struct Shared {
    client: redis::Client,
    manager: redis::aio::ConnectionManagerConfig,
    /// The connections, made on first use (making one needs the runtime, which
    /// `compactor check-config` does not start): the request path's, and a second one for
    /// what is large and off the request path (latest requests of up to megabytes, written and
    /// read back; the admin listing), so lookups never queue behind them. `None` if they
    /// cannot be made.
    conns: OnceLock<Option<(ConnectionManager, ConnectionManager)>>,
    settings: RedisSettings,
    /// This replica's own memory: latest requests with credentials, and the answers while
    /// Redis is unreachable.
    local: MemoryStore,
    link: Link,
    metrics: Arc<Metrics>,
    scripts: Scripts,
    windows_refreshed: Mutex<Option<Instant>>,
    next_token: AtomicU64,
    /// Sessions whose latest request is being written, with the newer one to write next.
    latest_writes: Mutex<LatestWrites>,
}

impl RedisStore {
    /// A store on the Redis at `url`, answering from `local` whenever Redis does not. Connects
    /// lazily (on the first call; a server down at start is not an error) and reconnects on
    /// its own.
    pub fn new(
        url: &str,
        settings: RedisSettings,
        local: MemoryStore,
        metrics: Arc<Metrics>,
    ) -> Result<RedisStore, StoreError> {
        // The URL may hold a password: errors describe, never repeat it.
        let client = redis::Client::open(url)
            .map_err(|_| StoreError::Backend("invalid store.redis_url".into()))?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(settings.timeout))
            .set_response_timeout(Some(settings.timeout))
            .set_number_of_retries(1)
            .set_max_delay(MAX_BACKOFF);

        Ok(RedisStore {
            shared: Arc::new(Shared {
                client,
                manager: config,
                conns: OnceLock::new(),
                settings,
                local,
                link: Link::new(),
                metrics,
                scripts: Scripts::new(),
                windows_refreshed: Mutex::new(None),
                next_token: AtomicU64::new(0),
                latest_writes: Mutex::default(),
            }),
        })
    }
}

/// Whether Redis is worth calling now: after a failure, calls skip it for a backoff, then one
/// call probes.
struct Link {
    epoch: Instant,
    /// Milliseconds since `epoch` until which calls skip Redis; 0 when up.
    down_until: AtomicU64,
    failures: AtomicU32,
    probing: AtomicBool,
}

impl Link {
    fn new() -> Link {
        Link {
            epoch: Instant::now(),
            down_until: AtomicU64::new(0),
            failures: AtomicU32::new(0),
            probing: AtomicBool::new(false),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn is_up(&self) -> bool {
        self.down_until.load(Ordering::Acquire) == 0
    }

    /// Leave for this call to use Redis, `None` without (when down: the one probe after the
    /// backoff gets it).
    fn admits(&self) -> Option<Admission<'_>> {
        let until = self.down_until.load(Ordering::Acquire);
        if until == 0 {
            return Some(Admission { probe: None });
        }
        let probe = self.now_ms() >= until
            && self
                .probing
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
        probe.then_some(Admission {
            probe: Some(&self.probing),
        })
    }

    /// A call succeeded; true when the link was down.
    fn up(&self) -> bool {
        self.failures.store(0, Ordering::Release);
        self.probing.store(false, Ordering::Release);
        self.down_until.swap(0, Ordering::AcqRel) != 0
    }

    /// A call failed; true when the link was up.
    fn down(&self) -> bool {
        let failures = self.failures.fetch_add(1, Ordering::AcqRel).min(8);
        let backoff = MIN_BACKOFF.saturating_mul(1 << failures).min(MAX_BACKOFF);
        let until = self.now_ms() + u64::try_from(backoff.as_millis()).unwrap_or(1000);
        let was = self.down_until.swap(until.max(1), Ordering::AcqRel);
        self.probing.store(false, Ordering::Release);
        was == 0
    }
}

/// A call's leave to use Redis. The probe's is given back when dropped: a probe cancelled
/// mid-call (its request's client went away, its claim was released) reaches neither
/// [`Link::up`] nor [`Link::down`], and must not leave every later call waiting for a probe
/// that never ends.
struct Admission<'a> {
    probe: Option<&'a AtomicBool>,
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if let Some(probing) = self.probe {
            probing.store(false, Ordering::Release);
        }
    }
}

/// Whether a failed call's error is Redis answering about what it holds or was sent (a
/// script failing on a value of the wrong shape, a key of the wrong type, a reply that does
/// not decode, a write refused for memory) rather than Redis being unreachable. Such a call
/// fails alone: one tenant's bad key must not take Redis away from every tenant.
fn answered(error: &redis::RedisError) -> bool {
    matches!(
        error.kind(),
        redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError)
            | redis::ErrorKind::Extension
            | redis::ErrorKind::UnexpectedReturnType
    )
}

/// The Lua scripts (loaded by hash on first use, reloaded if Redis restarted).
struct Scripts {
    longest: Script,
    put: Script,
    touch: Script,
    allow: Script,
    record: Script,
    renew: Script,
    release: Script,
    floor: Script,
    open: Script,
    cost: Script,
}

impl Scripts {
    fn new() -> Scripts {
        Scripts {
            // KEYS: lens. ARGV: checkpoint key prefix, now (ms), ttl (ms), chain hashes for
            // lengths 1..n. A hit counts as use: it lives another ttl.
            longest: Script::new(
                r"
                redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
                local n = #ARGV - 3
                local lens = redis.call('ZRANGE', KEYS[1], 0, -1)
                local sorted = {}
                for _, l in ipairs(lens) do
                    local k = tonumber(l)
                    if k and k >= 1 and k <= n then table.insert(sorted, k) end
                end
                table.sort(sorted, function(a, b) return a > b end)
                for _, k in ipairs(sorted) do
                    local key = ARGV[1] .. ARGV[3 + k]
                    local v = redis.call('GET', key)
                    if v then
                        redis.call('PEXPIRE', key, ARGV[3])
                        redis.call('ZADD', KEYS[1], tonumber(ARGV[2]) + tonumber(ARGV[3]), k)
                        return v
                    end
                end
                return false",
            ),
            // KEYS: checkpoint, lens, session, session's checkpoint list, sessions index,
            // checkpoints index. ARGV: checkpoint JSON, covered, ttl (ms), now (ms), hash hex,
            // checkpoint key prefix, max checkpoints per session, session id, index member,
            // tenant hex, now (unix s), checkpoints-index member prefix.
            put: Script::new(
                r"
                local new = cjson.decode(ARGV[1])
                local promotion = false
                local old = redis.call('GET', KEYS[1])
                if old then
                    local o = cjson.decode(old)
                    promotion = o.staged and not new.staged and o.summary == new.summary
                end
                local ttl = tonumber(ARGV[3])
                local now = tonumber(ARGV[4])
                redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
                redis.call('ZADD', KEYS[2], now + ttl, ARGV[2])
                redis.call('PEXPIRE', KEYS[2], ttl)
                redis.call('HSETNX', KEYS[3], 'id', ARGV[8])
                redis.call('HSETNX', KEYS[3], 'tenant', ARGV[10])
                redis.call('HSETNX', KEYS[3], 'created', ARGV[11])
                redis.call('HSETNX', KEYS[3], 'last_seen', ARGV[11])
                if not promotion then redis.call('HINCRBY', KEYS[3], 'compactions', 1) end
                local seen = tonumber(redis.call('HGET', KEYS[3], 'messages_seen') or '0')
                if tonumber(ARGV[2]) > seen then
                    redis.call('HSET', KEYS[3], 'messages_seen', ARGV[2])
                end
                redis.call('HSET', KEYS[3], 'latest', ARGV[5])
                redis.call('PEXPIRE', KEYS[3], ttl)
                redis.call('LREM', KEYS[4], 0, ARGV[5])
                redis.call('RPUSH', KEYS[4], ARGV[5])
                while redis.call('LLEN', KEYS[4]) > tonumber(ARGV[7]) do
                    local oldest = redis.call('LPOP', KEYS[4])
                    redis.call('DEL', ARGV[6] .. oldest)
                    redis.call('ZREM', KEYS[6], ARGV[12] .. oldest)
                end
                redis.call('PEXPIRE', KEYS[4], ttl)
                redis.call('ZADD', KEYS[5], now, ARGV[9])
                redis.call('ZADD', KEYS[6], now + ttl, ARGV[12] .. ARGV[5])
                return 1",
            ),
            // KEYS: session, latest request, sessions index, id index, the session's
            // checkpoint list. ARGV: now (µs),
            // ttl (ms), session id, tenant hex, messages seen, index member, now (ms),
            // now (unix s), then (optional) dialect, body, upstream, api prefix.
            touch: Script::new(
                r"
                local ttl = tonumber(ARGV[2])
                local stamp = tonumber(redis.call('HGET', KEYS[1], 'stamp') or '0')
                local newer = tonumber(ARGV[1]) >= stamp
                redis.call('HSETNX', KEYS[1], 'id', ARGV[3])
                redis.call('HSETNX', KEYS[1], 'tenant', ARGV[4])
                redis.call('HSETNX', KEYS[1], 'created', ARGV[8])
                if newer then
                    redis.call('HSET', KEYS[1], 'stamp', ARGV[1], 'last_seen', ARGV[8],
                        'messages_seen', ARGV[5])
                    if #ARGV >= 12 then
                        redis.call('HSET', KEYS[2], 'dialect', ARGV[9], 'body', ARGV[10],
                            'upstream', ARGV[11], 'prefix', ARGV[12])
                    else
                        redis.call('DEL', KEYS[2])
                    end
                end
                redis.call('PEXPIRE', KEYS[1], ttl)
                redis.call('PEXPIRE', KEYS[2], ttl)
                redis.call('PEXPIRE', KEYS[5], ttl)
                redis.call('ZADD', KEYS[3], ARGV[7], ARGV[6])
                redis.call('SET', KEYS[4], ARGV[4], 'PX', ttl)
                return 1",
            ),
            // The per-session breaker (see `breaker.rs` for the state machine), on Redis's
            // clock so every replica agrees. KEYS: session. ARGV: cooldown (ms).
            allow: Script::new(
                r"
                if redis.call('EXISTS', KEYS[1]) == 0 then return 1 end
                local phase = redis.call('HGET', KEYS[1], 'phase')
                if not phase or phase == 'closed' then return 1 end
                local t = redis.call('TIME')
                local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
                local since = tonumber(redis.call('HGET', KEYS[1], 'since') or '0')
                if now - since >= tonumber(ARGV[1]) then
                    redis.call('HSET', KEYS[1], 'phase', 'trial', 'since', now)
                    return 1
                end
                return 0",
            ),
            // KEYS: session. ARGV: succeeded (1/0), threshold. Returns 1 when this failure
            // opened the breaker.
            record: Script::new(
                r"
                if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
                if ARGV[1] == '1' then
                    redis.call('HSET', KEYS[1], 'failures', 0, 'phase', 'closed')
                    return 0
                end
                local failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
                local phase = redis.call('HGET', KEYS[1], 'phase') or 'closed'
                local t = redis.call('TIME')
                local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
                if (phase == 'closed' and failures >= tonumber(ARGV[2])) or phase == 'trial' then
                    redis.call('HSET', KEYS[1], 'phase', 'open', 'since', now)
                    return 1
                end
                return 0",
            ),
            // KEYS: lock. ARGV: token, ttl (ms).
            renew: Script::new(
                r"
                if redis.call('GET', KEYS[1]) == ARGV[1] then
                    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
                end
                return 0",
            ),
            // `MaskFloor::raise` on the session's floor. KEYS: floor. ARGV: covered, enough,
            // step, ttl (ms). Returns how many to mask.
            floor: Script::new(
                r"
                local covered = tonumber(ARGV[1])
                local enough = tonumber(ARGV[2])
                local stored = redis.call('HMGET', KEYS[1], 'covered', 'masked')
                local c = tonumber(stored[1] or '-1')
                local m = tonumber(stored[2] or '0')
                if covered < c then return enough end
                if covered > c then m = 0 end
                local step = tonumber(ARGV[3])
                if m < enough and step >= enough then m = step end
                redis.call('HSET', KEYS[1], 'covered', covered, 'masked', m)
                redis.call('PEXPIRE', KEYS[1], ARGV[4])
                return m",
            ),
            // A session's spend, added to its hash if it is held. KEYS: session. ARGV: USD
            // billed, USD without compactor, requests over the window without it, input
            // tokens billed, of them read from the cache, USD its summaries cost.
            cost: Script::new(
                r"
                if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
                redis.call('HINCRBYFLOAT', KEYS[1], 'cost', ARGV[1])
                redis.call('HINCRBYFLOAT', KEYS[1], 'cost_without', ARGV[2])
                redis.call('HINCRBY', KEYS[1], 'over_window', ARGV[3])
                redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[4])
                redis.call('HINCRBY', KEYS[1], 'cache_read_tokens', ARGV[5])
                redis.call('HINCRBYFLOAT', KEYS[1], 'cost_summarizer', ARGV[6])
                return 1",
            ),
            // KEYS: lock. ARGV: token.
            release: Script::new(
                r"
                if redis.call('GET', KEYS[1]) == ARGV[1] then
                    return redis.call('DEL', KEYS[1])
                end
                return 0",
            ),
            // KEYS: the opening's claim. ARGV: candidate, ttl (ms). The owner: the one stored,
            // else the candidate, stored now (what `SET NX GET` does from Redis 7 on; a script
            // works on 6 too, like the others).
            open: Script::new(
                r"
                local owner = redis.call('GET', KEYS[1])
                if owner then return owner end
                redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
                return ARGV[1]",
            ),
        }
    }
}

/// Connections.
impl Shared {
    fn conns(&self) -> Option<&(ConnectionManager, ConnectionManager)> {
        self.conns
            .get_or_init(|| {
                let connect = || {
                    ConnectionManager::new_lazy_with_config(self.client.clone(), self.manager.clone())
                };
                match (connect(), connect()) {
                    (Ok(conn), Ok(bulk)) => Some((conn, bulk)),
                    (Err(e), _) | (_, Err(e)) => {
                        tracing::error!(error = %e, "cannot set up the Redis client; sessions stay in memory");
                        None
                    }
                }
            })
            .as_ref()
    }

    /// The request path's connection.
    fn conn(&self) -> Option<ConnectionManager> {
        self.conns().map(|(conn, _)| conn.clone())
    }

    /// The connection for what may be large and is never on a request's path: latest
    /// requests written and read back, the admin listing.
    fn bulk(&self) -> Option<ConnectionManager> {
        self.conns().map(|(_, bulk)| bulk.clone())
    }
}

/// Key names.
impl Shared {
    fn tenant_key(&self, tenant: TenantId, rest: &str) -> String {
        format!(
            "{}:{{{}}}:{rest}",
            self.settings.key_prefix,
            tenant.to_hex()
        )
    }

    fn global_key(&self, rest: &str) -> String {
        format!("{}:{rest}", self.settings.key_prefix)
    }

    fn ttl_ms(&self) -> u64 {
        u64::try_from(self.settings.ttl.as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }
}

/// A session id as a key part: fixed length whatever the client sent.
fn sid(id: &str) -> String {
    let digest = Sha256::digest(id.as_bytes());
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

fn tenant_from_hex(hex: &str) -> Option<TenantId> {
    if hex.len() != 32 {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, byte) in id.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(TenantId(id))
}

/// The operations, each made of bounded calls (a command, a pipeline or a script). Those
/// that read answer `None` when Redis did not answer (the caller then uses this replica's
/// memory); writes that fail are counted and dropped.
impl Shared {
    /// Runs one Redis call, bounded; `None` when it did not reach Redis (link down, error,
    /// timeout), counted under `op`.
    async fn call<T, F>(&self, op: StoreOp, call: F) -> Option<T>
    where
        F: Future<Output = redis::RedisResult<T>>,
    {
        let Some(_admission) = self.link.admits() else {
            self.metrics.store_error(op);
            return None;
        };
        let failure = match tokio::time::timeout(self.settings.timeout, call).await {
            Ok(Ok(value)) => {
                if self.link.up() {
                    tracing::info!("session store reachable again; sharing resumed");
                }
                return Some(value);
            }
            Ok(Err(e)) if answered(&e) => {
                // Redis answered: the link is up, only this call failed.
                if self.link.up() {
                    tracing::info!("session store reachable again; sharing resumed");
                }
                self.metrics.store_error(op);
                tracing::warn!(op = op.label(), error = %e, "session store refused the call");
                return None;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_string(),
        };
        self.metrics.store_error(op);
        if self.link.down() {
            tracing::warn!(
                op = op.label(),
                error = %failure,
                "session store unreachable; continuing with this replica's memory"
            );
        }
        None
    }

    /// A value read back from Redis that does not decode counts as a failed call.
    fn bad_data(&self, op: StoreOp, what: &str) {
        self.metrics.store_error(op);
        tracing::warn!(
            op = op.label(),
            what,
            "session store returned undecodable data"
        );
    }

    async fn longest(&self, tenant: TenantId, hashes: &[ChainHash]) -> Option<Arc<Checkpoint>> {
        if hashes.is_empty() {
            return None;
        }
        let mut invocation = self.scripts.longest.key(self.tenant_key(tenant, "lens"));
        invocation
            .arg(self.tenant_key(tenant, "cp:"))
            .arg(unix_ms())
            .arg(self.ttl_ms());
        for hash in hashes {
            invocation.arg(hash.to_hex());
        }
        let mut conn = self.conn()?;
        let found: Option<Vec<u8>> = self
            .call(StoreOp::Lookup, invocation.invoke_async(&mut conn))
            .await?;
        let json = found?;
        match serde_json::from_slice::<WireCheckpoint>(&json) {
            Ok(wire) => Some(Arc::new(wire.into_checkpoint())),
            Err(_) => {
                self.bad_data(StoreOp::Lookup, "checkpoint");
                None
            }
        }
    }

    async fn put(&self, tenant: TenantId, hash: ChainHash, checkpoint: &Checkpoint) -> Option<()> {
        let json = serde_json::to_string(&WireCheckpoint::from(checkpoint)).ok()?;
        let hex = hash.to_hex();
        let session = sid(&checkpoint.session_id);
        let tenant_hex = tenant.to_hex();
        let mut invocation = self
            .scripts
            .put
            .key(self.tenant_key(tenant, &format!("cp:{hex}")));
        invocation
            .key(self.tenant_key(tenant, "lens"))
            .key(self.tenant_key(tenant, &format!("s:{session}")))
            .key(self.tenant_key(tenant, &format!("s:{session}:cps")))
            .key(self.global_key("sessions"))
            .key(self.global_key("checkpoints"))
            .arg(json)
            .arg(checkpoint.covered)
            .arg(self.ttl_ms())
            .arg(unix_ms())
            .arg(&hex)
            .arg(self.tenant_key(tenant, "cp:"))
            .arg(MAX_CHECKPOINTS_PER_SESSION)
            .arg(&checkpoint.session_id)
            .arg(format!("{tenant_hex}:{session}"))
            .arg(&tenant_hex)
            .arg(unix_now())
            .arg(format!("{tenant_hex}:"));
        let mut conn = self.conn()?;
        let _: i64 = self
            .call(StoreOp::Put, invocation.invoke_async(&mut conn))
            .await?;
        Some(())
    }

    async fn touch(&self, tenant: TenantId, id: &str, latest: &LatestRequest, seen: usize) {
        let session = sid(id);
        let tenant_hex = tenant.to_hex();
        let mut invocation = self
            .scripts
            .touch
            .key(self.tenant_key(tenant, &format!("s:{session}")));
        invocation
            .key(self.tenant_key(tenant, &format!("s:{session}:req")))
            .key(self.global_key("sessions"))
            .key(self.global_key(&format!("ids:{session}")))
            .key(self.tenant_key(tenant, &format!("s:{session}:cps")))
            .arg(unix_us())
            .arg(self.ttl_ms())
            .arg(id)
            .arg(&tenant_hex)
            .arg(seen)
            .arg(format!("{tenant_hex}:{session}"))
            .arg(unix_ms())
            .arg(unix_now());
        if latest.body.len() <= self.settings.max_shared_request_bytes {
            invocation
                .arg(latest.dialect.label())
                .arg(latest.body.as_ref())
                .arg(&latest.caller.upstream_base_url)
                .arg(&latest.caller.api_prefix);
        }
        let Some(mut conn) = self.bulk() else {
            return;
        };
        let _: Option<i64> = self
            .call(StoreOp::Touch, invocation.invoke_async(&mut conn))
            .await;
    }

    /// Writes a session's latest request in the background: at once when none is being
    /// written, else once the current writer's [`LATEST_WRITE_INTERVAL`] has passed (only the
    /// newest waiting request is written).
    fn share_latest(
        self: &Arc<Self>,
        tenant: TenantId,
        id: &str,
        latest: LatestRequest,
        seen: usize,
    ) {
        let key = (tenant, id.to_string());
        match self.latest_writes().entry(key.clone()) {
            Entry::Occupied(mut waiting) => {
                *waiting.get_mut() = Some((latest, seen));
                return;
            }
            Entry::Vacant(slot) => {
                slot.insert(None);
            }
        }
        let shared = self.clone();
        tokio::spawn(async move {
            let (mut latest, mut seen) = (latest, seen);
            loop {
                shared.touch(key.0, &key.1, &latest, seen).await;
                tokio::time::sleep(LATEST_WRITE_INTERVAL).await;
                let mut writes = shared.latest_writes();
                match writes.get_mut(&key).and_then(Option::take) {
                    Some(next) => (latest, seen) = next,
                    None => {
                        writes.remove(&key);
                        return;
                    }
                }
            }
        });
    }

    fn latest_writes(&self) -> std::sync::MutexGuard<'_, LatestWrites> {
        self.latest_writes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The tenant of the session id most recently used.
    async fn tenant_of(&self, id: &str, op: StoreOp) -> Option<Option<TenantId>> {
        let mut conn = self.conn()?;
        let key = self.global_key(&format!("ids:{}", sid(id)));
        let hex: Option<String> = self.call(op, conn.get(key)).await?;
        Some(hex.as_deref().and_then(tenant_from_hex))
    }

    /// What the admin API shows of these sessions (`(tenant, sid)`), in order; sessions gone
    /// meanwhile are left out. `None` when Redis did not answer.
    async fn infos(&self, sessions: &[(TenantId, String)]) -> Option<Vec<SessionInfo>> {
        let mut pipe = redis::pipe();
        for (tenant, session) in sessions {
            pipe.hgetall(self.tenant_key(*tenant, &format!("s:{session}")))
                .llen(self.tenant_key(*tenant, &format!("s:{session}:cps")))
                .exists(self.tenant_key(*tenant, &format!("s:{session}:req")));
        }
        // The admin listing (up to a thousand sessions) goes on the bulk connection: the
        // request path's lookups must not queue behind it.
        let mut conn = self.bulk()?;
        type Row = (std::collections::HashMap<String, String>, usize, bool);
        let rows: Vec<Row> = self
            .call(StoreOp::Sessions, pipe.query_async(&mut conn))
            .await?;
        let mut latest = redis::pipe();
        for ((tenant, _), (fields, _, _)) in sessions.iter().zip(&rows) {
            let hash = fields.get("latest").map_or("", String::as_str);
            latest.get(self.tenant_key(*tenant, &format!("cp:{hash}")));
        }
        let checkpoints: Vec<Option<Vec<u8>>> = if sessions.is_empty() {
            Vec::new()
        } else {
            self.call(StoreOp::Sessions, latest.query_async(&mut conn))
                .await?
        };
        let now = unix_ms();
        let cooldown = u64::try_from(self.settings.breaker_cooldown.as_millis()).unwrap_or(0);
        let infos = sessions
            .iter()
            .zip(rows)
            .zip(checkpoints)
            .filter_map(
                |(((tenant, _), (fields, count, has_request)), checkpoint)| {
                    let id = fields.get("id")?.clone();
                    let number = |name: &str| -> u64 {
                        fields.get(name).and_then(|v| v.parse().ok()).unwrap_or(0)
                    };
                    let breaker = match fields.get("phase").map(String::as_str) {
                        Some("open") if now.saturating_sub(number("since")) < cooldown => {
                            BreakerState::Open
                        }
                        Some("open" | "trial") => BreakerState::HalfOpen,
                        _ => BreakerState::Closed,
                    };
                    let latest = checkpoint
                        .and_then(|json| serde_json::from_slice::<WireCheckpoint>(&json).ok())
                        .map(|wire| Arc::new(wire.into_checkpoint()));
                    Some(SessionInfo {
                        id,
                        tenant: *tenant,
                        compactions: u32::try_from(number("compactions")).unwrap_or(u32::MAX),
                        latest,
                        checkpoints: count,
                        messages_seen: usize::try_from(number("messages_seen")).unwrap_or(0),
                        created_unix: number("created"),
                        last_seen_unix: number("last_seen"),
                        breaker,
                        consecutive_failures: u32::try_from(number("failures")).unwrap_or(u32::MAX),
                        has_latest_request: has_request,
                        cost: fields.get("cost").map(|usd| SessionCost {
                            usd: usd.parse().unwrap_or(0.0),
                            without_compactor_usd: fields
                                .get("cost_without")
                                .and_then(|v| v.parse().ok())
                                .unwrap_or(0.0),
                            over_window_without_compactor: number("over_window"),
                            input_tokens: number("input_tokens"),
                            cache_read_tokens: number("cache_read_tokens"),
                            summarizer_usd: fields
                                .get("cost_summarizer")
                                .and_then(|v| v.parse().ok())
                                .unwrap_or(0.0),
                        }),
                    })
                },
            )
            .collect();
        Some(infos)
    }

    async fn session(&self, id: &str) -> Option<Option<SessionInfo>> {
        let Some(tenant) = self.tenant_of(id, StoreOp::Sessions).await? else {
            return Some(None);
        };
        let mut infos = self.infos(&[(tenant, sid(id))]).await?;
        Some(infos.pop())
    }

    async fn list(&self, limit: usize) -> Option<Vec<SessionInfo>> {
        let index = self.global_key("sessions");
        let stale = unix_ms().saturating_sub(self.ttl_ms());
        let mut conn = self.conn()?;
        let members: Vec<String> = self
            .call(
                StoreOp::Sessions,
                redis::pipe()
                    .zrembyscore(&index, "-inf", stale)
                    .ignore()
                    .zrevrange(&index, 0, isize::try_from(limit).unwrap_or(isize::MAX) - 1)
                    .query_async::<(Vec<String>,)>(&mut conn),
            )
            .await?
            .0;
        let sessions: Vec<(TenantId, String)> = members
            .iter()
            .filter_map(|m| {
                let (tenant, session) = m.split_once(':')?;
                Some((tenant_from_hex(tenant)?, session.to_string()))
            })
            .collect();
        self.infos(&sessions).await
    }

    async fn latest(&self, id: &str) -> Option<Option<LatestRequest>> {
        let Some(tenant) = self.tenant_of(id, StoreOp::Sessions).await? else {
            return Some(None);
        };
        // Up to `max_shared_request_bytes`, read off the request path: on the bulk
        // connection, like its writes.
        let mut conn = self.bulk()?;
        let key = self.tenant_key(tenant, &format!("s:{}:req", sid(id)));
        let fields: std::collections::HashMap<String, Vec<u8>> =
            self.call(StoreOp::Sessions, conn.hgetall(key)).await?;
        let text = |name: &str| {
            fields
                .get(name)
                .and_then(|v| String::from_utf8(v.clone()).ok())
        };
        let (Some(dialect), Some(body)) = (
            text("dialect").as_deref().and_then(DialectKind::from_label),
            fields.get("body"),
        ) else {
            return Some(None);
        };
        Some(Some(LatestRequest {
            tenant,
            dialect,
            body: Bytes::from(body.clone()),
            caller: Arc::new(Caller {
                upstream_base_url: text("upstream").unwrap_or_default(),
                api_prefix: text("prefix").unwrap_or_default(),
                credentials: Vec::new(),
                api: dialect.api(),
            }),
        }))
    }

    /// Claims `opening` for `candidate` unless a conversation did (on any replica), in one
    /// script call answering the owner. The claim lives as long as a session does.
    async fn claim_opening(
        &self,
        tenant: TenantId,
        opening: &str,
        candidate: &str,
    ) -> Option<String> {
        let key = self.tenant_key(tenant, &format!("open:{}", sid(opening)));
        let mut conn = self.conn()?;
        let mut invocation = self.scripts.open.key(key);
        invocation.arg(candidate).arg(self.ttl_ms());
        self.call(StoreOp::Touch, invocation.invoke_async(&mut conn))
            .await
    }

    async fn allowed(&self, tenant: TenantId, id: &str) -> Option<bool> {
        let cooldown = u64::try_from(self.settings.breaker_cooldown.as_millis()).unwrap_or(0);
        let mut invocation = self
            .scripts
            .allow
            .key(self.tenant_key(tenant, &format!("s:{}", sid(id))));
        invocation.arg(cooldown);
        let mut conn = self.conn()?;
        let allowed: i64 = self
            .call(StoreOp::Breaker, invocation.invoke_async(&mut conn))
            .await?;
        Some(allowed == 1)
    }

    async fn raise_floor(
        &self,
        tenant: TenantId,
        id: &str,
        covered: usize,
        need: MaskNeed,
    ) -> Option<usize> {
        let mut invocation = self
            .scripts
            .floor
            .key(self.tenant_key(tenant, &format!("m:{}", sid(id))));
        invocation
            .arg(covered)
            .arg(need.enough)
            .arg(need.step)
            .arg(self.ttl_ms());
        let mut conn = self.conn()?;
        let answer: u64 = self
            .call(StoreOp::MaskFloor, invocation.invoke_async(&mut conn))
            .await?;
        Some(usize::try_from(answer).unwrap_or(usize::MAX))
    }

    async fn record(&self, tenant: TenantId, id: &str, succeeded: bool) -> Option<bool> {
        let mut invocation = self
            .scripts
            .record
            .key(self.tenant_key(tenant, &format!("s:{}", sid(id))));
        invocation
            .arg(if succeeded { "1" } else { "0" })
            .arg(SESSION_BREAKER_THRESHOLD);
        let mut conn = self.conn()?;
        let opened: i64 = self
            .call(StoreOp::Breaker, invocation.invoke_async(&mut conn))
            .await?;
        Some(opened == 1)
    }

    async fn add_cost(&self, tenant: TenantId, id: &str, cost: SessionCost) -> Option<()> {
        let mut invocation = self
            .scripts
            .cost
            .key(self.tenant_key(tenant, &format!("s:{}", sid(id))));
        invocation
            .arg(cost.usd)
            .arg(cost.without_compactor_usd)
            .arg(cost.over_window_without_compactor)
            .arg(cost.input_tokens)
            .arg(cost.cache_read_tokens)
            .arg(cost.summarizer_usd);
        let mut conn = self.conn()?;
        let _: i64 = self
            .call(StoreOp::Cost, invocation.invoke_async(&mut conn))
            .await?;
        Some(())
    }

    async fn counts(&self) -> Option<(usize, usize)> {
        let sessions = self.global_key("sessions");
        let checkpoints = self.global_key("checkpoints");
        let now = unix_ms();
        let mut conn = self.conn()?;
        self.call(
            StoreOp::Stats,
            redis::pipe()
                .zrembyscore(&sessions, "-inf", now.saturating_sub(self.ttl_ms()))
                .ignore()
                .zrembyscore(&checkpoints, "-inf", now)
                .ignore()
                .zcard(&sessions)
                .zcard(&checkpoints)
                .query_async(&mut conn),
        )
        .await
    }

    /// Copies Redis's learned windows into this replica's table.
    async fn refresh_windows(&self) {
        let Some(mut conn) = self.conn() else {
            return;
        };
        let all: Option<std::collections::HashMap<String, String>> = self
            .call(StoreOp::Windows, conn.hgetall(self.global_key("windows")))
            .await;
        *self
            .windows_refreshed
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        for (field, json) in all.into_iter().flatten() {
            // A field without an upstream was written before windows were kept per upstream;
            // nothing looks it up, so it is left to be forgotten.
            let Some(key) = WindowKey::from_stored(field) else {
                continue;
            };
            match serde_json::from_str::<LearnedWindow>(&json) {
                Ok(window) => {
                    let _ = self.local.learn_window(&key, window).await;
                }
                Err(_) => self.bad_data(StoreOp::Windows, "learned window"),
            }
        }
    }

    fn windows_stale(&self) -> bool {
        self.windows_refreshed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none_or(|at| at.elapsed() >= WINDOWS_REFRESH)
    }

    async fn share_window(&self, window_key: &WindowKey, window: LearnedWindow) {
        let Ok(json) = serde_json::to_string(&window) else {
            return;
        };
        let key = self.global_key("windows");
        let Some(mut conn) = self.conn() else {
            return;
        };
        let count: Option<usize> = self
            .call(
                StoreOp::Windows,
                redis::pipe()
                    .hset(&key, window_key.as_str(), json)
                    .ignore()
                    .hlen(&key)
                    .query_async::<(usize,)>(&mut conn),
            )
            .await
            .map(|(n,)| n);
        if count.is_some_and(|n| n > MAX_LEARNED_WINDOWS) {
            // Bounded like the memory table: forget the least recently learned.
            let all: Option<std::collections::HashMap<String, String>> =
                self.call(StoreOp::Windows, conn.hgetall(&key)).await;
            let oldest = all.into_iter().flatten().min_by_key(|(_, json)| {
                serde_json::from_str::<LearnedWindow>(json).map_or(0, |w| w.learned_unix)
            });
            if let Some((field, _)) = oldest {
                let _: Option<i64> = self.call(StoreOp::Windows, conn.hdel(&key, field)).await;
            }
        }
    }

    async fn claim(
        self: &Arc<Self>,
        tenant: TenantId,
        id: &str,
        covered: usize,
        wait: Duration,
    ) -> Result<Claim, StoreError> {
        let key = self.tenant_key(tenant, &format!("lock:{}:{covered}", sid(id)));
        let token = format!(
            "{}-{}-{}",
            std::process::id(),
            unix_us(),
            self.next_token.fetch_add(1, Ordering::Relaxed)
        );
        let ttl = u64::try_from(self.settings.claim_ttl.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let mut conn = self
            .conn()
            .ok_or_else(|| StoreError::Backend("no Redis client".into()))?;
        let won: Option<String> = self
            .call(
                StoreOp::Claim,
                redis::cmd("SET")
                    .arg(&key)
                    .arg(&token)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl)
                    .query_async(&mut conn),
            )
            .await
            .ok_or_else(|| StoreError::Backend("claim not reachable".into()))?;
        if won.is_some() {
            return Ok(Claim::Won(Lease::guarded(Box::new(ClaimGuard::hold(
                self.clone(),
                key,
                token,
                ttl,
            )))));
        }
        // Held by another replica: wait for it to go, bounded.
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            tokio::time::sleep(CLAIM_POLL.min(deadline.saturating_duration_since(Instant::now())))
                .await;
            let held: Option<bool> = self.call(StoreOp::Claim, conn.exists(&key)).await;
            if held != Some(true) {
                break;
            }
        }
        Ok(Claim::Waited)
    }
}

/// Keeps a claim alive while it lives; releases it (if still ours) when dropped.
struct ClaimGuard {
    renewal: Option<tokio::task::JoinHandle<()>>,
    release: Option<(Arc<Shared>, String, String)>,
}

impl ClaimGuard {
    fn hold(shared: Arc<Shared>, key: String, token: String, ttl_ms: u64) -> ClaimGuard {
        let renewal = tokio::runtime::Handle::try_current().ok().map(|runtime| {
            let (shared, key, token) = (shared.clone(), key.clone(), token.clone());
            runtime.spawn(async move {
                let every = Duration::from_millis((ttl_ms / 3).max(1));
                loop {
                    tokio::time::sleep(every).await;
                    let mut invocation = shared.scripts.renew.key(&key);
                    invocation.arg(&token).arg(ttl_ms);
                    let Some(mut conn) = shared.conn() else {
                        return;
                    };
                    let _: Option<i64> = shared
                        .call(StoreOp::Claim, invocation.invoke_async(&mut conn))
                        .await;
                }
            })
        });
        ClaimGuard {
            renewal,
            release: Some((shared, key, token)),
        }
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if let Some(renewal) = self.renewal.take() {
            renewal.abort();
        }
        let Some((shared, key, token)) = self.release.take() else {
            return;
        };
        // Without a runtime the claim is left to expire.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let mut invocation = shared.scripts.release.key(&key);
                invocation.arg(&token);
                let Some(mut conn) = shared.conn() else {
                    return;
                };
                let _: Option<i64> = shared
                    .call(StoreOp::Claim, invocation.invoke_async(&mut conn))
                    .await;
            });
        }
    }
}

/// A checkpoint as stored in Redis (the admin API's serialisation shows `staged` as a flag;
/// this one keeps what a staged checkpoint refines).
#[derive(Serialize, Deserialize)]
struct WireCheckpoint {
    session_id: String,
    covered: usize,
    /// Absent from checkpoints stored by earlier versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    head: Option<usize>,
    summary: String,
    read_files: Vec<String>,
    modified_files: Vec<String>,
    pre_tokens: usize,
    post_tokens: usize,
    compaction_num: u32,
    created_unix: u64,
    staged: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    base: Option<Box<WireCheckpoint>>,
}

impl From<&Checkpoint> for WireCheckpoint {
    fn from(c: &Checkpoint) -> WireCheckpoint {
        WireCheckpoint {
            session_id: c.session_id.clone(),
            covered: c.covered,
            head: c.head,
            summary: c.result.summary.clone(),
            read_files: c.result.read_files.clone(),
            modified_files: c.result.modified_files.clone(),
            pre_tokens: c.result.pre_tokens,
            post_tokens: c.result.post_tokens,
            compaction_num: c.result.compaction_num,
            created_unix: c.created_unix,
            staged: c.staged.is_some(),
            base: c
                .staged
                .as_ref()
                .and_then(|s| s.base.as_deref())
                .map(|b| Box::new(WireCheckpoint::from(b))),
        }
    }
}

impl WireCheckpoint {
    fn into_checkpoint(self) -> Checkpoint {
        Checkpoint {
            session_id: self.session_id,
            covered: self.covered,
            head: self.head,
            result: CompactionResult {
                summary: self.summary,
                read_files: self.read_files,
                modified_files: self.modified_files,
                pre_tokens: self.pre_tokens,
                post_tokens: self.post_tokens,
                compaction_num: self.compaction_num,
            },
            created_unix: self.created_unix,
            staged: self.staged.then(|| Staged {
                base: self.base.map(|b| Arc::new(b.into_checkpoint())),
            }),
        }
    }
}

fn longer(a: Option<Arc<Checkpoint>>, b: Option<Arc<Checkpoint>>) -> Option<Arc<Checkpoint>> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if b.covered > a.covered { b } else { a }),
        (a, b) => a.or(b),
    }
}

impl SessionStore for RedisStore {
    fn longest_checkpoint<'a>(
        &'a self,
        tenant: TenantId,
        hashes: &'a [ChainHash],
    ) -> BoxFuture<'a, Result<Option<Arc<Checkpoint>>, StoreError>> {
        Box::pin(async move {
            let shared = self.shared.longest(tenant, hashes).await;
            // This replica's own checkpoints cover what was compacted while Redis was away.
            let local = self
                .shared
                .local
                .longest_checkpoint(tenant, hashes)
                .await
                .unwrap_or(None);
            Ok(longer(shared, local))
        })
    }

    fn put_checkpoint(
        &self,
        tenant: TenantId,
        hash: ChainHash,
        checkpoint: Arc<Checkpoint>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            self.shared
                .local
                .put_checkpoint(tenant, hash, checkpoint.clone())
                .await?;
            self.shared.put(tenant, hash, &checkpoint).await;
            Ok(())
        })
    }

    fn touch_session<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        latest: LatestRequest,
        messages_seen: usize,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let _ = self
                .shared
                .local
                .touch_session(tenant, id, latest.clone(), messages_seen)
                .await;
            // Sharing the latest request (up to megabytes) is off the request path.
            self.shared.share_latest(tenant, id, latest, messages_seen);
            Ok(())
        })
    }

    /// Settled in this replica's memory store only, where this replica's sessions compete for
    /// room: Redis evicts nothing by tenant (its keys expire after `store.ttl_secs`, beyond
    /// that its own memory policy applies), so there is no share there to protect.
    fn provider_answered<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        answer: ProviderAnswer,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.shared.local.provider_answered(tenant, id, answer)
    }

    /// Answered once per opening by Redis, then by this replica's memory (an owner never
    /// changes while its claim lives); this replica's own claim when Redis cannot answer.
    fn claim_opening<'a>(
        &'a self,
        tenant: TenantId,
        opening: &'a str,
        candidate: &'a str,
    ) -> BoxFuture<'a, Result<String, StoreError>> {
        Box::pin(async move {
            let local = &self.shared.local;
            if let Some(owner) = local.known_opening(tenant, opening) {
                return Ok(owner);
            }
            match self.shared.claim_opening(tenant, opening, candidate).await {
                Some(owner) => {
                    local.learn_opening(tenant, opening, &owner);
                    Ok(owner)
                }
                None => local.claim_opening(tenant, opening, candidate).await,
            }
        })
    }

    fn session<'a>(
        &'a self,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<SessionInfo>, StoreError>> {
        Box::pin(async move {
            match self.shared.session(id).await {
                Some(info) => Ok(info),
                None => self.shared.local.session(id).await,
            }
        })
    }

    fn latest_request<'a>(
        &'a self,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<LatestRequest>, StoreError>> {
        Box::pin(async move {
            let local = self.shared.local.latest_request(id).await.unwrap_or(None);
            let Some(shared) = self.shared.latest(id).await else {
                return Ok(local);
            };
            // The same request seen here: this replica's copy carries its credentials.
            Ok(match (shared, local) {
                (Some(s), Some(l)) if s.tenant == l.tenant && s.body == l.body => Some(l),
                (Some(s), _) => Some(s),
                (None, l) => l,
            })
        })
    }

    fn list_sessions(&self, limit: usize) -> BoxFuture<'_, Result<Vec<SessionInfo>, StoreError>> {
        Box::pin(async move {
            match self.shared.list(limit).await {
                Some(list) => Ok(list),
                None => self.shared.local.list_sessions(limit).await,
            }
        })
    }

    fn compaction_allowed<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            match self.shared.allowed(tenant, id).await {
                Some(allowed) => Ok(allowed),
                None => self.shared.local.compaction_allowed(tenant, id).await,
            }
        })
    }

    /// An upper bound, to save a round trip on every request: while Redis is reachable, every
    /// length (the lookup script probes only the lengths the tenant's checkpoints cover, and
    /// the hashes of a conversation's earlier messages are memoised by the caller); while it
    /// is not, what this replica's memory holds.
    fn max_covered(&self, tenant: TenantId) -> BoxFuture<'_, Result<usize, StoreError>> {
        Box::pin(async move {
            if self.shared.link.is_up() {
                return Ok(usize::MAX);
            }
            self.shared.local.max_covered(tenant).await
        })
    }

    fn stats(&self) -> BoxFuture<'_, Result<StoreStats, StoreError>> {
        Box::pin(async move {
            let mut stats = SessionStore::stats(&self.shared.local).await?;
            if let Some((sessions, checkpoints)) = self.shared.counts().await {
                stats.sessions = sessions;
                stats.checkpoints = checkpoints;
            }
            Ok(stats)
        })
    }

    fn record_compaction<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        succeeded: bool,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let local = self
                .shared
                .local
                .record_compaction(tenant, id, succeeded)
                .await
                .unwrap_or(false);
            match self.shared.record(tenant, id, succeeded).await {
                Some(opened) => Ok(opened),
                None => Ok(local),
            }
        })
    }

    /// Added in Redis, where the admin API reads it, and in this replica's memory, which
    /// answers while Redis does not.
    fn record_cost<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        cost: SessionCost,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.shared.local.record_cost(tenant, id, cost).await?;
            self.shared.add_cost(tenant, id, cost).await;
            Ok(())
        })
    }

    fn raise_mask_floor<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        covered: usize,
        need: MaskNeed,
    ) -> BoxFuture<'a, Result<usize, StoreError>> {
        Box::pin(async move {
            // The shared floor decides; this replica's own keeps up for when Redis is away
            // (after an outage the two may differ, and a replica's masking moves once).
            let local = self
                .shared
                .local
                .raise_mask_floor(tenant, id, covered, need)
                .await
                .unwrap_or(need.enough);
            Ok(self
                .shared
                .raise_floor(tenant, id, covered, need)
                .await
                .unwrap_or(local))
        })
    }

    fn learned_window<'a>(
        &'a self,
        upstream: &'a str,
        model: &'a str,
    ) -> BoxFuture<'a, Result<Option<LearnedWindow>, StoreError>> {
        if self.shared.windows_stale() {
            // Mark it refreshed now so concurrent requests start one refresh, not many.
            *self
                .shared
                .windows_refreshed
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
            let shared = self.shared.clone();
            tokio::spawn(async move { shared.refresh_windows().await });
        }
        self.shared.local.learned_window(upstream, model)
    }

    fn learn_window<'a>(
        &'a self,
        key: &'a WindowKey,
        window: LearnedWindow,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let changed = self.shared.local.learn_window(key, window).await?;
            if changed {
                let known = self
                    .shared
                    .local
                    .learned_window(key.upstream(), key.model())
                    .await;
                if let Ok(Some(known)) = known {
                    self.shared.share_window(key, known).await;
                }
            }
            Ok(changed)
        })
    }

    fn learned_windows(
        &self,
    ) -> BoxFuture<'_, Result<Vec<(WindowKey, LearnedWindow)>, StoreError>> {
        Box::pin(async move {
            self.shared.refresh_windows().await;
            self.shared.local.learned_windows().await
        })
    }

    fn claim_compaction<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        covered: usize,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(self.shared.claim(tenant, id, covered, wait))
    }

    fn health(&self) -> StoreHealth {
        if self.shared.link.is_up() {
            StoreHealth::Connected
        } else {
            StoreHealth::Degraded
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpoint(covered: usize, staged: Option<Staged>) -> Checkpoint {
        Checkpoint {
            session_id: "s".into(),
            covered,
            head: Some(1),
            result: CompactionResult {
                summary: format!("summary of {covered}"),
                read_files: vec!["a.rs".into()],
                modified_files: vec!["b.rs".into()],
                pre_tokens: 1000,
                post_tokens: 100,
                compaction_num: 2,
            },
            created_unix: 7,
            staged,
        }
    }

    #[test]
    fn a_staged_checkpoint_round_trips_with_what_it_refines() {
        let base = Arc::new(checkpoint(4, None));
        let staged = checkpoint(9, Some(Staged { base: Some(base) }));
        let json = serde_json::to_vec(&WireCheckpoint::from(&staged)).expect("json");
        let back = serde_json::from_slice::<WireCheckpoint>(&json)
            .expect("decode")
            .into_checkpoint();
        assert_eq!(back, staged);
        let plain = checkpoint(3, None);
        let json = serde_json::to_vec(&WireCheckpoint::from(&plain)).expect("json");
        let back = serde_json::from_slice::<WireCheckpoint>(&json).expect("decode");
        assert_eq!(back.into_checkpoint(), plain);
    }

    #[test]
    fn a_checkpoint_stored_before_heads_were_recorded_reads_without_one() {
        let mut json: serde_json::Value =
            serde_json::to_value(WireCheckpoint::from(&checkpoint(3, None))).expect("json");
        assert_eq!(json["head"], 1, "the head is stored");
        json.as_object_mut().expect("object").remove("head");
        let back: WireCheckpoint = serde_json::from_value(json).expect("an old entry decodes");
        assert_eq!(back.into_checkpoint().head, None);
    }

    #[test]
    fn tenant_hex_round_trips_and_rejects_garbage() {
        let tenant = TenantId::from_credential("sk-1");
        assert_eq!(tenant_from_hex(&tenant.to_hex()), Some(tenant));
        for bad in ["", "00", &"g".repeat(32), &"0".repeat(33)] {
            assert_eq!(tenant_from_hex(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_down_link_admits_one_probe_after_its_backoff() {
        let mut link = Link::new();
        // A clock that has run for a second already, so "now" is past a 1 ms deadline.
        link.epoch = Instant::now()
            .checked_sub(Duration::from_secs(1))
            .expect("clock");
        assert!(link.admits().is_some() && link.is_up());
        assert!(link.down(), "the first failure takes it down");
        assert!(!link.is_up());
        assert!(link.admits().is_none(), "no call during the backoff");
        // Move the backoff's end into the past instead of sleeping.
        link.down_until.store(1, Ordering::Release);
        let probe = link.admits();
        assert!(probe.is_some(), "one probe after the backoff");
        assert!(link.admits().is_none(), "only one");
        // Cancelled mid-call: neither up nor down. The next call probes.
        drop(probe);
        let probe = link.admits();
        assert!(probe.is_some(), "a cancelled probe gives its turn back");
        assert!(link.up(), "a successful probe brings it back");
        drop(probe);
        assert!(link.admits().is_some() && link.is_up());
    }

    #[test]
    fn session_ids_become_fixed_length_key_parts() {
        assert_eq!(sid("a").len(), 32);
        assert_eq!(sid(&"x".repeat(10_000)).len(), 32);
        assert_ne!(sid("a"), sid("b"));
    }
}
