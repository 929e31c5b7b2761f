//! The session store contract: what is remembered about conversations, and the
//! [`SessionStore`] trait every backend implements.
//!
//! A [`Checkpoint`] says "the first `covered` messages of this conversation are replaced by
//! this summary" and is stored under the [`ChainHash`] of that prefix, so a later request finds
//! it by content alone. Around checkpoints the store keeps a small record per session (for the
//! admin API, the per-session [`Breaker`](super::breaker::Breaker), and the latest request so a
//! manual compaction has something to compact). The trait returns boxed futures so it stays
//! object safe and a networked backend (Redis) can implement it; the in-memory backend lives in
//! [`memory`](super::memory).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use compactor_plugin_api::{BoxFuture, Caller};
use serde::{Serialize, Serializer};

use super::breaker::BreakerState;
use super::hash::{ChainHash, TenantId};
use super::memory::MemoryStore;
use super::redis::{RedisSettings, RedisStore, CLAIM_TTL};
use crate::compaction::models::{LearnedWindow, WindowKey};
use crate::compaction::CompactionResult;
use crate::config::{Config, StoreBackend};
use crate::dialect::DialectKind;
use crate::metrics::Metrics;

/// Fixed per-checkpoint overhead added to its text when sizing a store.
pub const CHECKPOINT_OVERHEAD_BYTES: usize = 256;

/// Fixed per-session overhead added to its id and latest request when sizing a store.
pub const SESSION_OVERHEAD_BYTES: usize = 512;

/// "Messages `[0..covered)` of this conversation are replaced by `summary`."
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Checkpoint {
    /// The session that produced it.
    pub session_id: String,
    /// How many leading messages the summary replaces (at least 1). Also where the masking
    /// of old tool outputs starts counting (`compaction.strategy` `mask`, `hybrid`): the masked
    /// set is a function of the request, this and the configuration, so it needs no field of
    /// its own.
    pub covered: usize,
    /// How many leading messages the summary follows, kept verbatim before it: the system
    /// messages, and the conversation's opening when the compaction kept it (see
    /// `Transcript::keeping_opening`). Every request splicing the summary keeps the same head,
    /// whatever its own limits say now. `None` for a checkpoint stored before openings were
    /// kept: its head is the request's without the opening.
    pub head: Option<usize>,
    /// What the compaction produced: the summary spliced in place of the covered messages,
    /// the files read and modified so far (carried into the next compaction), the estimates
    /// before and after, and its number within the conversation.
    #[serde(flatten)]
    pub result: CompactionResult,
    /// When it was made (seconds since the Unix epoch).
    pub created_unix: u64,
    /// Made in the background ahead of need: see [`Staged`]. `None` for a checkpoint in use.
    #[serde(rename = "staged", serialize_with = "serialize_staged")]
    pub staged: Option<Staged>,
}

/// A checkpoint made in the background, before its conversation needed it
/// (`compaction.background_ratio`). Splicing it changes what the provider sees (and its prompt
/// cache), so it is spliced only into a request that crosses the trigger without it, which
/// promotes it to a checkpoint in use; until then requests are served as if it did not exist,
/// with `base`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staged {
    /// The checkpoint in use when it was made (the one it refines), if any.
    pub base: Option<Arc<Checkpoint>>,
}

fn serialize_staged<S: Serializer>(staged: &Option<Staged>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_bool(staged.is_some())
}

impl Checkpoint {
    /// Approximate memory held by this checkpoint, for `max_bytes` accounting.
    pub fn approx_bytes(&self) -> usize {
        let files = |list: &[String]| -> usize {
            list.iter()
                .map(|f| f.len() + std::mem::size_of::<String>())
                .sum()
        };
        CHECKPOINT_OVERHEAD_BYTES
            + self.session_id.len()
            + self.result.summary.len()
            + files(&self.result.read_files)
            + files(&self.result.modified_files)
    }
}

/// The most recent chat request of a session, kept so `POST /session/{id}/summarize` can
/// compact it. `caller` holds credentials: they stay in the memory of the process that
/// received the request (a shared store keeps the rest), are never serialised, and `Debug`
/// shows neither the body nor credential values.
#[derive(Clone)]
pub struct LatestRequest {
    /// The tenant that sent it (kept apart from `caller`, whose credentials may be absent
    /// when the request was read back from a shared store).
    pub tenant: TenantId,
    /// The wire format of `body`.
    pub dialect: DialectKind,
    /// The request body exactly as received.
    pub body: Bytes,
    /// Where it went and with which credentials (shared with the request that carried it).
    pub caller: Arc<Caller>,
}

impl LatestRequest {
    /// Approximate memory held, for `max_bytes` accounting.
    pub fn approx_bytes(&self) -> usize {
        let credentials: usize = self
            .caller
            .credentials
            .iter()
            .map(|(n, v)| n.len() + v.len())
            .sum();
        self.body.len()
            + self.caller.upstream_base_url.len()
            + self.caller.api_prefix.len()
            + credentials
    }
}

impl fmt::Debug for LatestRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LatestRequest")
            .field("dialect", &self.dialect)
            .field("body_bytes", &self.body.len())
            .finish_non_exhaustive()
    }
}

/// What the admin API shows about one session (`GET /session/{id}`, `GET /sessions`).
#[derive(Debug, Clone, Serialize)]
pub struct SessionInfo {
    /// The session id (client header or derived).
    pub id: String,
    /// The tenant, as short hex.
    pub tenant: TenantId,
    /// Checkpoints stored for this session since it was first seen.
    pub compactions: u32,
    /// The most recent checkpoint: covered messages, token figures, files, current summary.
    #[serde(serialize_with = "serialize_latest")]
    pub latest: Option<Arc<Checkpoint>>,
    /// Checkpoints of this session currently held.
    pub checkpoints: usize,
    /// Messages in the session's latest request.
    pub messages_seen: usize,
    /// First seen (seconds since the Unix epoch).
    pub created_unix: u64,
    /// Last used (seconds since the Unix epoch).
    pub last_seen_unix: u64,
    /// The session's breaker.
    pub breaker: BreakerState,
    /// Failed compactions since the last success.
    pub consecutive_failures: u32,
    /// Whether a latest request is held (a manual compaction is possible).
    pub has_latest_request: bool,
    /// What its requests cost at the provider, with and without compactor; `None` until a
    /// response of a priced model was billed.
    pub cost: Option<SessionCost>,
}

/// What a conversation's requests cost at the provider ([`SessionStore::record_cost`]): the
/// per-session view of `compactor_cost_usd_total` and `compactor_cost_without_compactor_usd_total`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SessionCost {
    /// What the provider billed for the requests forwarded, in USD (input, cache reads and
    /// writes, output).
    pub usd: f64,
    /// What the requests as the agent sent them would have cost, in USD; requests whose
    /// original was over the model's window are counted in `over_window_without_compactor`
    /// instead.
    pub without_compactor_usd: f64,
    /// Requests whose original was over the model's window: without compactor the provider
    /// would have refused them.
    pub over_window_without_compactor: u64,
    /// Input tokens the provider billed for its requests, and of them the ones read from its
    /// prompt cache: their ratio is the conversation's cache-hit share.
    pub input_tokens: u64,
    /// See `input_tokens`.
    pub cache_read_tokens: u64,
    /// What its summaries cost, in USD, when the summarizer's backend reported what its
    /// model billed and the model has a price (`openai` and `anthropic` do; `extractive` and
    /// `exec` cost nothing here). Not part of `usd`.
    pub summarizer_usd: f64,
}

impl SessionCost {
    /// These totals with `more` added.
    pub fn plus(self, more: SessionCost) -> SessionCost {
        SessionCost {
            usd: self.usd + more.usd,
            without_compactor_usd: self.without_compactor_usd + more.without_compactor_usd,
            over_window_without_compactor: self
                .over_window_without_compactor
                .saturating_add(more.over_window_without_compactor),
            input_tokens: self.input_tokens.saturating_add(more.input_tokens),
            cache_read_tokens: self
                .cache_read_tokens
                .saturating_add(more.cache_read_tokens),
            summarizer_usd: self.summarizer_usd + more.summarizer_usd,
        }
    }
}

fn serialize_latest<S: Serializer>(
    latest: &Option<Arc<Checkpoint>>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    latest.as_deref().serialize(serializer)
}

/// Bounds of a store. `max_bytes` is approximate: summaries, file lists, latest request bodies
/// and a fixed overhead per entry.
///
/// Each tenant also has a fair share ([`StoreLimits::tenant_share`]) so that one credential
/// creating sessions without end cannot evict every other tenant's summaries: a tenant over
/// its share loses its own least recently used sessions first, and only then do the global
/// bounds evict the least recently used of anyone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLimits {
    /// Sessions kept; the least recently used beyond this are evicted with their checkpoints.
    pub max_sessions: usize,
    /// Approximate bytes kept; least recently used sessions are evicted beyond this.
    pub max_bytes: usize,
    /// Sessions one tenant may hold (counted as at most `max_sessions`); its bytes are
    /// bounded in proportion, see [`StoreLimits::tenant_share`].
    pub max_sessions_per_tenant: usize,
    /// Sessions not used for longer than this are dropped with their checkpoints.
    pub ttl: Duration,
}

impl StoreLimits {
    /// What one tenant may hold: `(sessions, bytes)`.
    ///
    /// Sessions: `max_sessions_per_tenant`, at most `max_sessions`. Bytes: the same fraction
    /// of `max_bytes` as its sessions are of `max_sessions` (`max_bytes × sessions /
    /// max_sessions`), so one rule covers both bounds and a tenant of large sessions cannot
    /// take the byte budget that its session count leaves to others. When the share is the
    /// whole store (one tenant, or `max_sessions_per_tenant >= max_sessions`) this is exactly
    /// the global bounds.
    pub fn tenant_share(&self) -> (usize, usize) {
        let sessions = self.max_sessions_per_tenant.min(self.max_sessions);
        if sessions >= self.max_sessions {
            return (sessions, self.max_bytes);
        }
        // u128: `max_bytes × sessions` overflows usize for large budgets (tests use
        // `usize::MAX` for "unbounded").
        let bytes = self.max_bytes as u128 * sessions as u128 / self.max_sessions.max(1) as u128;
        (sessions, usize::try_from(bytes).unwrap_or(usize::MAX))
    }
}

/// Counters and gauges of a store, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Sessions held (`compactor_sessions`).
    pub sessions: usize,
    /// Checkpoints held.
    pub checkpoints: usize,
    /// Approximate bytes held.
    pub bytes: usize,
    /// Sessions evicted to respect `max_sessions` / `max_bytes` or a tenant's share of them
    /// (`max_sessions_per_tenant`) since start.
    pub evictions: u64,
    /// Sessions dropped after `ttl` without use since start.
    pub expirations: u64,
}

/// Why a store operation failed. Callers fail open: a failed lookup is a miss, a failed write
/// means the next request compacts again.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A checkpoint must cover at least one message.
    #[error("checkpoint covers no messages")]
    EmptyCheckpoint,
    /// A networked backend failed (unreachable, timeout, bad data).
    #[error("session store backend failed: {0}")]
    Backend(String),
}

/// What [`SessionStore::claim_compaction`] answered.
#[derive(Debug)]
pub enum Claim {
    /// This process compacts the prefix; dropping the lease releases the claim.
    Won(Lease),
    /// Another process held the claim; it released it (or it expired, or the wait ran out):
    /// read the store for what it left.
    Waited,
}

/// A held compaction claim: released when dropped. A backend keeps it alive (renews it) for
/// as long as the lease lives, and lets it expire if this process dies.
pub struct Lease(Option<Box<dyn Send + Sync>>);

impl Lease {
    /// A lease with nothing to release (a store private to this process: its single flight
    /// already keeps one compaction of a prefix at a time).
    pub fn local() -> Lease {
        Lease(None)
    }

    /// A lease whose `guard` releases the claim when dropped.
    pub fn guarded(guard: Box<dyn Send + Sync>) -> Lease {
        Lease(Some(guard))
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Lease")
            .field(&if self.0.is_some() { "shared" } else { "local" })
            .finish()
    }
}

/// How far `hybrid` has masked one conversation (`compaction.strategy`): the most leading
/// maskable tool outputs one of its requests had masked, counted from the first message after
/// the summary that covers `covered` messages (0: no summary).
///
/// A later request masks at least as many, so the masked prefix never moves back: without it
/// a lower trigger for the same conversation (another replica's calibration, a calibration
/// that moved, a smaller `max_tokens`) would unmask a block, and the provider's prompt cache
/// and every replica's bytes would part ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaskFloor {
    /// Messages the summary the count starts after covers.
    pub covered: usize,
    /// Leading maskable outputs masked.
    pub masked: usize,
}

/// What one `hybrid` request needs masked, in leading maskable outputs: `enough` to be
/// under its trigger (0: it is), and `step`, how far masking moves when the floor falls short
/// of that: every maskable output, so a step frees as much of the window as masking can, the
/// next one is many requests away and the prompt cache holds in between. A `step` short of
/// `enough` (masking cannot buy that headroom, or a summary made ahead stands in) leaves the
/// floor where it is, and the request over its trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaskNeed {
    /// Outputs that bring the request under its trigger.
    pub enough: usize,
    /// Outputs masked when the floor falls short of `enough` (if at least `enough`).
    pub step: usize,
}

impl MaskFloor {
    /// A request of the conversation starting after `covered` messages needs `need`: answers
    /// the floor to keep and how many outputs to mask. The floor stays while it is enough and
    /// moves by a whole step when it is not. A newer summary (a larger `covered`) starts a
    /// new floor; a request behind the stored one (an older branch of the conversation)
    /// masks what it needs and leaves the floor alone. The Redis store's script does the same.
    pub fn raise(stored: Option<MaskFloor>, covered: usize, need: MaskNeed) -> (MaskFloor, usize) {
        let floor = match stored {
            Some(s) if covered < s.covered => return (s, need.enough),
            Some(s) if covered == s.covered => s.masked,
            _ => 0,
        };
        let masked = if floor < need.enough && need.step >= need.enough {
            need.step
        } else {
            floor
        };
        (MaskFloor { covered, masked }, masked)
    }
}

/// What the provider answered a chat request, as far as the store is concerned.
///
/// The tenant is a hash of whatever credential arrives, and a session is recorded before the
/// request goes upstream (the request path needs it). Until one of a tenant's requests is
/// accepted its sessions are *unconfirmed*: the store evicts them before any confirmed
/// tenant's, and a refusal as unauthorised takes back what the refused request recorded.
/// Requests with made-up credentials, all refused, can thus only ever evict each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderAnswer {
    /// A success (2xx): the tenant is confirmed, its sessions are kept like any other.
    Accepted,
    /// Refused as unauthorised (401, 403): the session is removed unless its tenant is
    /// confirmed (a confirmed key that stops working keeps what it had until it ages out).
    Unauthorised,
}

/// The state of a store's backend, for `/readyz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreHealth {
    /// In this process: always available.
    Memory,
    /// The shared backend answered its last call.
    Connected,
    /// The shared backend is unreachable or failing: requests go on without it (fail open).
    Degraded,
}

/// Where checkpoints and sessions live. Object safe: hold it as `Arc<dyn SessionStore>`.
///
/// Sessions are keyed by `(tenant, id)` so two tenants sending the same session header never
/// share an entry; the admin lookups by id alone pick the most recently used match.
pub trait SessionStore: Send + Sync {
    /// The checkpoint covering the longest prefix among `hashes` (the request's chain from
    /// [`chain`](super::hash::chain): `hashes[k-1]` covers messages `[0..k)`), if any. A hit
    /// counts as use of the owning session.
    fn longest_checkpoint<'a>(
        &'a self,
        tenant: TenantId,
        hashes: &'a [ChainHash],
    ) -> BoxFuture<'a, Result<Option<Arc<Checkpoint>>, StoreError>>;

    /// Stores `checkpoint` under `hash` (the chain hash of its last covered message), owned by
    /// the session `(tenant, checkpoint.session_id)`, which becomes its latest checkpoint. A
    /// checkpoint already stored under `hash` is replaced.
    fn put_checkpoint(
        &self,
        tenant: TenantId,
        hash: ChainHash,
        checkpoint: Arc<Checkpoint>,
    ) -> BoxFuture<'_, Result<(), StoreError>>;

    /// Records that session `(tenant, id)` was just used by `latest` holding `messages_seen`
    /// messages; creates the session when new.
    fn touch_session<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        latest: LatestRequest,
        messages_seen: usize,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Tells the store how the provider answered a request of session `(tenant, id)`, so a
    /// credential no provider accepts cannot push out the sessions of tenants it does accept
    /// ([`ProviderAnswer`] says what each answer does).
    fn provider_answered<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        answer: ProviderAnswer,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// The conversation that owns the derived session id `opening` of `tenant`
    /// ([`Openings`](super::openings::Openings)): `candidate` (its id through the model's first
    /// reply) when none claimed it yet, which then does. Shared stores answer the same on every
    /// replica.
    fn claim_opening<'a>(
        &'a self,
        tenant: TenantId,
        opening: &'a str,
        candidate: &'a str,
    ) -> BoxFuture<'a, Result<String, StoreError>>;

    /// The session with this id (admin API), without counting as use.
    fn session<'a>(&'a self, id: &'a str)
        -> BoxFuture<'a, Result<Option<SessionInfo>, StoreError>>;

    /// The latest request of the session with this id (manual compaction).
    fn latest_request<'a>(
        &'a self,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<LatestRequest>, StoreError>>;

    /// Up to `limit` sessions, most recently used first.
    fn list_sessions(&self, limit: usize) -> BoxFuture<'_, Result<Vec<SessionInfo>, StoreError>>;

    /// Whether the session's breaker lets an automatic compaction run now (true for an unknown
    /// session). In the half-open state a `true` is the one trial: report its outcome.
    fn compaction_allowed<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// The longest prefix any checkpoint of `tenant` covers (0 when it has none), so a request
    /// hashes only as many messages as could possibly match. A shared store may answer an
    /// upper bound instead (up to `usize::MAX`) to spare a round trip.
    fn max_covered(&self, tenant: TenantId) -> BoxFuture<'_, Result<usize, StoreError>>;

    /// Counters and sizes for metrics.
    fn stats(&self) -> BoxFuture<'_, Result<StoreStats, StoreError>>;

    /// Reports a compaction's outcome to the session's breaker. Returns true when this failure
    /// just opened it (count it); unknown sessions are ignored.
    fn record_compaction<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        succeeded: bool,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Adds what one response of session `(tenant, id)` cost to the session's totals
    /// ([`SessionInfo::cost`]); a session the store does not hold is left alone.
    fn record_cost<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        cost: SessionCost,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// The context window learned for `model` on `upstream` (any tenant's requests teach it:
    /// a window is the provider's, not the caller's), if any. Read on every chat request.
    fn learned_window<'a>(
        &'a self,
        upstream: &'a str,
        model: &'a str,
    ) -> BoxFuture<'a, Result<Option<LearnedWindow>, StoreError>>;

    /// Learns a context window for `key` ([`LearnedWindow::merged_into`] says what replaces
    /// what). True when it changed what was known (count it).
    fn learn_window<'a>(
        &'a self,
        key: &'a WindowKey,
        window: LearnedWindow,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Every learned window, most recently learned first (admin `GET /models`).
    fn learned_windows(&self)
        -> BoxFuture<'_, Result<Vec<(WindowKey, LearnedWindow)>, StoreError>>;

    /// Raises the mask floor of session `(tenant, id)` ([`MaskFloor::raise`]) for a request
    /// that needs `need` of its maskable outputs after the first `covered` messages masked,
    /// and answers how many to mask. An unknown session answers `need.enough`.
    fn raise_mask_floor<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        covered: usize,
        need: MaskNeed,
    ) -> BoxFuture<'a, Result<usize, StoreError>>;

    /// Claims the compaction of the first `covered` messages' successor for session
    /// `(tenant, id)` across every process sharing this store, so one summary is made per
    /// compaction. When another process holds the claim, waits up to `wait` for it to go
    /// (released, or expired because its holder died) and answers [`Claim::Waited`].
    ///
    /// A store private to this process always wins: the caller's single flight already
    /// serialises compactions of a prefix within the process.
    fn claim_compaction<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        covered: usize,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        let _ = (tenant, id, covered, wait);
        Box::pin(std::future::ready(Ok(Claim::Won(Lease::local()))))
    }

    /// The backend's state (`/readyz`).
    fn health(&self) -> StoreHealth {
        StoreHealth::Memory
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it), for `created_unix` and friends.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The store `[store]` describes: in memory, or shared through Redis with a memory store of
/// this process's own beside it (and in its place, failing open, should the Redis client not
/// build).
pub fn configured(config: &Config, metrics: Arc<Metrics>) -> Arc<dyn SessionStore> {
    let memory = || {
        MemoryStore::new(StoreLimits {
            max_sessions: config.store.max_sessions,
            max_bytes: config.store.max_bytes,
            max_sessions_per_tenant: config.store.max_sessions_per_tenant,
            ttl: config.store_ttl(),
        })
        .with_breaker_cooldown(config.breaker_cooldown())
    };
    match config.store.backend {
        StoreBackend::Memory => Arc::new(memory()),
        StoreBackend::Redis => {
            let settings = RedisSettings {
                key_prefix: config.store.key_prefix.clone(),
                ttl: config.store_ttl(),
                timeout: config.redis_timeout(),
                max_shared_request_bytes: config.store.max_shared_request_bytes,
                breaker_cooldown: config.breaker_cooldown(),
                claim_ttl: CLAIM_TTL,
            };
            match RedisStore::new(&config.store.redis_url, settings, memory(), metrics) {
                Ok(redis) => Arc::new(redis),
                Err(e) => {
                    // Validation accepted the URL, so this is not expected; fail open.
                    tracing::error!(error = %e, "redis store unavailable; sessions stay in memory");
                    Arc::new(memory())
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latest_request_debug_hides_body_and_credentials() {
        let latest = LatestRequest {
            tenant: TenantId::ANONYMOUS,
            dialect: DialectKind::ChatCompletions,
            body: Bytes::from_static(br#"{"messages":[{"content":"private"}]}"#),
            caller: Arc::new(Caller {
                credentials: vec![("authorization".into(), "Bearer sk-secret".into())],
                ..Caller::default()
            }),
        };
        let shown = format!("{latest:?}");
        assert!(
            !shown.contains("sk-secret") && !shown.contains("private"),
            "{shown}"
        );
        assert!(latest.approx_bytes() >= latest.body.len() + "Bearer sk-secret".len());
    }

    #[test]
    fn session_info_serialises_the_latest_checkpoint() {
        let checkpoint = Checkpoint {
            session_id: "s".into(),
            covered: 4,
            head: None,
            result: CompactionResult {
                summary: "did things".into(),
                read_files: vec!["a.rs".into()],
                modified_files: vec![],
                pre_tokens: 1000,
                post_tokens: 200,
                compaction_num: 1,
            },
            created_unix: 7,
            staged: None,
        };
        let info = SessionInfo {
            id: "s".into(),
            tenant: TenantId::ANONYMOUS,
            compactions: 1,
            latest: Some(Arc::new(checkpoint)),
            checkpoints: 1,
            messages_seen: 9,
            created_unix: 1,
            last_seen_unix: 2,
            breaker: BreakerState::Closed,
            consecutive_failures: 0,
            has_latest_request: true,
            cost: None,
        };
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["latest"]["covered"], 4);
        assert_eq!(json["latest"]["summary"], "did things");
        assert_eq!(json["latest"]["read_files"][0], "a.rs");
        assert_eq!(json["tenant"], "000000000000");
        assert_eq!(json["breaker"], "closed");
    }

    #[test]
    fn a_mask_floor_moves_by_whole_steps_and_restarts_after_a_newer_summary() {
        let need = |enough, step| MaskNeed { enough, step };
        let floor = |covered, masked| MaskFloor { covered, masked };
        let raise = MaskFloor::raise;
        assert_eq!(raise(None, 0, need(0, 0)), (floor(0, 0), 0));
        // Over the trigger, masking moves a whole step.
        assert_eq!(raise(None, 0, need(2, 6)), (floor(0, 6), 6));
        // While the floor is enough it stays, however much a step would be.
        assert_eq!(raise(Some(floor(0, 6)), 0, need(0, 0)), (floor(0, 6), 6));
        assert_eq!(raise(Some(floor(0, 6)), 0, need(6, 9)), (floor(0, 6), 6));
        // When it is not, it moves by the next step.
        assert_eq!(raise(Some(floor(0, 6)), 0, need(7, 11)), (floor(0, 11), 11));
        // A newer summary starts over, even from nothing masked.
        assert_eq!(raise(Some(floor(0, 11)), 20, need(0, 0)), (floor(20, 0), 0));
        // A step that cannot reach `enough` is not taken.
        assert_eq!(
            raise(Some(floor(0, 11)), 0, need(13, 0)),
            (floor(0, 11), 11)
        );
        assert_eq!(raise(None, 0, need(3, 0)), (floor(0, 0), 0));
        // An older branch masks what it needs and leaves the floor alone.
        assert_eq!(raise(Some(floor(20, 4)), 0, need(1, 5)), (floor(20, 4), 1));
    }
}
