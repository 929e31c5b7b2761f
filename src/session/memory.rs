//! The in-memory [`SessionStore`]: the default backend, bounded by sessions, bytes and TTL,
//! with a fair share of both per tenant.
//!
//! Everything sits behind one `std::sync::Mutex` (never held across an await: every trait
//! method does its work synchronously and returns a ready future). Sessions are ordered by
//! last use in a `BTreeMap<tick, key>` beside the `HashMap`, so evicting the least recently
//! used and expiring the stale are O(log n) each; expiry is lazy, checked at the front of that
//! order on every call. A session owns its checkpoints and takes them along when it goes.
//!
//! Each tenant also has its own last-use order and byte count, kept in step with the global
//! ones, so that a write first evicts the writing tenant's own least recently used sessions
//! while it is over its share ([`StoreLimits::tenant_share`]), in O(log n) as well, and only
//! then the global least recently used. A tenant flooding new sessions thus only ever evicts
//! its own once it holds its share: one credential cannot empty the store of everyone else's
//! summaries.
//!
//! A tenant no provider has accepted yet (no request of its answered with a success,
//! [`ProviderAnswer`]) is *unconfirmed*: its sessions also sit in a last-use order of their
//! own, and the global bounds evict from that order first, so sessions of credentials nobody
//! accepts (made up, revoked, mistyped) only ever push out each other, never a confirmed
//! tenant's. A refusal as unauthorised removes the refused request's session outright. The
//! confirmed tenants are remembered apart from their sessions (a tenant whose first session
//! was evicted before its answer came is still confirmed by it), at most `max_sessions` of
//! them, the least recently accepted forgotten first.
//!
//! Lookups by chain hash probe only the prefix lengths some checkpoint of the tenant covers,
//! longest first, instead of every hash of the request.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use compactor_plugin_api::BoxFuture;

use super::breaker::Breaker;
use super::hash::{ChainHash, TenantId};
use super::openings::Openings;
use super::store::{
    unix_now, Checkpoint, LatestRequest, MaskFloor, MaskNeed, ProviderAnswer, SessionCost,
    SessionInfo, SessionStore, StoreError, StoreLimits, StoreStats, SESSION_OVERHEAD_BYTES,
};
use super::windows::LearnedWindows;
use crate::compaction::models::{LearnedWindow, WindowKey};

/// The maps' hasher: foldhash, randomly seeded per map. SipHash was most of the store's work
/// on a small request (several lookups each); a seed a client cannot learn keeps the keys a
/// client chooses (session ids from a header) from being aimed at one bucket.
type Fast = foldhash::fast::RandomState;

/// Checkpoints kept per session; the oldest beyond this are dropped (the newest covers the
/// longest prefix, older ones only serve retried or forked requests).
pub const MAX_CHECKPOINTS_PER_SESSION: usize = 8;

/// Breaker cooldown unless [`MemoryStore::with_breaker_cooldown`] says otherwise (matches the
/// `compaction.breaker_cooldown_secs` default).
pub const DEFAULT_BREAKER_COOLDOWN: Duration = Duration::from_secs(300);

/// A source of monotonic time; injectable so tests move time instead of sleeping.
pub type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

/// The bounded in-memory store. See the module docs.
pub struct MemoryStore {
    limits: StoreLimits,
    breaker_cooldown: Duration,
    clock: Clock,
    inner: Mutex<Inner>,
    /// Apart from the sessions: read on every request, learned rarely, and never evicted with
    /// a session.
    windows: Mutex<LearnedWindows>,
    /// Which conversation owns each derived opening id: as many as sessions may be held.
    openings: Mutex<Openings>,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("limits", &self.limits)
            .field("stats", &self.lock().stats())
            .finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// An empty store within `limits`, on the system clock.
    pub fn new(limits: StoreLimits) -> MemoryStore {
        MemoryStore {
            limits,
            breaker_cooldown: DEFAULT_BREAKER_COOLDOWN,
            clock: Arc::new(Instant::now),
            inner: Mutex::new(Inner::default()),
            windows: Mutex::default(),
            openings: Mutex::new(Openings::new(limits.max_sessions)),
        }
    }

    /// The opening claims (recovered from poisoning: every operation leaves them whole).
    fn openings(&self) -> MutexGuard<'_, Openings> {
        self.openings.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The owner of `opening` this process knows of (a shared store's cache).
    pub fn known_opening(&self, tenant: TenantId, opening: &str) -> Option<String> {
        self.openings().owner(tenant, opening).map(str::to_string)
    }

    /// Remembers the owner of `opening` a shared store answered.
    pub fn learn_opening(&self, tenant: TenantId, opening: &str, owner: &str) {
        self.openings().learn(tenant, opening, owner);
    }

    /// Sets how long a session's breaker stays open (`compaction.breaker_cooldown_secs`).
    pub fn with_breaker_cooldown(mut self, cooldown: Duration) -> MemoryStore {
        self.breaker_cooldown = cooldown;
        self
    }

    /// Replaces the clock (tests).
    pub fn with_clock(mut self, clock: Clock) -> MemoryStore {
        self.clock = clock;
        self
    }

    /// Sessions held (after dropping expired ones): the `compactor_sessions` gauge.
    pub fn len(&self) -> usize {
        self.stats().sessions
    }

    /// Whether no session is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sessions evicted for space since start: `compactor_store_evictions_total`.
    pub fn evictions(&self) -> u64 {
        self.lock().evictions
    }

    /// All counters at once (after dropping expired sessions).
    pub fn stats(&self) -> StoreStats {
        self.fresh().stats()
    }

    fn windows(&self) -> MutexGuard<'_, LearnedWindows> {
        // Each learn leaves the table consistent before anything can panic.
        self.windows.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every mutation keeps the maps consistent before it can panic, so a poisoned lock
        // still guards valid data.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lock, with expired sessions already gone.
    fn fresh(&self) -> MutexGuard<'_, Inner> {
        let now = (self.clock)();
        let mut inner = self.lock();
        inner.expire(now, self.limits.ttl);
        inner
    }

    fn longest(&self, tenant: TenantId, hashes: &[ChainHash]) -> Option<Arc<Checkpoint>> {
        let now = (self.clock)();
        let mut inner = self.fresh();
        let (owner, checkpoint) = inner.longest(tenant, hashes)?;
        inner.bump(&owner, now);
        Some(checkpoint)
    }

    fn put(
        &self,
        tenant: TenantId,
        hash: ChainHash,
        checkpoint: Arc<Checkpoint>,
    ) -> Result<(), StoreError> {
        if checkpoint.covered == 0 {
            return Err(StoreError::EmptyCheckpoint);
        }
        let now = (self.clock)();
        let mut inner = self.fresh();
        // A staged checkpoint stored again in use is the same compaction, not a new one.
        let promotion = inner.checkpoints.get(&hash).is_some_and(|old| {
            old.checkpoint.staged.is_some()
                && checkpoint.staged.is_none()
                && old.checkpoint.result.summary == checkpoint.result.summary
        });
        inner.remove_checkpoint(&hash);
        let key = SessionKey::new(tenant, &checkpoint.session_id);
        let entry = inner.entry(&key, now, self.breaker_cooldown);
        if !promotion {
            entry.compactions = entry.compactions.saturating_add(1);
        }
        entry.messages_seen = entry.messages_seen.max(checkpoint.covered);
        entry.latest = Some(checkpoint.clone());
        entry.checkpoints.push_back(hash);
        let overflow = if entry.checkpoints.len() > MAX_CHECKPOINTS_PER_SESSION {
            entry.checkpoints.pop_front()
        } else {
            None
        };
        let bytes = checkpoint.approx_bytes();
        *inner
            .covered
            .entry(tenant)
            .or_default()
            .entry(checkpoint.covered)
            .or_default() += 1;
        inner.add_bytes(tenant, bytes);
        inner.checkpoints.insert(
            hash,
            StoredCheckpoint {
                owner: key,
                checkpoint,
                bytes,
            },
        );
        if let Some(oldest) = overflow {
            inner.remove_checkpoint(&oldest);
        }
        inner.enforce(tenant, &self.limits);
        Ok(())
    }

    fn touch(&self, tenant: TenantId, id: &str, latest: LatestRequest, messages_seen: usize) {
        let now = (self.clock)();
        let mut inner = self.fresh();
        let key = SessionKey::new(tenant, id);
        let entry = inner.entry(&key, now, self.breaker_cooldown);
        let new_bytes = latest.approx_bytes();
        let old_bytes = std::mem::replace(&mut entry.request_bytes, new_bytes);
        entry.latest_request = Some(latest);
        entry.messages_seen = messages_seen;
        inner.sub_bytes(tenant, old_bytes);
        inner.add_bytes(tenant, new_bytes);
        inner.enforce(tenant, &self.limits);
    }

    fn info(&self, id: &str) -> Option<SessionInfo> {
        let now = (self.clock)();
        let inner = self.fresh();
        let key = inner.find(id)?;
        inner.info(key, now)
    }

    fn latest(&self, id: &str) -> Option<LatestRequest> {
        let inner = self.fresh();
        let key = inner.find(id)?;
        inner.sessions.get(key)?.latest_request.clone()
    }

    fn list(&self, limit: usize) -> Vec<SessionInfo> {
        let now = (self.clock)();
        let inner = self.fresh();
        inner
            .lru
            .values()
            .rev()
            .take(limit)
            .filter_map(|key| inner.info(key, now))
            .collect()
    }

    fn allowed(&self, tenant: TenantId, id: &str) -> bool {
        let now = (self.clock)();
        let mut inner = self.fresh();
        inner
            .sessions
            .get_mut(&SessionKey::new(tenant, id))
            .is_none_or(|entry| entry.breaker.allow(now))
    }

    fn answered(&self, tenant: TenantId, id: &str, answer: ProviderAnswer) {
        let mut inner = self.fresh();
        match answer {
            ProviderAnswer::Accepted => inner.confirm(tenant, self.limits.max_sessions),
            ProviderAnswer::Unauthorised if !inner.confirmed.contains(tenant) => {
                inner.remove_session(&SessionKey::new(tenant, id));
            }
            ProviderAnswer::Unauthorised => {}
        }
        #[cfg(test)]
        inner.assert_consistent();
    }

    fn add_cost(&self, tenant: TenantId, id: &str, cost: SessionCost) {
        let mut inner = self.fresh();
        if let Some(entry) = inner.sessions.get_mut(&SessionKey::new(tenant, id)) {
            entry.cost = Some(entry.cost.unwrap_or_default().plus(cost));
        }
    }

    fn record(&self, tenant: TenantId, id: &str, succeeded: bool) -> bool {
        let now = (self.clock)();
        let mut inner = self.fresh();
        let Some(entry) = inner.sessions.get_mut(&SessionKey::new(tenant, id)) else {
            return false;
        };
        if succeeded {
            entry.breaker.record_success();
            false
        } else {
            entry.breaker.record_failure(now)
        }
    }
}

impl SessionStore for MemoryStore {
    fn longest_checkpoint<'a>(
        &'a self,
        tenant: TenantId,
        hashes: &'a [ChainHash],
    ) -> BoxFuture<'a, Result<Option<Arc<Checkpoint>>, StoreError>> {
        Box::pin(std::future::ready(Ok(self.longest(tenant, hashes))))
    }

    fn put_checkpoint(
        &self,
        tenant: TenantId,
        hash: ChainHash,
        checkpoint: Arc<Checkpoint>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(self.put(tenant, hash, checkpoint)))
    }

    fn touch_session<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        latest: LatestRequest,
        messages_seen: usize,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.touch(tenant, id, latest, messages_seen);
        Box::pin(std::future::ready(Ok(())))
    }

    fn claim_opening<'a>(
        &'a self,
        tenant: TenantId,
        opening: &'a str,
        candidate: &'a str,
    ) -> BoxFuture<'a, Result<String, StoreError>> {
        let owner = self.openings().claim(tenant, opening, candidate);
        Box::pin(std::future::ready(Ok(owner)))
    }

    fn provider_answered<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        answer: ProviderAnswer,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.answered(tenant, id, answer);
        Box::pin(std::future::ready(Ok(())))
    }

    fn session<'a>(
        &'a self,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<SessionInfo>, StoreError>> {
        Box::pin(std::future::ready(Ok(self.info(id))))
    }

    fn record_cost<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        cost: SessionCost,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.add_cost(tenant, id, cost);
        Box::pin(std::future::ready(Ok(())))
    }

    fn latest_request<'a>(
        &'a self,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<LatestRequest>, StoreError>> {
        Box::pin(std::future::ready(Ok(self.latest(id))))
    }

    fn list_sessions(&self, limit: usize) -> BoxFuture<'_, Result<Vec<SessionInfo>, StoreError>> {
        Box::pin(std::future::ready(Ok(self.list(limit))))
    }

    fn compaction_allowed<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(std::future::ready(Ok(self.allowed(tenant, id))))
    }

    fn record_compaction<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        succeeded: bool,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(std::future::ready(Ok(self.record(tenant, id, succeeded))))
    }

    fn raise_mask_floor<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        covered: usize,
        need: MaskNeed,
    ) -> BoxFuture<'a, Result<usize, StoreError>> {
        let mut inner = self.fresh();
        let answer = match inner.sessions.get_mut(&SessionKey::new(tenant, id)) {
            Some(entry) => {
                let (floor, answer) = MaskFloor::raise(entry.mask_floor, covered, need);
                entry.mask_floor = Some(floor);
                answer
            }
            None => need.enough,
        };
        Box::pin(std::future::ready(Ok(answer)))
    }

    fn max_covered(&self, tenant: TenantId) -> BoxFuture<'_, Result<usize, StoreError>> {
        let max = self
            .fresh()
            .covered
            .get(&tenant)
            .and_then(|lengths| lengths.keys().next_back().copied())
            .unwrap_or(0);
        Box::pin(std::future::ready(Ok(max)))
    }

    fn stats(&self) -> BoxFuture<'_, Result<StoreStats, StoreError>> {
        Box::pin(std::future::ready(Ok(MemoryStore::stats(self))))
    }

    fn learned_window<'a>(
        &'a self,
        upstream: &'a str,
        model: &'a str,
    ) -> BoxFuture<'a, Result<Option<LearnedWindow>, StoreError>> {
        Box::pin(std::future::ready(Ok(self.windows().get(upstream, model))))
    }

    fn learn_window<'a>(
        &'a self,
        key: &'a WindowKey,
        window: LearnedWindow,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(std::future::ready(Ok(self
            .windows()
            .learn(key.clone(), window))))
    }

    fn learned_windows(
        &self,
    ) -> BoxFuture<'_, Result<Vec<(WindowKey, LearnedWindow)>, StoreError>> {
        Box::pin(std::future::ready(Ok(self.windows().list())))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SessionKey {
    tenant: TenantId,
    id: Arc<str>,
}

impl SessionKey {
    fn new(tenant: TenantId, id: &str) -> SessionKey {
        SessionKey {
            tenant,
            id: Arc::from(id),
        }
    }
}

struct SessionEntry {
    /// Position in `Inner::lru`.
    tick: u64,
    last_seen: Instant,
    last_seen_unix: u64,
    created_unix: u64,
    compactions: u32,
    latest: Option<Arc<Checkpoint>>,
    latest_request: Option<LatestRequest>,
    /// `latest_request`'s share of `Inner::bytes`.
    request_bytes: usize,
    messages_seen: usize,
    /// Hashes of the checkpoints this session owns, oldest first.
    checkpoints: VecDeque<ChainHash>,
    breaker: Breaker,
    /// How far `hybrid` has masked the conversation.
    mask_floor: Option<MaskFloor>,
    /// What its requests cost ([`SessionStore::record_cost`]).
    cost: Option<SessionCost>,
}

struct StoredCheckpoint {
    owner: SessionKey,
    checkpoint: Arc<Checkpoint>,
    /// Its share of `Inner::bytes`.
    bytes: usize,
}

/// One tenant's part of the store, so its share can be enforced without scanning everyone's
/// sessions.
#[derive(Default)]
struct TenantUsage {
    /// Its sessions by last use, least recent first (the same ticks as `Inner::lru`).
    lru: BTreeMap<u64, Arc<str>>,
    /// Its part of `Inner::bytes`.
    bytes: usize,
}

/// Tenants a provider has accepted, by when it last did: at most a capacity of them, the
/// least recently accepted forgotten first.
#[derive(Default)]
struct Confirmed {
    by_tenant: HashMap<TenantId, u64, Fast>,
    order: BTreeMap<u64, TenantId>,
}

impl Confirmed {
    fn contains(&self, tenant: TenantId) -> bool {
        self.by_tenant.contains_key(&tenant)
    }

    /// Marks `tenant` accepted at `tick`; answers whether it is new, and the tenant forgotten
    /// to stay within `capacity`, if any.
    fn insert(&mut self, tenant: TenantId, tick: u64, capacity: usize) -> (bool, Option<TenantId>) {
        let old = self.by_tenant.insert(tenant, tick);
        if let Some(old) = old {
            self.order.remove(&old);
        }
        self.order.insert(tick, tenant);
        let forgotten = if self.by_tenant.len() > capacity.max(1) {
            self.order.pop_first().map(|(_, gone)| {
                self.by_tenant.remove(&gone);
                gone
            })
        } else {
            None
        };
        (old.is_none(), forgotten)
    }
}

#[derive(Default)]
struct Inner {
    sessions: HashMap<SessionKey, SessionEntry, Fast>,
    /// Last-use order: the first entry is the least recently used.
    lru: BTreeMap<u64, SessionKey>,
    /// The same order for the sessions of unconfirmed tenants only: evicted first.
    unconfirmed: BTreeMap<u64, SessionKey>,
    confirmed: Confirmed,
    /// Admin lookups by id alone: the tenants having a session with that id.
    by_id: HashMap<Arc<str>, Vec<TenantId>, Fast>,
    checkpoints: HashMap<ChainHash, StoredCheckpoint, Fast>,
    /// Per tenant, how many checkpoints cover each prefix length: the lengths worth probing.
    covered: HashMap<TenantId, BTreeMap<usize, usize>, Fast>,
    /// Per tenant, its sessions and bytes: an entry exists while the tenant has a session.
    tenants: HashMap<TenantId, TenantUsage, Fast>,
    tick: u64,
    bytes: usize,
    evictions: u64,
    expirations: u64,
}

fn session_bytes(id: &str) -> usize {
    SESSION_OVERHEAD_BYTES + id.len()
}

impl Inner {
    fn stats(&self) -> StoreStats {
        StoreStats {
            sessions: self.sessions.len(),
            checkpoints: self.checkpoints.len(),
            bytes: self.bytes,
            evictions: self.evictions,
            expirations: self.expirations,
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// The session `key`, created if new, marked as used at `now`.
    fn entry(&mut self, key: &SessionKey, now: Instant, cooldown: Duration) -> &mut SessionEntry {
        let tick = self.next_tick();
        let unix = unix_now();
        self.lru.insert(tick, key.clone());
        let unconfirmed = !self.confirmed.contains(key.tenant);
        if unconfirmed {
            self.unconfirmed.insert(tick, key.clone());
        }
        let usage = self.tenants.entry(key.tenant).or_default();
        usage.lru.insert(tick, key.id.clone());
        match self.sessions.entry(key.clone()) {
            Entry::Occupied(occupied) => {
                let entry = occupied.into_mut();
                self.lru.remove(&entry.tick);
                if unconfirmed {
                    self.unconfirmed.remove(&entry.tick);
                }
                usage.lru.remove(&entry.tick);
                entry.tick = tick;
                entry.last_seen = now;
                entry.last_seen_unix = unix;
                entry
            }
            Entry::Vacant(vacant) => {
                let bytes = session_bytes(&key.id);
                self.bytes += bytes;
                usage.bytes += bytes;
                self.by_id
                    .entry(key.id.clone())
                    .or_default()
                    .push(key.tenant);
                vacant.insert(SessionEntry {
                    tick,
                    last_seen: now,
                    last_seen_unix: unix,
                    created_unix: unix,
                    compactions: 0,
                    latest: None,
                    latest_request: None,
                    request_bytes: 0,
                    messages_seen: 0,
                    checkpoints: VecDeque::new(),
                    breaker: Breaker::new(cooldown),
                    mask_floor: None,
                    cost: None,
                })
            }
        }
    }

    /// Panics unless the per-tenant orders and byte counts agree with the sessions they
    /// summarise (tests: every eviction path must keep them in step).
    #[cfg(test)]
    fn assert_consistent(&self) {
        let mut expected: HashMap<TenantId, (usize, usize)> = HashMap::new();
        for (key, entry) in &self.sessions {
            let owned: usize = entry
                .checkpoints
                .iter()
                .filter_map(|hash| self.checkpoints.get(hash))
                .map(|stored| stored.bytes)
                .sum();
            let (count, bytes) = expected.entry(key.tenant).or_default();
            *count += 1;
            *bytes += session_bytes(&key.id) + entry.request_bytes + owned;
            let usage = &self.tenants[&key.tenant];
            assert_eq!(usage.lru.get(&entry.tick), Some(&key.id));
        }
        let actual: HashMap<TenantId, (usize, usize)> = self
            .tenants
            .iter()
            .map(|(tenant, usage)| (*tenant, (usage.lru.len(), usage.bytes)))
            .collect();
        assert_eq!(actual, expected);
        let total: usize = expected.values().map(|(_, bytes)| bytes).sum();
        assert_eq!(total, self.bytes);
        assert_eq!(self.lru.len(), self.sessions.len());
        let unconfirmed: BTreeMap<u64, SessionKey> = self
            .sessions
            .iter()
            .filter(|(key, _)| !self.confirmed.contains(key.tenant))
            .map(|(key, entry)| (entry.tick, key.clone()))
            .collect();
        assert_eq!(unconfirmed, self.unconfirmed);
        assert_eq!(self.confirmed.by_tenant.len(), self.confirmed.order.len());
    }

    /// Marks an existing session as used at `now`.
    fn bump(&mut self, key: &SessionKey, now: Instant) {
        let tick = self.next_tick();
        if let Some(entry) = self.sessions.get_mut(key) {
            self.lru.remove(&entry.tick);
            self.lru.insert(tick, key.clone());
            if self.unconfirmed.remove(&entry.tick).is_some() {
                self.unconfirmed.insert(tick, key.clone());
            }
            if let Some(usage) = self.tenants.get_mut(&key.tenant) {
                usage.lru.remove(&entry.tick);
                usage.lru.insert(tick, key.id.clone());
            }
            entry.tick = tick;
            entry.last_seen = now;
            entry.last_seen_unix = unix_now();
        }
    }

    fn longest(
        &self,
        tenant: TenantId,
        hashes: &[ChainHash],
    ) -> Option<(SessionKey, Arc<Checkpoint>)> {
        // `range(1..=0)` would panic: an empty message list matches nothing.
        if hashes.is_empty() {
            return None;
        }
        let lengths = self.covered.get(&tenant)?;
        lengths
            .range(1..=hashes.len())
            .rev()
            .find_map(|(&covered, _)| {
                let stored = self.checkpoints.get(hashes.get(covered - 1)?)?;
                // The hash already commits to the tenant and the length; this guards against
                // a caller passing hashes of another chain.
                (stored.checkpoint.covered == covered && stored.owner.tenant == tenant)
                    .then(|| (stored.owner.clone(), stored.checkpoint.clone()))
            })
    }

    /// The most recently used session with this id, any tenant.
    fn find(&self, id: &str) -> Option<&SessionKey> {
        let tenants = self.by_id.get(id)?;
        tenants
            .iter()
            .filter_map(|tenant| {
                let (key, entry) = self.sessions.get_key_value(&SessionKey::new(*tenant, id))?;
                Some((entry.tick, key))
            })
            .max_by_key(|(tick, _)| *tick)
            .map(|(_, key)| key)
    }

    fn info(&self, key: &SessionKey, now: Instant) -> Option<SessionInfo> {
        let entry = self.sessions.get(key)?;
        Some(SessionInfo {
            id: key.id.to_string(),
            tenant: key.tenant,
            compactions: entry.compactions,
            latest: entry.latest.clone(),
            checkpoints: entry.checkpoints.len(),
            messages_seen: entry.messages_seen,
            created_unix: entry.created_unix,
            last_seen_unix: entry.last_seen_unix,
            breaker: entry.breaker.state(now),
            consecutive_failures: entry.breaker.consecutive_failures(),
            has_latest_request: entry.latest_request.is_some(),
            cost: entry.cost,
        })
    }

    fn remove_checkpoint(&mut self, hash: &ChainHash) {
        let Some(stored) = self.checkpoints.remove(hash) else {
            return;
        };
        let tenant = stored.owner.tenant;
        self.sub_bytes(tenant, stored.bytes);
        if let Some(lengths) = self.covered.get_mut(&tenant) {
            if let Some(count) = lengths.get_mut(&stored.checkpoint.covered) {
                *count -= 1;
                if *count == 0 {
                    lengths.remove(&stored.checkpoint.covered);
                }
            }
            if lengths.is_empty() {
                self.covered.remove(&tenant);
            }
        }
        if let Some(owner) = self.sessions.get_mut(&stored.owner) {
            owner.checkpoints.retain(|h| h != hash);
        }
    }

    fn remove_session(&mut self, key: &SessionKey) {
        let Some(entry) = self.sessions.remove(key) else {
            return;
        };
        self.lru.remove(&entry.tick);
        self.unconfirmed.remove(&entry.tick);
        if let Some(usage) = self.tenants.get_mut(&key.tenant) {
            usage.lru.remove(&entry.tick);
        }
        self.sub_bytes(key.tenant, session_bytes(&key.id) + entry.request_bytes);
        if let Some(tenants) = self.by_id.get_mut(&key.id) {
            tenants.retain(|t| *t != key.tenant);
            if tenants.is_empty() {
                self.by_id.remove(&key.id);
            }
        }
        for hash in &entry.checkpoints {
            self.remove_checkpoint(hash);
        }
        // Only now: the checkpoints above still had bytes to take off the tenant's count.
        if self
            .tenants
            .get(&key.tenant)
            .is_some_and(|usage| usage.lru.is_empty())
        {
            self.tenants.remove(&key.tenant);
        }
    }

    fn add_bytes(&mut self, tenant: TenantId, bytes: usize) {
        self.bytes += bytes;
        self.tenants.entry(tenant).or_default().bytes += bytes;
    }

    fn sub_bytes(&mut self, tenant: TenantId, bytes: usize) {
        self.bytes = self.bytes.saturating_sub(bytes);
        if let Some(usage) = self.tenants.get_mut(&tenant) {
            usage.bytes = usage.bytes.saturating_sub(bytes);
        }
    }

    /// A provider accepted a request of `tenant`: its sessions leave the unconfirmed order
    /// (and those of a tenant forgotten to keep at most `capacity` confirmed rejoin it).
    fn confirm(&mut self, tenant: TenantId, capacity: usize) {
        let tick = self.next_tick();
        let (new, forgotten) = self.confirmed.insert(tenant, tick, capacity);
        if new {
            if let Some(usage) = self.tenants.get(&tenant) {
                for tick in usage.lru.keys() {
                    self.unconfirmed.remove(tick);
                }
            }
        }
        if let Some(gone) = forgotten {
            if let Some(usage) = self.tenants.get(&gone) {
                for (tick, id) in &usage.lru {
                    let key = SessionKey {
                        tenant: gone,
                        id: id.clone(),
                    };
                    self.unconfirmed.insert(*tick, key);
                }
            }
        }
    }

    /// Drops sessions not used for longer than `ttl`, oldest first.
    fn expire(&mut self, now: Instant, ttl: Duration) {
        while let Some((&tick, key)) = self.lru.first_key_value() {
            let key = key.clone();
            match self.sessions.get(&key) {
                Some(entry) if now.saturating_duration_since(entry.last_seen) > ttl => {
                    self.remove_session(&key);
                    self.expirations += 1;
                }
                Some(_) => break,
                // Unreachable while the maps agree; never loop on a stray tick.
                None => {
                    self.lru.remove(&tick);
                }
            }
        }
        #[cfg(test)]
        self.assert_consistent();
    }

    /// After a write by `tenant`: evicts its own least recently used sessions until it is
    /// within its share, then the least recently used of anyone until the store is within
    /// `limits`. The share never exceeds the store ([`StoreLimits::tenant_share`]), so the
    /// second loop evicts only when other tenants hold the rest of the store: a tenant
    /// creating sessions without end reaches its share and from then on replaces its own.
    fn enforce(&mut self, tenant: TenantId, limits: &StoreLimits) {
        let (tenant_sessions, tenant_bytes) = limits.tenant_share();
        while let Some(usage) = self.tenants.get_mut(&tenant) {
            if usage.lru.len() <= tenant_sessions && usage.bytes <= tenant_bytes {
                break;
            }
            let Some((_, id)) = usage.lru.pop_first() else {
                break;
            };
            let key = SessionKey { tenant, id };
            if self.sessions.contains_key(&key) {
                self.remove_session(&key);
                self.evictions += 1;
            }
        }
        while self.sessions.len() > limits.max_sessions || self.bytes > limits.max_bytes {
            // Unconfirmed tenants' sessions go first: see the module docs.
            let Some((_, key)) = self
                .unconfirmed
                .pop_first()
                .or_else(|| self.lru.pop_first())
            else {
                break;
            };
            if self.sessions.contains_key(&key) {
                self.remove_session(&key);
                self.evictions += 1;
            }
        }
        // Every write ends here: in the unit tests, check the per-tenant books after each.
        #[cfg(test)]
        self.assert_consistent();
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::compaction::CompactionResult;
    use crate::dialect::DialectKind;
    use crate::session::breaker::BreakerState;
    use crate::session::hash::chain;

    const TTL: Duration = Duration::from_secs(600);

    #[derive(Clone)]
    struct ManualClock(Arc<Mutex<Instant>>);

    impl ManualClock {
        fn new() -> ManualClock {
            ManualClock(Arc::new(Mutex::new(Instant::now())))
        }
        fn advance(&self, by: Duration) {
            *self.0.lock().unwrap() += by;
        }
        fn clock(&self) -> Clock {
            let me = self.clone();
            Arc::new(move || *me.0.lock().unwrap())
        }
    }

    /// One tenant may use the whole store (the tests of the global bounds).
    fn limits(max_sessions: usize, max_bytes: usize) -> StoreLimits {
        shared(max_sessions, max_bytes, max_sessions)
    }

    fn shared(max_sessions: usize, max_bytes: usize, per_tenant: usize) -> StoreLimits {
        StoreLimits {
            max_sessions,
            max_bytes,
            max_sessions_per_tenant: per_tenant,
            ttl: TTL,
        }
    }

    fn store(limits: StoreLimits) -> (MemoryStore, ManualClock) {
        let clock = ManualClock::new();
        let store = MemoryStore::new(limits)
            .with_clock(clock.clock())
            .with_breaker_cooldown(Duration::from_secs(60));
        (store, clock)
    }

    fn tenant(name: &str) -> TenantId {
        TenantId::from_credential(name)
    }

    /// The chain of user messages with these contents.
    fn chain_of(tenant: &TenantId, contents: &[String]) -> Vec<ChainHash> {
        let owned: Vec<String> = contents
            .iter()
            .map(|c| serde_json::json!({"role": "user", "content": c}).to_string())
            .collect();
        let refs: Vec<&str> = owned.iter().map(String::as_str).collect();
        chain(tenant, &refs).unwrap()
    }

    /// The chain of a conversation of `n` messages whose `k`-th says `"{text}{k}"`.
    fn conversation(tenant: &TenantId, text: &str, n: usize) -> Vec<ChainHash> {
        let contents: Vec<String> = (0..n).map(|k| format!("{text}{k}")).collect();
        chain_of(tenant, &contents)
    }

    fn checkpoint(session: &str, covered: usize, summary: &str) -> Arc<Checkpoint> {
        Arc::new(Checkpoint {
            session_id: session.into(),
            covered,
            head: None,
            result: CompactionResult {
                summary: summary.into(),
                read_files: vec!["src/a.rs".into()],
                modified_files: vec!["src/b.rs".into()],
                pre_tokens: 10_000,
                post_tokens: 2_000,
                compaction_num: 1,
            },
            created_unix: 0,
            staged: None,
        })
    }

    fn request(body_len: usize) -> LatestRequest {
        LatestRequest {
            tenant: TenantId::ANONYMOUS,
            dialect: DialectKind::ChatCompletions,
            body: Bytes::from(vec![b'x'; body_len]),
            caller: Arc::default(),
        }
    }

    async fn put(s: &MemoryStore, t: TenantId, hashes: &[ChainHash], cp: Arc<Checkpoint>) {
        let hash = hashes[cp.covered - 1];
        s.put_checkpoint(t, hash, cp).await.unwrap();
    }

    async fn touch(s: &MemoryStore, t: TenantId, id: &str) {
        s.touch_session(t, id, request(100), 1).await.unwrap();
    }

    /// Ids held by one tenant, most recently used first.
    async fn ids_of(s: &MemoryStore, t: TenantId) -> Vec<String> {
        let list = s.list_sessions(usize::MAX).await.unwrap();
        list.into_iter()
            .filter(|i| i.tenant == t)
            .map(|i| i.id)
            .collect()
    }

    async fn ids(s: &MemoryStore) -> Vec<String> {
        let list = s.list_sessions(usize::MAX).await.unwrap();
        list.into_iter().map(|i| i.id).collect()
    }

    async fn found(s: &MemoryStore, t: TenantId, hashes: &[ChainHash]) -> Option<usize> {
        let hit = s.longest_checkpoint(t, hashes).await.unwrap();
        hit.map(|cp| cp.covered)
    }

    #[tokio::test]
    async fn the_longest_matching_checkpoint_wins() {
        let (s, _) = store(limits(100, usize::MAX));
        let t = tenant("k1");
        let conv = conversation(&t, "m", 10);
        for covered in [2, 6, 4] {
            put(
                &s,
                t,
                &conv,
                checkpoint("s1", covered, &format!("up to {covered}")),
            )
            .await;
        }
        assert_eq!(found(&s, t, &conv).await, Some(6));
        assert_eq!(found(&s, t, &conv[..6]).await, Some(6));
        assert_eq!(found(&s, t, &conv[..5]).await, Some(4));
        assert_eq!(found(&s, t, &conv[..3]).await, Some(2));
        assert_eq!(found(&s, t, &conv[..1]).await, None);
        // An empty message list matches nothing (it used to panic on an inverted range).
        assert_eq!(found(&s, t, &[]).await, None);
        let hit = s.longest_checkpoint(t, &conv).await.unwrap().unwrap();
        assert_eq!(hit.result.summary, "up to 6");

        // A history edited at message 5 keeps only the checkpoints before the edit.
        let mut contents: Vec<String> = (0..10).map(|k| format!("m{k}")).collect();
        contents[4] = "edited".into();
        let edited = chain_of(&t, &contents);
        assert_eq!(edited[..4], conv[..4]);
        assert_eq!(found(&s, t, &edited).await, Some(4));

        // Same content, another credential: nothing.
        let other = tenant("k2");
        assert_eq!(found(&s, other, &conversation(&other, "m", 10)).await, None);
        assert_eq!(found(&s, other, &conv).await, None);
    }

    #[tokio::test]
    async fn sessions_expire_after_ttl_with_their_checkpoints() {
        let (s, clock) = store(limits(100, usize::MAX));
        let t = tenant("k");
        let old = conversation(&t, "old", 3);
        put(&s, t, &old, checkpoint("old", 2, "old summary")).await;
        touch(&s, t, "old").await;
        clock.advance(TTL / 2);
        touch(&s, t, "new").await;
        clock.advance(TTL / 2);
        // Exactly `ttl` unused: still there.
        assert!(s.session("old").await.unwrap().is_some());
        clock.advance(Duration::from_millis(1));
        assert!(s.session("old").await.unwrap().is_none());
        assert!(s.latest_request("old").await.unwrap().is_none());
        assert_eq!(found(&s, t, &old).await, None);
        assert_eq!(ids(&s).await, ["new"]);
        let stats = s.stats();
        assert_eq!((stats.sessions, stats.checkpoints), (1, 0));
        assert_eq!((stats.expirations, stats.evictions), (1, 0));
        clock.advance(TTL);
        assert!(s.is_empty());
    }

    #[tokio::test]
    async fn a_checkpoint_hit_keeps_its_session_alive() {
        let (s, clock) = store(limits(100, usize::MAX));
        let t = tenant("k");
        let conv = conversation(&t, "m", 3);
        put(&s, t, &conv, checkpoint("s", 2, "x")).await;
        clock.advance(TTL);
        assert_eq!(found(&s, t, &conv).await, Some(2));
        clock.advance(TTL);
        assert_eq!(found(&s, t, &conv).await, Some(2));
    }

    #[tokio::test]
    async fn max_sessions_evicts_the_least_recently_used() {
        let (s, _) = store(limits(2, usize::MAX));
        let t = tenant("k");
        let b_conv = conversation(&t, "b", 4);
        touch(&s, t, "a").await;
        touch(&s, t, "b").await;
        put(&s, t, &b_conv, checkpoint("b", 3, "b summary")).await;
        touch(&s, t, "a").await; // a is now more recent than b
        touch(&s, t, "c").await;
        assert_eq!(ids(&s).await, ["c", "a"]);
        assert!(s.session("b").await.unwrap().is_none());
        assert_eq!(
            found(&s, t, &b_conv).await,
            None,
            "evicted with its session"
        );
        assert_eq!(s.evictions(), 1);
        assert_eq!(s.len(), 2);
        assert_eq!(s.stats().checkpoints, 0);
    }

    #[tokio::test]
    async fn max_bytes_evicts_the_least_recently_used() {
        // Measure one session's footprint, then allow room for three and a half.
        let (probe, _) = store(limits(100, usize::MAX));
        let t = tenant("k");
        probe
            .touch_session(t, "s0", request(10_000), 1)
            .await
            .unwrap();
        let one = probe.stats().bytes;
        assert!(one > 10_000);

        let (s, _) = store(limits(100, one * 7 / 2));
        for id in ["s0", "s1", "s2"] {
            s.touch_session(t, id, request(10_000), 1).await.unwrap();
        }
        assert_eq!(s.evictions(), 0);
        // Using s0 again makes s1 the least recently used.
        s.touch_session(t, "s0", request(10_000), 2).await.unwrap();
        s.touch_session(t, "s3", request(10_000), 1).await.unwrap();
        assert_eq!(ids(&s).await, ["s3", "s0", "s2"]);
        assert_eq!(s.evictions(), 1);
        assert!(s.stats().bytes <= one * 7 / 2);

        // A bigger checkpoint for s2 pushes out the now least recently used s0.
        let conv = conversation(&t, "m", 2);
        let base = (*checkpoint("s2", 2, "")).clone();
        let big = Arc::new(Checkpoint {
            result: CompactionResult {
                summary: "y".repeat(one / 2),
                ..base.result.clone()
            },
            ..base
        });
        put(&s, t, &conv, big).await;
        assert_eq!(ids(&s).await, ["s2", "s3"]);
        assert_eq!(found(&s, t, &conv).await, Some(2));
        assert_eq!(s.evictions(), 2);
    }

    #[tokio::test]
    async fn replacing_a_latest_request_updates_the_byte_count() {
        let (s, _) = store(limits(100, usize::MAX));
        let t = tenant("k");
        s.touch_session(t, "s", request(5_000), 1).await.unwrap();
        let big = s.stats().bytes;
        s.touch_session(t, "s", request(1_000), 2).await.unwrap();
        assert_eq!(s.stats().bytes, big - 4_000);
        let latest = s.latest_request("s").await.unwrap().unwrap();
        assert_eq!(latest.body.len(), 1_000);
    }

    #[tokio::test]
    async fn list_is_newest_first_and_limited() {
        let (s, _) = store(limits(100, usize::MAX));
        let t = tenant("k");
        for id in ["a", "b", "c"] {
            touch(&s, t, id).await;
        }
        touch(&s, t, "a").await;
        assert_eq!(ids(&s).await, ["a", "c", "b"]);
        let two = s.list_sessions(2).await.unwrap();
        assert_eq!(
            two.iter().map(|i| i.id.as_str()).collect::<Vec<_>>(),
            ["a", "c"]
        );
        // Reading does not count as use.
        s.session("b").await.unwrap();
        assert_eq!(ids(&s).await, ["a", "c", "b"]);
    }

    #[tokio::test]
    async fn session_info_reports_the_latest_checkpoint() {
        let (s, _) = store(limits(100, usize::MAX));
        let t = tenant("k");
        let conv = conversation(&t, "m", 8);
        s.touch_session(t, "s", request(10), 8).await.unwrap();
        put(&s, t, &conv, checkpoint("s", 3, "first")).await;
        put(&s, t, &conv, checkpoint("s", 6, "second")).await;
        let info = s.session("s").await.unwrap().unwrap();
        assert_eq!(info.compactions, 2);
        assert_eq!(info.checkpoints, 2);
        assert_eq!(info.messages_seen, 8);
        assert!(info.has_latest_request);
        let latest = info.latest.unwrap();
        assert_eq!(
            (latest.covered, latest.result.summary.as_str()),
            (6, "second")
        );
        assert_eq!(info.tenant, t);
    }

    #[tokio::test]
    async fn the_same_id_under_two_tenants_stays_apart() {
        let (s, _) = store(limits(100, usize::MAX));
        let (a, b) = (tenant("ka"), tenant("kb"));
        s.touch_session(a, "shared", request(10), 1).await.unwrap();
        s.touch_session(b, "shared", request(20), 1).await.unwrap();
        assert_eq!(s.len(), 2);
        let latest = s.latest_request("shared").await.unwrap().unwrap();
        assert_eq!(latest.body.len(), 20, "the most recently used");
        assert_eq!(s.session("shared").await.unwrap().unwrap().tenant, b);
        s.touch_session(a, "shared", request(30), 2).await.unwrap();
        assert_eq!(s.session("shared").await.unwrap().unwrap().tenant, a);
    }

    #[tokio::test]
    async fn checkpoints_per_session_are_capped_and_replacements_not_double_counted() {
        let (s, _) = store(limits(100, usize::MAX));
        let t = tenant("k");
        let conv = conversation(&t, "m", 20);
        for covered in 1..=MAX_CHECKPOINTS_PER_SESSION + 2 {
            put(&s, t, &conv, checkpoint("s", covered, "x")).await;
        }
        assert_eq!(s.stats().checkpoints, MAX_CHECKPOINTS_PER_SESSION);
        assert_eq!(
            found(&s, t, &conv[..2]).await,
            None,
            "the oldest were dropped"
        );
        assert_eq!(found(&s, t, &conv[..3]).await, Some(3));

        let before = s.stats();
        put(&s, t, &conv, checkpoint("s", 10, "x")).await;
        let after = s.stats();
        assert_eq!(after.checkpoints, before.checkpoints);
        assert_eq!(after.bytes, before.bytes);
    }

    #[tokio::test]
    async fn empty_checkpoints_are_rejected() {
        let (s, _) = store(limits(100, usize::MAX));
        let t = tenant("k");
        let hash = ChainHash::start(&t);
        let err = s.put_checkpoint(t, hash, checkpoint("s", 0, "x")).await;
        assert!(matches!(err, Err(StoreError::EmptyCheckpoint)));
        assert!(s.is_empty());
    }

    #[tokio::test]
    async fn the_session_breaker_lives_in_the_store() {
        let (s, clock) = store(limits(100, usize::MAX));
        let t = tenant("k");
        assert!(s.compaction_allowed(t, "unknown").await.unwrap());
        assert!(!s.record_compaction(t, "unknown", false).await.unwrap());
        touch(&s, t, "s").await;
        assert!(!s.record_compaction(t, "s", false).await.unwrap());
        assert!(!s.record_compaction(t, "s", false).await.unwrap());
        assert!(
            s.record_compaction(t, "s", false).await.unwrap(),
            "opens on the third"
        );
        assert!(!s.compaction_allowed(t, "s").await.unwrap());
        let info = s.session("s").await.unwrap().unwrap();
        assert_eq!(
            (info.breaker, info.consecutive_failures),
            (BreakerState::Open, 3)
        );
        clock.advance(Duration::from_secs(60));
        assert!(
            s.compaction_allowed(t, "s").await.unwrap(),
            "half-open trial"
        );
        assert!(!s.record_compaction(t, "s", true).await.unwrap());
        let info = s.session("s").await.unwrap().unwrap();
        assert_eq!(info.breaker, BreakerState::Closed);
    }

    #[test]
    fn a_tenants_share_is_its_fraction_of_sessions_and_bytes() {
        let mib = 1024 * 1024;
        let defaults = shared(10_000, 256 * mib, 1_000);
        assert_eq!(defaults.tenant_share(), (1_000, 256 * mib / 10));
        // More than the store: the store.
        assert_eq!(shared(10, 1_000, 50).tenant_share(), (10, 1_000));
        assert_eq!(shared(10, 1_000, 10).tenant_share(), (10, 1_000));
        // No overflow for an unbounded byte budget.
        assert_eq!(shared(4, usize::MAX, 2).tenant_share(), (2, usize::MAX / 2));
    }

    #[tokio::test]
    async fn a_tenant_at_its_share_evicts_only_its_own_sessions() {
        let (s, _) = store(shared(10, usize::MAX, 3));
        let (a, b) = (tenant("flood"), tenant("quiet"));
        let b_conv = conversation(&b, "b", 4);
        touch(&s, b, "b0").await;
        touch(&s, b, "b1").await;
        put(&s, b, &b_conv, checkpoint("b1", 3, "b summary")).await;
        for k in 0..50 {
            touch(&s, a, &format!("a{k}")).await;
            s.lock().assert_consistent();
        }
        assert_eq!(ids_of(&s, a).await, ["a49", "a48", "a47"]);
        assert_eq!(
            ids_of(&s, b).await,
            ["b1", "b0"],
            "the other tenant is untouched"
        );
        assert_eq!(found(&s, b, &b_conv).await, Some(3), "with its checkpoint");
        assert_eq!(s.evictions(), 47);

        // A checkpoint of a new session counts the same as a touch.
        let a_conv = conversation(&a, "a", 3);
        put(&s, a, &a_conv, checkpoint("fresh", 2, "a summary")).await;
        assert_eq!(ids_of(&s, a).await, ["fresh", "a49", "a48"]);
        assert_eq!(ids_of(&s, b).await, ["b1", "b0"]);
        assert_eq!(s.evictions(), 48);
        s.lock().assert_consistent();
    }

    #[tokio::test]
    async fn a_tenants_byte_share_bounds_it_the_same_way() {
        let (probe, _) = store(limits(100, usize::MAX));
        let t = tenant("k");
        probe
            .touch_session(t, "s0", request(10_000), 1)
            .await
            .unwrap();
        let one = probe.stats().bytes;

        // Five sessions' worth of bytes, half of it per tenant: two and a half sessions.
        let (s, _) = store(shared(10, one * 5, 5));
        let (a, b) = (tenant("flood"), tenant("quiet"));
        let b_conv = conversation(&b, "b", 3);
        s.touch_session(b, "b0", request(10_000), 1).await.unwrap();
        put(&s, b, &b_conv, checkpoint("b0", 2, "b summary")).await;
        for k in 0..6 {
            let id = format!("a{k}");
            s.touch_session(a, &id, request(10_000), 1).await.unwrap();
            s.lock().assert_consistent();
        }
        assert_eq!(
            ids_of(&s, a).await,
            ["a5", "a4"],
            "bytes bind before sessions"
        );
        assert_eq!(ids_of(&s, b).await, ["b0"]);
        assert_eq!(found(&s, b, &b_conv).await, Some(2));

        // A big checkpoint takes its room from the same tenant's older session.
        let a_conv = conversation(&a, "m", 2);
        let base = (*checkpoint("a5", 2, "")).clone();
        let big = Arc::new(Checkpoint {
            result: CompactionResult {
                summary: "y".repeat(one / 2),
                ..base.result.clone()
            },
            ..base
        });
        put(&s, a, &a_conv, big).await;
        assert_eq!(ids_of(&s, a).await, ["a5"]);
        assert_eq!(ids_of(&s, b).await, ["b0"]);
        assert_eq!(found(&s, b, &b_conv).await, Some(2));
        s.lock().assert_consistent();
    }

    #[tokio::test]
    async fn global_bounds_still_evict_the_least_recently_used_of_anyone() {
        let (s, clock) = store(shared(4, usize::MAX, 2));
        let (a, b, c) = (tenant("a"), tenant("b"), tenant("c"));
        for (t, id) in [(a, "a0"), (a, "a1"), (b, "b0"), (b, "b1")] {
            touch(&s, t, id).await;
        }
        touch(&s, a, "a0").await; // a1 is now the least recently used
        touch(&s, c, "c0").await;
        assert_eq!(ids(&s).await, ["c0", "a0", "b1", "b0"]);
        touch(&s, c, "c1").await;
        assert_eq!(ids(&s).await, ["c1", "c0", "a0", "b1"]);
        assert_eq!(s.evictions(), 2);
        // Within its share again, c replaces its own.
        touch(&s, c, "c2").await;
        assert_eq!(ids(&s).await, ["c2", "c1", "a0", "b1"]);
        assert_eq!(s.evictions(), 3);
        s.lock().assert_consistent();

        // Expiry forgets a tenant entirely.
        clock.advance(TTL * 2);
        assert!(s.is_empty());
        s.lock().assert_consistent();
        assert!(s.lock().tenants.is_empty());
    }

    async fn answer(s: &MemoryStore, t: TenantId, id: &str, answer: ProviderAnswer) {
        s.provider_answered(t, id, answer).await.unwrap();
    }

    #[tokio::test]
    async fn unconfirmed_tenants_are_evicted_before_any_confirmed_one() {
        let (s, _) = store(limits(4, usize::MAX));
        let known = tenant("known");
        let conv = conversation(&known, "k", 4);
        touch(&s, known, "k0").await;
        touch(&s, known, "k1").await;
        put(&s, known, &conv, checkpoint("k1", 3, "kept")).await;
        answer(&s, known, "k1", ProviderAnswer::Accepted).await;
        // Unknown credentials whose answers never came (or were neither success nor 401):
        // they take the free room, then replace each other.
        for k in 0..20 {
            let t = tenant(&format!("unknown{k}"));
            touch(&s, t, &format!("u{k}")).await;
        }
        assert_eq!(ids(&s).await, ["u19", "u18", "k1", "k0"]);
        assert_eq!(found(&s, known, &conv).await, Some(3));
        // A confirmed tenant's new session takes an unconfirmed one's room first.
        touch(&s, known, "k2").await;
        // (The lookup above made k1 more recent than u19.)
        assert_eq!(ids(&s).await, ["k2", "k1", "u19", "k0"]);
        // Once none is left, confirmed tenants evict by last use as before.
        touch(&s, known, "k3").await;
        touch(&s, known, "k4").await;
        assert_eq!(ids(&s).await, ["k4", "k3", "k2", "k1"]);
        s.lock().assert_consistent();
    }

    #[tokio::test]
    async fn an_unauthorised_answer_takes_back_only_an_unconfirmed_session() {
        let (s, _) = store(limits(100, usize::MAX));
        let (known, stranger) = (tenant("known"), tenant("stranger"));
        let conv = conversation(&stranger, "m", 3);
        touch(&s, stranger, "s").await;
        put(&s, stranger, &conv, checkpoint("s", 2, "x")).await;
        touch(&s, known, "k").await;
        answer(&s, known, "k", ProviderAnswer::Accepted).await;
        let before = s.stats();

        answer(&s, stranger, "s", ProviderAnswer::Unauthorised).await;
        assert_eq!(ids(&s).await, ["k"]);
        assert_eq!(found(&s, stranger, &conv).await, None);
        let after = s.stats();
        assert_eq!((after.sessions, after.checkpoints), (1, 0));
        assert!(after.bytes < before.bytes);
        assert_eq!(after.evictions, 0, "not an eviction for space");

        // A key that worked before keeps what it had.
        answer(&s, known, "k", ProviderAnswer::Unauthorised).await;
        assert_eq!(ids(&s).await, ["k"]);
        s.lock().assert_consistent();
    }

    #[tokio::test]
    async fn a_confirmation_outlives_its_sessions_within_a_bounded_set() {
        let (s, _) = store(limits(2, usize::MAX));
        let early = tenant("early");
        touch(&s, early, "e0").await;
        // Its only session is pushed out by strangers before its answer comes.
        for k in 0..3 {
            touch(&s, tenant(&format!("x{k}")), &format!("x{k}")).await;
        }
        assert_eq!(ids(&s).await, ["x2", "x1"]);
        answer(&s, early, "e0", ProviderAnswer::Accepted).await;
        // Its next session is confirmed from the start: strangers cannot push it out.
        touch(&s, early, "e1").await;
        for k in 3..10 {
            touch(&s, tenant(&format!("x{k}")), &format!("x{k}")).await;
        }
        assert_eq!(ids(&s).await, ["x9", "e1"]);
        // At most `max_sessions` tenants are remembered as confirmed; the least recently
        // accepted is forgotten and its sessions are unconfirmed again.
        for k in 0..2 {
            answer(
                &s,
                tenant(&format!("other{k}")),
                "o",
                ProviderAnswer::Accepted,
            )
            .await;
        }
        assert_eq!(s.lock().confirmed.by_tenant.len(), 2);
        assert!(!s.lock().confirmed.contains(early));
        touch(&s, tenant("x10"), "x10").await;
        assert_eq!(ids(&s).await, ["x10", "x9"]);
        s.lock().assert_consistent();
    }

    #[test]
    fn the_store_is_usable_as_a_trait_object() {
        let store: Arc<dyn SessionStore> = Arc::new(MemoryStore::new(limits(1, 1)));
        let fut = store.list_sessions(10);
        fn assert_send<T: Send>(_: &T) {}
        assert_send(&fut);
    }
}
