//! The request-level flow with session memory: what the proxy and the admin API call.
//!
//! For each chat request, cheapest first (docs/architecture.md, *Request flow*):
//! 1. **scan** the body once ([`DialectKind::scan`]): its messages as raw slices, the estimate
//!    of each;
//! 2. **identify**: tenant (hash of the credential), session id (header, else derived from the
//!    first messages), and remember this request as the session's latest (for manual
//!    compaction);
//! 3. **look up**: hash the messages (only as far as any checkpoint of the tenant reaches) and
//!    find the longest stored checkpoint; its summary stands in for the prefix it covers;
//! 4. **trigger** on what the upstream would receive after that splice; if it fires and the
//!    session's breaker allows, **compact** (once per prefix: concurrent requests wait for the
//!    single flight and then read what it stored), refining the checkpoint's summary, and
//!    store the new checkpoint;
//! 5. **splice**: the body's bytes with the covered messages replaced by the summary message.
//!
//! The summary message is rendered from the stored checkpoint alone, so every request of a
//! conversation between two compactions sends the same bytes for the compacted prefix and the
//! provider's prompt cache keeps hitting (docs/architecture.md, *Sessions in a stateless
//! proxy*). Nothing here fails a request: every problem forwards the original bytes (or the
//! still-valid spliced request) and is counted.

use std::borrow::Cow;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use compactor_plugin_api::{Caller, SummarizeError, Summarizer};
use futures_util::FutureExt as _;

use crate::calibration::Calibration;
use crate::cohort::{Cohort, Conversations};
use crate::compaction::engine::{
    CompactError, Compaction, CompactionInput, Engine, InConversation, Prior,
};
use crate::compaction::mask::MaskRule;
use crate::compaction::models::{window_model, LearnedWindow, WindowKey, WindowSource};
use crate::compaction::prompt::summary_message;
use crate::compaction::trigger::{BackgroundOutcome, CompactionOutcome, Limits, Trigger};
use crate::compaction::{Attempts, CompactionResult, MAX_ATTEMPTS_PER_REQUEST};
use crate::config::{Config, Mode, Price, StoreBackend, Strategy};
use crate::cost::{cached_prefix, Bill, Repeats};
use crate::dialect::reply::first_reply;
use crate::dialect::scan_memo::{Remembering, ScanMemo};
use crate::dialect::{DialectError, DialectKind, Scan};
use crate::event_log::{self, Event, EventLog};
use crate::metrics::Metrics;
use crate::overflow::Overflow;
use crate::session::hash::SESSION_ID_MESSAGES;
use crate::session::redis::CLAIM_TTL;
use crate::session::{
    derived_session_ids, session_id, ChainMemo, Checkpoint, Claim, LatestRequest, Lease, MaskFloor,
    MaskNeed, MemoryStore, RedisSettings, RedisStore, SessionCost, SessionIdMemo, SessionStore,
    SingleFlight, Staged, StoreError, StoreLimits, TenantId,
};
use crate::transcript::Transcript;

/// Messages one more turn of an agent's loop adds, about: its call and the call's output.
/// `hybrid` without background summaries leaves that much room when it masks
/// (`Pipeline::plan_mask`).
const TURN: usize = 2;

/// What the proxy knows about a request besides its body.
#[derive(Debug, Clone, Copy)]
pub struct RequestContext<'a> {
    /// Destination and credentials (summarizers that call the caller's provider use them).
    pub caller: &'a Arc<Caller>,
    /// The value of the configured session header, if the client sent one.
    pub session_header: Option<&'a str>,
    /// The request enables a longer context window than its model's usual one (Anthropic's
    /// `context-1m` beta): its window is the one for [`window_model`].
    pub long_context: bool,
    /// The summarizer calls the client request may still make: shared by the compaction
    /// before it is sent and the one after a refusal for length.
    pub attempts: &'a Attempts,
    /// The request's own `x-compactor-mode` header, when it sent a valid one.
    pub mode: Option<Mode>,
}

/// The outcome of one request plus the session it belongs to.
#[derive(Debug, Default)]
pub struct Processed {
    /// What to forward.
    pub outcome: Outcome,
    /// The session id (`x-compactor-session`), when the body was a conversation.
    pub session_id: Option<String>,
    /// Time spent waiting for summaries (not compactor's own overhead).
    pub summarizer_time: Duration,
    /// The request's model and the raw estimate of the forwarded input, for comparing with
    /// the provider's reported usage.
    pub estimate: Option<ForwardedEstimate>,
    /// The request's cohort: only [`Cohort::Enforce`] requests are compacted, and compacted
    /// again after a refusal for length.
    pub cohort: Cohort,
}

/// What the response's `usage` is compared with.
#[derive(Debug, Clone)]
pub struct ForwardedEstimate {
    /// The request's dialect.
    pub dialect: DialectKind,
    /// The request's model.
    pub model: Option<String>,
    /// Its prices, when the models table names them (looked up once per request).
    pub price: Option<Price>,
    /// Estimated input tokens of the body forwarded (raw, never calibrated).
    pub tokens: usize,
    /// Estimated input tokens of the body received (raw).
    pub received: usize,
    /// Of `received`, the tokens that repeat the session's previous request as a provider's
    /// cache would serve them ([`crate::cost::Repeats`]); counted only for a priced model.
    pub received_cached: usize,
    /// The context window the request was checked against (usage beyond it teaches a larger
    /// one).
    pub context_window: usize,
    /// Where the request went: a window is learned for the model on that upstream.
    pub caller: Arc<Caller>,
    /// The request enabled its model's long context ([`RequestContext::long_context`]).
    pub long_context: bool,
    /// The request's cohort (its spend is counted there).
    pub cohort: Cohort,
}

/// The answer to a manual compaction (`POST /session/{id}/summarize`).
#[derive(Debug)]
pub enum ManualOutcome {
    /// No session with that id.
    UnknownSession,
    /// Nothing was compacted, and why.
    NotCompacted {
        /// A short, stable reason (`nothing_to_compact`, `summarizer_failed`, ...).
        reason: &'static str,
    },
    /// A checkpoint was stored; the next request of the session uses it.
    Compacted(Arc<Checkpoint>),
}

/// Concurrent requests needing the same compaction share one: same tenant, session and
/// already-covered prefix.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct FlightKey {
    tenant: TenantId,
    session: String,
    covered: usize,
}

/// One chat request on its way through the pipeline: what every step after the scan reads.
struct Request<'r, 'b> {
    scan: &'r Scan<'b>,
    /// The bytes `scan` reads (a background summary takes its own reference).
    body: &'r Bytes,
    caller: &'r Arc<Caller>,
    tenant: TenantId,
    session: &'r str,
    limits: Limits,
    /// Where a summary of it starts in the background: the watermark, earlier when the
    /// conversation is predicted to reach the trigger before a summary started there is
    /// written ([`pace`]); `None` without background summaries, and off the request path.
    background_at: Option<Limits>,
    /// Whether summaries take turns to write in this conversation ([`pace`] predicts a lead):
    /// then the next one starts as soon as a request shows it due, not a request later.
    slow_summaries: bool,
    /// The summarizer calls it may still make.
    attempts: &'r Attempts,
    /// Compacting the conversation pays now ([`payback`]): a summary is made ahead, or
    /// spliced in when ready, below the trigger.
    pays: bool,
}

/// Why a compaction of a request did not happen: the engine's reasons, or the dialect could
/// not write the plan back.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error(transparent)]
    Engine(#[from] CompactError),
    #[error(transparent)]
    Dialect(#[from] DialectError),
}

impl Failure {
    fn outcome(&self) -> CompactionOutcome {
        match self {
            Failure::Engine(e) => e.outcome(),
            Failure::Dialect(_) => CompactionOutcome::Failed,
        }
    }
}

/// A compaction done by the leader of a single flight: the rewritten request, the engine's
/// result, and the checkpoint stored for it (`None` when it could not be stored: the next
/// request compacts again). Waiters never see it: they read the store.
struct Compacted {
    body: Vec<u8>,
    compaction: Compaction,
    stored: Option<Arc<Checkpoint>>,
    /// Old outputs masked in `body` (`mask`, `hybrid`).
    masked: usize,
}

impl Compacted {
    /// Whether the rewrite would still trip the trigger.
    fn still_over(&self, limits: &Limits) -> bool {
        let c = &self.compaction;
        limits.check(c.counted, c.result.post_tokens).is_some()
    }
}

/// What a background summary needs: its own reference to the body and the request's
/// context.
struct BackgroundJob {
    dialect: DialectKind,
    body: Bytes,
    caller: Arc<Caller>,
    session: String,
    /// What the summary is made for ([`Limits::for_background`]).
    limits: Limits,
    key: FlightKey,
    /// The watermark it crossed (`messages` or `tokens`): the trigger it is counted under.
    trigger: Trigger,
    /// The request as the provider received it ([`Forwarded`]), and its estimate.
    forwarded: Option<(Bytes, usize)>,
}

/// The request as the provider receives it without a new summary (any stored one spliced in,
/// old outputs masked) and its estimate: what a summary asked inside the conversation
/// repeats, so the provider reads it from its prompt cache
/// ([`compactor_plugin_api::SummaryRequest::in_conversation`]).
#[derive(Clone, Copy)]
struct Forwarded<'a> {
    body: &'a [u8],
    tokens: usize,
}

/// What one request's handling measured besides its outcome.
#[derive(Debug, Default)]
struct Figures {
    /// Time spent waiting for summaries.
    summarizer_time: Duration,
    /// Estimated tokens of the request with old outputs masked and any stored summary spliced
    /// in, before a new compaction (`mask`, `hybrid`).
    masked_tokens: Option<usize>,
    /// Outputs masked in the body forwarded with a summary (`Outcome::Masked` counts its own).
    masked_outputs: usize,
}

/// A stored checkpoint applied to a request: messages `[head..covered)` become `message`.
struct Splice {
    head: usize,
    covered: usize,
    message: String,
    checkpoint: Arc<Checkpoint>,
}

/// The request-level entry point: engine, session store and single flight.
pub struct Pipeline {
    engine: Engine,
    metrics: Arc<Metrics>,
    calibration: Arc<Calibration>,
    calibrate: bool,
    store: Arc<dyn SessionStore>,
    flights: Arc<SingleFlight<FlightKey, ()>>,
    flight_wait: Duration,
    background: Arc<Background>,
    /// How fast conversations grow and summaries are written (shared on reload, as
    /// `background`).
    pace: Arc<Pace>,
    /// What each conversation's cached history has cost since its last compaction (shared on
    /// reload, as `pace`); `None` with `compaction.cost_trigger` off, or a strategy that never
    /// summarises (`mask`).
    payback: Option<Arc<Payback>>,
    /// `compaction.background_ratio`.
    background_ratio: f64,
    /// Chain hashes of histories already seen, so a long conversation's next request hashes
    /// only its new messages.
    memo: ChainMemo,
    /// Conversation arrays already read, so a request reads only the messages it adds.
    scan_memo: ScanMemo,
    /// Derived session ids of openings already seen (a parse and a digest of tens of
    /// kilobytes, and a store call, per request otherwise).
    session_ids: SessionIdMemo,
    /// What each session's previous request held, for what the next would cost without
    /// compactor (kept over reloads).
    repeats: Arc<Repeats>,
    enabled: bool,
    /// `compaction.strategy`.
    strategy: Strategy,
    /// Which outputs of the forwarded request are masked (`mask`, `hybrid`).
    masker: Masker,
    /// The upstreams requests are routed to: a manual compaction calls the summarizer only
    /// for a session whose latest request went to one of them.
    upstreams: Vec<String>,
    /// `compaction.mode`.
    mode: Mode,
    /// `compaction.sample_ratio`.
    sample_ratio: f64,
    /// Conversations seen, for counting each once per cohort.
    conversations: Arc<Conversations>,
    /// Each conversation's recent requests, for the session inspector (shared on reload).
    history: Arc<History>,
    /// `server.event_log`, when set (never in the shadow pipeline: it forwards nothing it
    /// decides).
    events: Option<Arc<EventLog>>,
    /// What decides for shadow requests: this pipeline's settings with the local `extractive`
    /// summarizer and a memory store of its own (a shadow summary is never spliced into a
    /// request forwarded for real); `None` in the shadow pipeline itself.
    shadow: Option<Arc<Pipeline>>,
}

impl Pipeline {
    /// This pipeline without pacing ([`pace`]): background summaries start at the plain
    /// watermark. For a caller that awaits every background summary before the next request
    /// (the replay), whose figures must not depend on how fast this machine writes them.
    pub fn without_pacing(mut self) -> Pipeline {
        self.pace = Arc::new(Pace::off());
        self
    }

    /// A pipeline with the store `[store]` describes: in memory, or shared through Redis
    /// (with a memory store of this process's own beside it).
    pub fn new(config: &Config, summarizer: Arc<dyn Summarizer>, metrics: Arc<Metrics>) -> Self {
        let memory = || {
            MemoryStore::new(StoreLimits {
                max_sessions: config.store.max_sessions,
                max_bytes: config.store.max_bytes,
                max_sessions_per_tenant: config.store.max_sessions_per_tenant,
                ttl: config.store_ttl(),
            })
            .with_breaker_cooldown(config.breaker_cooldown())
        };
        let store: Arc<dyn SessionStore> = match config.store.backend {
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
                match RedisStore::new(&config.store.redis_url, settings, memory(), metrics.clone())
                {
                    Ok(redis) => Arc::new(redis),
                    Err(e) => {
                        // Validation accepted the URL, so this is not expected; fail open.
                        tracing::error!(error = %e, "redis store unavailable; sessions stay in memory");
                        Arc::new(memory())
                    }
                }
            }
        };
        Pipeline::with_store(config, summarizer, metrics, store)
    }

    /// A pipeline over a given store.
    pub fn with_store(
        config: &Config,
        summarizer: Arc<dyn Summarizer>,
        metrics: Arc<Metrics>,
        store: Arc<dyn SessionStore>,
    ) -> Self {
        let mut pipeline = Pipeline::build(config, summarizer, metrics, store);
        pipeline.shadow = shadow::pipeline(config, &pipeline.calibration).map(Arc::new);
        pipeline
    }

    /// A pipeline over a given store, without a shadow.
    fn build(
        config: &Config,
        summarizer: Arc<dyn Summarizer>,
        metrics: Arc<Metrics>,
        store: Arc<dyn SessionStore>,
    ) -> Self {
        let engine = Engine::new(config, summarizer);
        metrics.strategy_in_use(config.compaction.strategy);
        // A waiter waits as long as the leader may take: every attempt it may make.
        let flight_wait = engine
            .summary_timeout()
            .saturating_mul(MAX_ATTEMPTS_PER_REQUEST);
        Pipeline {
            engine,
            metrics,
            calibration: Arc::new(Calibration::new()),
            calibrate: config.compaction.calibration,
            store,
            flights: Arc::new(SingleFlight::new()),
            flight_wait,
            background: Arc::new(Background::new(config.summarizer.max_concurrent)),
            pace: Arc::default(),
            payback: (config.compaction.cost_trigger && config.compaction.strategy.summarizes())
                .then(Arc::default),
            background_ratio: config.compaction.background_ratio,
            // Sized to the store they serve (README, *Memory*).
            memo: ChainMemo::for_sessions(config.store.max_sessions),
            scan_memo: ScanMemo::with_budget(config.store.max_bytes / 4),
            session_ids: SessionIdMemo::for_sessions(config.store.max_sessions),
            repeats: Arc::default(),
            enabled: config.compaction.enabled,
            strategy: config.compaction.strategy,
            masker: Masker {
                rule: MaskRule {
                    keep_recent: config.compaction.keep_recent_outputs,
                    // `hybrid` may mask any output but the recent ones: its steps are sized by
                    // tokens (`Pipeline::plan_mask`).
                    block: match config.compaction.strategy {
                        Strategy::Hybrid => 1,
                        _ => config.compaction.mask_block,
                    },
                },
                block: config.compaction.mask_block,
                // Validation compiled it; a pattern that does not compile masks no user turn.
                observations: config.compaction.observation_regex().ok().flatten(),
            },
            upstreams: config.upstream_base_urls(),
            mode: config.compaction.mode,
            sample_ratio: config.compaction.sample_ratio,
            conversations: Arc::default(),
            history: Arc::default(),
            events: None,
            shadow: None,
        }
    }

    /// This pipeline writing its events to `events` ([`crate::event_log`]).
    pub fn with_events(mut self, events: Option<Arc<EventLog>>) -> Self {
        self.events = events;
        self
    }

    /// Shares what outlives a reload with the pipeline this one replaces: the calibration
    /// table, the compactions in flight (a request after the reload waits for one started
    /// before it instead of starting a second) and the background summaries (so shutdown
    /// abandons them all). The store is passed to [`Pipeline::with_store`].
    pub fn succeeding(mut self, old: &Pipeline) -> Self {
        self.calibration = old.calibration.clone();
        self.flights = old.flights.clone();
        self.background = old.background.clone();
        self.pace = old.pace.clone();
        if let (Some(_), Some(old)) = (&self.payback, &old.payback) {
            self.payback = Some(old.clone());
        }
        self.repeats = old.repeats.clone();
        self.conversations = old.conversations.clone();
        self.history = old.history.clone();
        self.shadow = match (self.shadow.take(), &old.shadow) {
            (Some(new), Some(old_shadow)) => {
                Some(shadow::succeeding(new, old_shadow, &self.calibration))
            }
            (new, _) => new,
        };
        self
    }

    /// Shutdown: abandons every background summary (counted); none stores anything.
    pub fn abandon_background(&self) {
        let abandoned = self.background.abandon();
        for _ in 0..abandoned {
            self.metrics
                .background_compaction(BackgroundOutcome::Abandoned);
        }
    }

    /// Waits until no background summary runs (replay: an agent's think time outlasting a
    /// summary).
    pub async fn background_idle(&self) {
        self.background.idle().await;
    }

    /// Each conversation's recent requests ([`history`]).
    pub fn history(&self) -> &Arc<History> {
        &self.history
    }

    /// Whether it compacts at all (`compaction.enabled`): when not, chat bodies are not even
    /// read.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The per-model calibration table.
    pub fn calibration(&self) -> &Arc<Calibration> {
        &self.calibration
    }

    /// The limits of a request to `upstream`: for the window learned for its model there when
    /// there is one (a provider's own figure beats the table), with the token threshold in raw
    /// estimate units: divided by the model's calibration factor when calibration is on. The
    /// trigger and the engine both compare raw estimates with these limits, so a rewrite the
    /// engine sizes to fit does not trip the trigger again on the next request.
    async fn limits(
        &self,
        upstream: &str,
        model: Option<&str>,
        long_context: bool,
        requested_output: Option<usize>,
    ) -> Limits {
        let window_model = model.map(|m| window_model(m, long_context));
        let limits = self
            .window_limits(upstream, window_model.as_deref(), requested_output)
            .await;
        // The summarizer's call does not carry the request's long-context flag: its prompt
        // and summary fit the model's usual window.
        let limits = if long_context {
            let usual = self.window_limits(upstream, model, requested_output).await;
            limits.with_summarizer_window(usual.context_window)
        } else {
            limits
        };
        match model {
            Some(model) if self.calibrate => limits.calibrated(self.calibration.factor(model)),
            _ => limits,
        }
    }

    /// The limits for the window of `model` (a [`window_model`] name) on `upstream`: the one
    /// learned there, else the table's.
    async fn window_limits(
        &self,
        upstream: &str,
        model: Option<&str>,
        requested_output: Option<usize>,
    ) -> Limits {
        let learned = match model {
            Some(name) => self.learned_window(upstream, name).await,
            None => None,
        };
        match learned {
            Some(w) => Limits::new(self.engine.settings(), w.context_window, requested_output),
            None => self.engine.limits(model, requested_output),
        }
    }

    /// The window learned for `model` on `upstream`; a store that cannot answer is as if
    /// nothing was learned.
    async fn learned_window(&self, upstream: &str, model: &str) -> Option<LearnedWindow> {
        let learned = self.store.learned_window(upstream, model).await;
        learned.unwrap_or_else(|e| {
            tracing::debug!(error = %e, "learned windows unavailable; using the models table");
            None
        })
    }

    /// Remembers a window the provider at `upstream` showed for `model` (counted when it
    /// changed what was known), so the trigger uses it from the next request to that upstream
    /// on, wherever the store is shared.
    pub async fn learn_window(
        &self,
        upstream: &str,
        model: &str,
        context_window: usize,
        source: WindowSource,
    ) {
        let Some(key) = WindowKey::new(upstream, model) else {
            return;
        };
        let window = LearnedWindow {
            context_window,
            source,
            learned_unix: crate::session::store::unix_now(),
        };
        match self.store.learn_window(&key, window).await {
            Ok(true) => {
                self.metrics.window_learned(source);
                tracing::info!(
                    upstream,
                    model,
                    context_window,
                    source = source.label(),
                    "context window learned"
                );
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "learned window not stored"),
        }
    }

    /// The windows learned from providers, most recently learned first (`GET /models`).
    pub async fn windows(&self) -> Result<Vec<(WindowKey, LearnedWindow)>, StoreError> {
        self.store.learned_windows().await
    }

    /// The engine, for callers that compact parsed transcripts themselves.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The session store (admin API, metrics).
    pub fn store(&self) -> &Arc<dyn SessionStore> {
        &self.store
    }

    /// [`Pipeline::handle`] without a session header, returning only the outcome.
    pub async fn process(
        self: &Arc<Self>,
        dialect: DialectKind,
        body: &[u8],
        caller: &Arc<Caller>,
    ) -> Outcome {
        let context = RequestContext {
            caller,
            session_header: None,
            long_context: false,
            attempts: &Attempts::per_request(),
            mode: None,
        };
        self.handle(dialect, &Bytes::copy_from_slice(body), &context)
            .await
            .outcome
    }

    /// Decides what to forward for one chat request. Never fails, and never takes the request
    /// down with it: a panic anywhere in compaction (a bug) is caught here, counted as
    /// `{trigger="none",outcome="panic"}`, and the original bytes are forwarded.
    pub async fn handle(
        self: &Arc<Self>,
        dialect: DialectKind,
        body: &Bytes,
        context: &RequestContext<'_>,
    ) -> Processed {
        // Unwind safety: after a panic nothing of this request's state is used again, and the
        // shared state (store, flights, calibration) recovers its locks from poisoning.
        let handled = AssertUnwindSafe(self.handle_unguarded(dialect, body, context))
            .catch_unwind()
            .await;
        handled.unwrap_or_else(|_| {
            self.metrics.compaction_panicked();
            tracing::error!("compaction panicked; forwarding the original request unchanged");
            Processed::default()
        })
    }

    async fn handle_unguarded(
        self: &Arc<Self>,
        dialect: DialectKind,
        body: &Bytes,
        context: &RequestContext<'_>,
    ) -> Processed {
        if !self.enabled {
            return Processed::default();
        }
        let tenant = TenantId::from_caller(context.caller);
        let remembering = Remembering {
            memo: &self.scan_memo,
            body,
            scope: tenant.0,
        };
        let scan = match dialect.scan_remembering(&remembering, self.engine.estimator()) {
            Ok(scan) => scan,
            Err(DialectError::ServerState) => {
                self.metrics.server_state_passthrough();
                return Processed::default();
            }
            Err(e) => {
                self.metrics.unreadable_passthrough();
                tracing::debug!(error = %e, "chat body not understood; forwarding unchanged");
                return Processed::default();
            }
        };
        self.metrics
            .request_tokens_estimated
            .observe(scan.tokens as f64);

        let session = self
            .session_of(&scan, &tenant, context.session_header)
            .await;
        let latest = LatestRequest {
            tenant,
            dialect,
            body: body.clone(),
            caller: context.caller.clone(),
        };
        if let Err(e) = self
            .store
            .touch_session(tenant, &session, latest, scan.len())
            .await
        {
            tracing::warn!(error = %e, "session store unavailable; continuing without it");
        }

        let cohort = Cohort::of(context.mode, self.mode, self.sample_ratio, &session);
        let checkpoint = if cohort.compacts() {
            self.lookup(tenant, &scan.messages).await
        } else {
            None
        };
        let limits = self
            .limits(
                &context.caller.upstream_base_url,
                scan.model.as_deref(),
                context.long_context,
                scan.requested_output,
            )
            .await;
        let lead = self
            .pace
            .observe(&(tenant, &session), scan.len(), scan.tokens, Instant::now());
        let background_at = limits.watermark(self.background_ratio).map(|w| match lead {
            Some(lead) => w.earlier_by(&limits, lead.tokens, lead.messages),
            None => w,
        });
        let request = Request {
            scan: &scan,
            body,
            caller: context.caller,
            tenant,
            session: &session,
            limits,
            background_at,
            slow_summaries: lead.is_some(),
            attempts: context.attempts,
            pays: cohort.compacts()
                && self
                    .payback
                    .as_ref()
                    .is_some_and(|p| p.due(&(tenant, &session))),
        };
        let mut figures = Figures::default();
        let outcome = if !cohort.compacts() {
            Outcome::Unchanged
        } else if checkpoint.is_some()
            || self.strategy.masks()
            || request.pays
            || self.may_compact(&request)
        {
            self.rewrite_path(&request, checkpoint, &mut figures).await
        } else {
            Outcome::Unchanged
        };
        let mut processed = Processed {
            outcome,
            session_id: None,
            summarizer_time: figures.summarizer_time,
            estimate: None,
            cohort,
        };
        self.record_tokens(&request, context.long_context, &mut processed);
        let would_forward = match cohort {
            Cohort::Shadow => self.shadow_forwarded(dialect, body, context).await,
            _ => None,
        };
        let forwarded = processed
            .estimate
            .as_ref()
            .map_or(scan.tokens, |e| e.tokens);
        self.metrics.cohort_request(
            cohort,
            scan.tokens,
            would_forward.unwrap_or(forwarded),
            self.conversations.first(&(tenant, &session)),
        );
        if let Some(masked) = figures.masked_tokens {
            self.metrics.masked_request_tokens(scan.dialect(), masked);
        }
        let masked_outputs = match &processed.outcome {
            Outcome::Masked { masked, .. } => *masked,
            Outcome::Rewritten { .. } | Outcome::Reused { .. } => figures.masked_outputs,
            Outcome::Unchanged | Outcome::Failed => 0,
        };
        if masked_outputs > 0 {
            self.metrics
                .masked_outputs(scan.dialect(), self.strategy, masked_outputs);
        }
        if let (Some(events), true) = (&self.events, cohort.compacts() && self.strategy.masks()) {
            events.masked(&session, masked_outputs, scan.tokens, forwarded);
        }
        let shape = Shape {
            summary: match &processed.outcome {
                Outcome::Rewritten { result, .. } | Outcome::Reused { result, .. } => {
                    result.compaction_num
                }
                Outcome::Masked { .. } | Outcome::Unchanged | Outcome::Failed => 0,
            },
            masked: masked_outputs,
        };
        if cohort.compacts() {
            self.pay_rent(&request, shape, processed.estimate.as_ref());
        }
        let done = match &processed.outcome {
            Outcome::Rewritten { .. } => Done::Compacted,
            Outcome::Reused { .. } => Done::Reused,
            Outcome::Masked { .. } => Done::Masked,
            Outcome::Unchanged => Done::Unchanged,
            Outcome::Failed => Done::Failed,
        };
        self.history.record(
            &session,
            Point::now(
                scan.tokens,
                forwarded,
                request.limits.token_threshold,
                done,
                shape.summary,
            ),
        );
        processed.session_id = Some(session);
        processed
    }

    /// Token metrics of one request, and the estimate its response's usage is compared with.
    fn record_tokens(
        &self,
        request: &Request<'_, '_>,
        long_context: bool,
        processed: &mut Processed,
    ) {
        let scan = request.scan;
        let received = scan.tokens;
        let forwarded = match &processed.outcome {
            Outcome::Rewritten { result, .. } | Outcome::Reused { result, .. } => {
                result.post_tokens
            }
            Outcome::Masked { post_tokens, .. } => *post_tokens,
            Outcome::Unchanged | Outcome::Failed => received,
        };
        self.metrics.chat_request_tokens(
            scan.dialect(),
            received,
            forwarded,
            request.limits.context_window,
        );
        // Every way a request is made smaller counts: a new summary, a stored one spliced in
        // (made on the request path or ahead of it), masked outputs.
        let saved = received.saturating_sub(forwarded);
        self.metrics
            .tokens_saved
            .inc_by(u64::try_from(saved).unwrap_or(u64::MAX));
        // What the request as received would cost is worked out only for a priced model.
        let price = scan
            .model
            .as_deref()
            .and_then(|m| self.engine.models().price(&window_model(m, long_context)));
        let received_cached = if price.is_some() {
            let repeated = self
                .repeats
                .repeated(&request.tenant, request.session, &scan.messages);
            let bytes = |messages: &[&str]| messages.iter().map(|m| m.len()).sum::<usize>();
            let all = bytes(&scan.messages).max(1);
            // `as` saturates; the share is at most 1.
            cached_prefix(
                (received as f64 * bytes(&scan.messages[..repeated]) as f64 / all as f64) as usize,
            )
        } else {
            0
        };
        processed.estimate = Some(ForwardedEstimate {
            dialect: scan.dialect(),
            model: scan.model.clone(),
            price,
            tokens: forwarded,
            received,
            received_cached,
            context_window: request.limits.context_window,
            caller: request.caller.clone(),
            long_context,
            cohort: processed.cohort,
        });
    }

    /// What the shadow pipeline would forward for this request, in estimated input tokens:
    /// it decides as enforce would, with its own summaries and store ([`shadow`]); `None`
    /// without a shadow or for a body it does not read.
    async fn shadow_forwarded(
        &self,
        dialect: DialectKind,
        body: &Bytes,
        context: &RequestContext<'_>,
    ) -> Option<usize> {
        let shadow = self.shadow.as_ref()?;
        let attempts = Attempts::per_request();
        let context = RequestContext {
            mode: Some(Mode::Enforce),
            attempts: &attempts,
            ..*context
        };
        // Boxed: the shadow runs this same function.
        let decided = Box::pin(shadow.handle(dialect, body, &context)).await;
        decided.estimate.map(|e| e.tokens)
    }

    /// Adds what the request's cached history cost to its conversation's rent ([`payback`]),
    /// for a priced model when the cost trigger is on, forwarded in `shape`.
    fn pay_rent(
        &self,
        request: &Request<'_, '_>,
        shape: Shape,
        estimate: Option<&ForwardedEstimate>,
    ) {
        let (Some(payback), Some(estimate)) = (&self.payback, estimate) else {
            return;
        };
        let Some(price) = estimate.price else {
            return;
        };
        let Some(economics) = Economics::of(&price, estimate.dialect == DialectKind::Messages)
        else {
            return;
        };
        // Without a summary yet, a first compaction adds one and a tail (the smallest: it is
        // one that pays) to what the conversation started with.
        let extra = if shape.summary > 0 {
            0
        } else {
            self.engine.settings().min_preserve_tokens + payback::SUMMARY_TOKENS
        };
        payback.observe(
            &(request.tenant, request.session),
            shape,
            (estimate.received, estimate.tokens),
            extra,
            &economics,
        );
    }

    /// The longest checkpoint the request's history matches, counted as a hit or a miss.
    async fn lookup(&self, tenant: TenantId, raw: &[&str]) -> Option<Arc<Checkpoint>> {
        let found = self.find_checkpoint(tenant, raw).await;
        self.metrics.checkpoint_lookup(found.is_some());
        found
    }

    /// The longest checkpoint the request's history matches, hashing only as far as the
    /// tenant's checkpoints reach (most requests of a new tenant hash nothing).
    ///
    /// Only prefixes that leave at least one message after them are considered: a checkpoint
    /// covering the whole request cannot be spliced (a tail must remain), and taking it for a
    /// match would make a request that needs compaction look already served.
    async fn find_checkpoint(&self, tenant: TenantId, raw: &[&str]) -> Option<Arc<Checkpoint>> {
        let reach = self.store.max_covered(tenant).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "checkpoint lookup failed; treating as a miss");
            0
        });
        let hashed = reach.min(raw.len().saturating_sub(1));
        if hashed == 0 {
            return None;
        }
        match self.memo.chain(&tenant, &raw[..hashed]) {
            Ok(hashes) => self
                .store
                .longest_checkpoint(tenant, &hashes)
                .await
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "checkpoint lookup failed; treating as a miss");
                    None
                }),
            Err(e) => {
                tracing::debug!(error = %e, "messages not canonicalisable; no checkpoint");
                None
            }
        }
    }

    /// Whether a request with no checkpoint is over the trigger or the background watermark
    /// (the cheap test that keeps most requests off the rewrite path).
    fn may_compact(&self, request: &Request<'_, '_>) -> bool {
        let limits = request.background_at.unwrap_or(request.limits);
        let scan = request.scan;
        limits
            .check(scan.counted(0..scan.len()), scan.tokens)
            .is_some()
    }

    /// Splices a checkpoint in, and compacts when due: with a staged checkpoint if one is
    /// ready, else by waiting for the summary of the prefix (made by a background task or
    /// another request) or making it. Below the trigger but over the background watermark, the
    /// summary is started in the background and the request goes on at once.
    async fn rewrite_path(
        self: &Arc<Self>,
        request: &Request<'_, '_>,
        found: Option<Arc<Checkpoint>>,
        figures: &mut Figures,
    ) -> Outcome {
        // A staged checkpoint stands in only for a request over the trigger without it; until
        // then the checkpoint it refines is the one in use.
        let (checkpoint, staged) = match found {
            Some(c) if c.staged.is_some() => {
                (c.staged.as_ref().and_then(|s| s.base.clone()), Some(c))
            }
            other => (other, None),
        };
        let mut splice = match checkpoint.map(|c| self.splice(request.scan, c)) {
            None => None,
            Some(Ok(splice)) => splice,
            Some(Err(e)) => {
                let scan = request.scan;
                let due = request
                    .limits
                    .check(scan.counted(0..scan.len()), scan.tokens);
                return self.not_understood(due, &e);
            }
        };
        // Old outputs are masked first (`mask`, `hybrid`): the trigger reads what the upstream
        // would receive without a new summary.
        let mut mask = self
            .mask_view(request, splice.as_ref(), staged.as_ref())
            .await;
        let (mut count, mut tokens) = self.view_size(request.scan, splice.as_ref(), &mask);
        if self.strategy.masks() {
            figures.masked_tokens = Some(tokens);
        }
        if !self.strategy.summarizes() {
            return self.reuse(request.scan, splice.as_ref(), &mask, tokens, figures);
        }
        let Some(trigger) = request.limits.check(count, tokens) else {
            if request.pays {
                return self
                    .pay_back(request, splice.as_ref(), staged, &mask, tokens, figures)
                    .await;
            }
            if staged.is_none() {
                // `hybrid`: a summary is made ahead only for what masking cannot absorb.
                let most_masked = tokens.saturating_sub(mask.spare);
                self.start_background(request, splice.as_ref(), &mask, count, most_masked);
            }
            return self.reuse(request.scan, splice.as_ref(), &mask, tokens, figures);
        };
        let mut refine_ahead = false;
        if let Some(staged) = staged {
            match self.staged_view(request, staged).await {
                Ok(Some((ready, ready_mask, ready_count, ready_tokens))) => {
                    self.promote(request, &ready).await;
                    if request.limits.check(ready_count, ready_tokens).is_none() {
                        self.metrics.summarizer_wait.observe(0.0);
                        // With slow summaries the next one starts now if the spliced request
                        // is already over the watermark, not a turn later.
                        if request.slow_summaries {
                            let most_masked = ready_tokens.saturating_sub(ready_mask.spare);
                            self.start_background(
                                request,
                                Some(&ready),
                                &ready_mask,
                                ready_count,
                                most_masked,
                            );
                        }
                        return self.reuse(
                            request.scan,
                            Some(&ready),
                            &ready_mask,
                            ready_tokens,
                            figures,
                        );
                    }
                    // Still over: compact further, refining the staged summary (with slow
                    // summaries, in the background below the wait threshold).
                    refine_ahead = request.slow_summaries;
                    splice = Some(ready);
                    mask = ready_mask;
                    (count, tokens) = (ready_count, ready_tokens);
                }
                Ok(None) => {}
                Err(e) => return self.not_understood(Some(trigger), &e),
            }
        }
        // The summary this request needs is being made ahead (or started now to refine the
        // staged one) and the request fits with room to spare: it goes on as it is rather
        // than waiting, and a later request splices the summary once it is ready. (A request
        // that finds another request making it waits for that one: it is due now.)
        if tokens < request.limits.wait_threshold
            && (self
                .background
                .is_running(&self.flight_key(request, splice.as_ref()))
                || refine_ahead
                    && self.start_background(request, splice.as_ref(), &mask, count, tokens))
        {
            self.metrics.compaction_deferred();
            return self.reuse(request.scan, splice.as_ref(), &mask, tokens, figures);
        }
        if !self.breaker_allows(request.tenant, request.session).await {
            self.record(trigger, CompactionOutcome::Breaker);
            return self
                .without_summary(request, splice.as_ref(), mask, figures)
                .await;
        }
        let transcript = match request.scan.transcript(request.limits.opening_budget) {
            Ok(t) => t,
            Err(e) => return self.not_understood(Some(trigger), &e),
        };

        let covered = splice.as_ref().map_or(0, |s| s.covered);
        let key = self.flight_key(request, splice.as_ref());
        let started = Instant::now();
        let forwarded_body = self.forwarded_body(request, splice.as_ref(), &mask);
        let forwarded = forwarded_body
            .as_deref()
            .map(|body| Forwarded { body, tokens });
        // The leader keeps its own result; waiters get `()` and read what it stored.
        let mut led: Option<Result<Compacted, Failure>> = None;
        let slot = &mut led;
        let splice_ref = splice.as_ref();
        let transcript_ref = &transcript;
        let claim_key = key.clone();
        let flight = self
            .flights
            .run(key, self.flight_wait, move || async move {
                // Another process sharing the store may be compacting the same prefix.
                let Some(_lease) = self.claim(&claim_key, self.flight_wait).await else {
                    return;
                };
                // A flight that ended between this request's lookup and now left a newer
                // checkpoint: compacting again would call the summarizer a second time.
                let newer = self
                    .find_checkpoint(request.tenant, &request.scan.messages)
                    .await;
                if newer.is_some_and(|c| c.covered > covered) {
                    return;
                }
                *slot = Some(
                    self.compact_and_store(request, transcript_ref, splice_ref, None, forwarded)
                        .await,
                );
            })
            .await;
        figures.summarizer_time += started.elapsed();
        self.metrics
            .summarizer_wait
            .observe(started.elapsed().as_secs_f64());
        // A request that waited, or found a newer checkpoint, uses what the other one stored.
        let result = match (flight, led) {
            (Ok(f), Some(result)) if f.led => result,
            _ => return self.after_wait(request, trigger, figures).await,
        };
        self.metrics
            .compaction_duration
            .observe(started.elapsed().as_secs_f64());
        if result.is_ok() {
            self.pace.summary_took(started.elapsed());
        }
        // A rewrite still over the trigger makes the next request compact again: it is
        // forwarded (it is smaller and valid) but counts as a failure toward the breaker, so a
        // conversation that cannot be brought under its limits stops calling the summarizer.
        let succeeded = match &result {
            Ok(c) => !c.still_over(&request.limits),
            Err(_) => false,
        };
        let session = request.session;
        self.feed_breaker(request.tenant, session, succeeded).await;
        match result {
            Ok(Compacted {
                body,
                compaction,
                masked,
                ..
            }) => {
                self.record(trigger, CompactionOutcome::Compacted);
                figures.masked_outputs = masked;
                if !succeeded {
                    tracing::warn!(
                        session,
                        tokens_after = compaction.result.post_tokens,
                        "compacted request is still over the trigger; counted toward the session breaker"
                    );
                }
                let mut result = compaction.result.clone();
                result.pre_tokens = request.scan.tokens;
                self.log_compaction(session, trigger, request.scan.len(), &compaction, started);
                Outcome::Rewritten {
                    body: Bytes::from(body),
                    result,
                    trigger,
                }
            }
            Err(e) => {
                let outcome = e.outcome();
                self.record(trigger, outcome);
                self.log_failure(session, trigger, outcome);
                tracing::warn!(
                    session,
                    trigger = trigger.label(),
                    outcome = outcome.label(),
                    error = %e,
                    "compaction failed; forwarding the request without a new summary"
                );
                match self
                    .without_summary(request, splice.as_ref(), mask, figures)
                    .await
                {
                    Outcome::Unchanged => Outcome::Failed,
                    reused => reused,
                }
            }
        }
    }

    /// Whether the conversation's breaker lets a compaction run now. Every path that may call
    /// the summarizer asks (the trigger, a refusal for length, a summary made ahead, a manual
    /// compaction), so one breaker bounds a conversation whatever starts the attempt. A store
    /// that cannot answer lets it run.
    async fn breaker_allows(&self, tenant: TenantId, session: &str) -> bool {
        self.store
            .compaction_allowed(tenant, session)
            .await
            .unwrap_or(true)
    }

    /// Tells the conversation's breaker how an attempt it allowed ended (see
    /// [`Pipeline::breaker_allows`]); counts and logs the breaker opening.
    async fn feed_breaker(&self, tenant: TenantId, session: &str, succeeded: bool) {
        if let Ok(true) = self
            .store
            .record_compaction(tenant, session, succeeded)
            .await
        {
            self.metrics.breaker_open.inc();
            tracing::warn!(session, "session breaker open: automatic compaction paused");
        }
    }

    /// A body the scan read but whose messages the dialect does not understand: forwarded
    /// unchanged, counted as a failure when a compaction was due.
    fn not_understood(&self, due: Option<Trigger>, e: &DialectError) -> Outcome {
        let Some(trigger) = due else {
            tracing::debug!(error = %e, "chat body not parseable; forwarding unchanged");
            return Outcome::Unchanged;
        };
        self.record(trigger, CompactionOutcome::Failed);
        tracing::warn!(error = %e, "compaction due but the body is not understood; forwarding unchanged");
        Outcome::Failed
    }

    /// Validates a checkpoint against the request and renders its summary message; `None`
    /// when it cannot stand in for a prefix of this request.
    fn splice(
        &self,
        scan: &Scan<'_>,
        checkpoint: Arc<Checkpoint>,
    ) -> Result<Option<Splice>, DialectError> {
        // The head the summary was made after (the covered prefix is the one it was made
        // from, so that head is this request's too); one stored before openings were kept
        // follows the head without the opening.
        let head = match checkpoint.head {
            Some(head) => head,
            None => scan.head_len(0)?,
        };
        let covered = checkpoint.covered;
        // The summary replaces whole turns after the system head, and a tail must remain.
        if covered <= head || covered >= scan.len() {
            return Ok(None);
        }
        Ok(Some(Splice {
            head,
            covered,
            message: summary_message(
                &checkpoint.summary,
                &checkpoint.read_files,
                &checkpoint.modified_files,
            ),
            checkpoint,
        }))
    }

    /// Messages and estimated tokens the upstream receives after the splice and `mask`.
    fn view_size(
        &self,
        scan: &Scan<'_>,
        splice: Option<&Splice>,
        mask: &Masking<'_>,
    ) -> (usize, usize) {
        let (count, tokens) = self.spliced_size(scan, splice);
        (count, tokens.saturating_sub(mask.saved))
    }

    /// The body the upstream receives after the splice and `mask` (the request's own bytes
    /// with neither); `None` when it cannot be written (the request then goes as received).
    fn forwarded_body<'r>(
        &self,
        request: &Request<'r, '_>,
        splice: Option<&Splice>,
        mask: &Masking<'_>,
    ) -> Option<Cow<'r, [u8]>> {
        if splice.is_none() && mask.edits.is_empty() {
            return Some(Cow::Borrowed(&request.body[..]));
        }
        let summary = splice.map(|s| (s.head, s.covered, s.message.as_str()));
        request
            .scan
            .rewrite_with(summary, &mask.edits)
            .ok()
            .map(Cow::Owned)
    }

    /// Messages (as the message-count trigger counts them, [`Scan::counted`]) and estimated
    /// tokens the upstream receives after the splice.
    fn spliced_size(&self, scan: &Scan<'_>, splice: Option<&Splice>) -> (usize, usize) {
        match splice {
            None => (scan.counted(0..scan.len()), scan.tokens),
            Some(s) => {
                let tokens = scan
                    .fixed_tokens
                    .saturating_add(scan.tokens_of(0..s.head))
                    .saturating_add(self.engine.estimator().text(&s.message))
                    .saturating_add(scan.tokens_of(s.covered..scan.len()));
                let count = scan.counted(0..s.head) + 1 + scan.counted(s.covered..scan.len());
                (count, tokens)
            }
        }
    }

    /// The request with a stored summary spliced in and the outputs of `mask` masked,
    /// unchanged with neither; `forwarded` is its estimate. A rewrite that fails with the
    /// masks is made without them (counted), one that fails without them forwards the
    /// original bytes.
    fn reuse(
        &self,
        scan: &Scan<'_>,
        splice: Option<&Splice>,
        mask: &Masking<'_>,
        forwarded: usize,
        figures: &mut Figures,
    ) -> Outcome {
        if !mask.edits.is_empty() {
            let summary = splice.map(|s| (s.head, s.covered, s.message.as_str()));
            match (scan.rewrite_with(summary, &mask.edits), splice) {
                (Ok(body), None) => {
                    return Outcome::Masked {
                        body: Bytes::from(body),
                        pre_tokens: scan.tokens,
                        post_tokens: forwarded,
                        masked: mask.masked(),
                    }
                }
                (Ok(body), Some(s)) => {
                    figures.masked_outputs = mask.masked();
                    return self.reused(scan, s, body, forwarded);
                }
                (Err(e), _) => {
                    self.metrics.mask_failed(scan.dialect());
                    tracing::warn!(error = %e, "masking old outputs failed; forwarding them as sent");
                    let unmasked = forwarded.saturating_add(mask.saved);
                    return self.reuse(scan, splice, &Masking::default(), unmasked, figures);
                }
            }
        }
        let Some(s) = splice else {
            return Outcome::Unchanged;
        };
        match scan.rewrite(s.head, s.covered, &s.message) {
            Ok(body) => self.reused(scan, s, body, forwarded),
            Err(e) => {
                tracing::warn!(error = %e, "splicing a stored summary failed; forwarding unchanged");
                Outcome::Unchanged
            }
        }
    }

    /// A body carrying a stored summary, as [`Outcome::Reused`].
    fn reused(&self, scan: &Scan<'_>, s: &Splice, body: Vec<u8>, forwarded: usize) -> Outcome {
        Outcome::Reused {
            body: Bytes::from(body),
            result: CompactionResult {
                summary: s.checkpoint.summary.clone(),
                read_files: s.checkpoint.read_files.clone(),
                modified_files: s.checkpoint.modified_files.clone(),
                pre_tokens: scan.tokens,
                post_tokens: forwarded,
                compaction_num: s.checkpoint.compaction_num,
            },
        }
    }

    /// The masking of the conversation `request` forwards with `splice` (`None`: the whole
    /// request), with the conversation's `staged` summary (made ahead) if it has one; see
    /// [`Pipeline::plan_mask`].
    async fn mask_view<'b>(
        &self,
        request: &Request<'_, 'b>,
        splice: Option<&Splice>,
        staged: Option<&Arc<Checkpoint>>,
    ) -> Masking<'b> {
        if !self.strategy.masks() {
            return Masking::default();
        }
        let view = self.spliced_size(request.scan, splice);
        self.plan_mask(request, splice.map(|s| s.covered), view, staged)
            .await
    }

    /// The masking of the conversation `request` forwards after the first `covered` messages
    /// (a summary's; `None`: the whole request), whose messages and estimated tokens are
    /// `view` before masking; empty unless the strategy masks. `mask` masks every output the
    /// rule allows. `hybrid` masks nothing while `view` is under the request's trigger; over
    /// it, one step masks every maskable output (when even that cannot get back under the
    /// background watermark: none if the `staged` summary made ahead fits the request, else
    /// in `mask_block` blocks; with background summaries off, none unless it leaves room for
    /// one more turn), and never masks fewer than an earlier request of the
    /// conversation did (the session's [`MaskFloor`](crate::session::MaskFloor)), so the
    /// masked prefix only grows and every replica forwards the same bytes. A request whose
    /// outputs cannot be read is forwarded with its outputs as sent (counted).
    async fn plan_mask<'b>(
        &self,
        request: &Request<'_, 'b>,
        covered: Option<usize>,
        view: (usize, usize),
        staged: Option<&Arc<Checkpoint>>,
    ) -> Masking<'b> {
        if !self.strategy.masks() {
            return Masking::default();
        }
        let scan = request.scan;
        let estimator = self.engine.estimator();
        let start = covered.unwrap_or(0);
        let from = match covered.map_or(Ok(0), |covered| scan.verbatim_from(covered)) {
            Ok(from) => from,
            Err(e) => return self.unreadable(scan, &e),
        };
        let find = || Found::in_scan(scan, &self.masker, start);
        if self.strategy != Strategy::Hybrid {
            return match find().and_then(|f| f.weigh(scan, from, estimator, usize::MAX)) {
                Ok(candidates) => candidates.all(),
                Err(e) => self.unreadable(scan, &e),
            };
        }
        let (count, tokens) = view;
        let fits = |limits: Limits| {
            move |saved: usize| limits.check(count, tokens.saturating_sub(saved)).is_none()
        };
        let watermark = request.limits.watermark(self.background_ratio);
        let soft = watermark.unwrap_or(request.limits);
        if fits(soft)(0) {
            // Under the watermark as sent: no step is due and no summary is made ahead, so only
            // the floor an earlier request left is masked, and only its outputs are read
            // (reading and weighing every output of every request doubled a tool-heavy
            // request's cost). A request that cannot hold an output old enough to mask
            // (counted by a substring search) does not ask the store.
            let bound = (start..scan.len())
                .map(|i| scan.outputs_bound(i, self.masker.observations.is_some()))
                .fold(0, usize::saturating_add);
            if self.masker.rule.masked(bound) == 0 {
                return Masking::default();
            }
            let floor = self
                .mask_floor(request, start, MaskNeed { enough: 0, step: 0 })
                .await;
            if floor == 0 {
                return Masking::default();
            }
            return match find().and_then(|f| f.weigh(scan, from, estimator, floor)) {
                Ok(candidates) => candidates.first(floor),
                Err(e) => self.unreadable(scan, &e),
            };
        }
        let found = match find() {
            Ok(found) if found.is_empty() => return Masking::default(),
            Ok(found) => found,
            Err(e) => return self.unreadable(scan, &e),
        };
        let candidates = match found.weigh(scan, from, estimator, usize::MAX) {
            Ok(candidates) => candidates,
            Err(e) => return self.unreadable(scan, &e),
        };
        // A step masks every maskable output (all but the `keep_recent_outputs` most recent),
        // as Anthropic's context editing clears all but the most recent tool results: that
        // buys the most headroom, so the next step (a break in the provider's prompt cache) is
        // as far away as it can be, and the request is smallest. Masking only down to the
        // watermark broke the prefix more often for more tokens forwarded, with the same
        // summarizer calls (README's long-session replay).
        //
        // When masking every maskable output cannot get back under the background watermark,
        // a step buys a request or two: the next one is over its trigger again and masks one
        // output more, a break of the prefix each time. So a summary made ahead, when one is
        // ready and fits this request, stands in (no step: the request goes over its trigger
        // and splices it, far under); one that does not fit (an edited conversation) would
        // mean a summary on the request path. Without one, masking moves in whole blocks of
        // `mask_block` (as `mask` does) if that is enough for the trigger; else every maskable
        // output, if that is enough (a summary would change the prefix too, and costs a call,
        // on the request path); and not at all otherwise (the request is summarised).
        //
        // Without background summaries there is no watermark and no summary made ahead: a
        // step must leave room under the trigger for the next request, about one more turn
        // like the last (its call and output), or the next request is over again and masks
        // one output more, a break of the prefix on every request until the conversation is
        // summarised anyway. Such a request is summarised now instead.
        let enough = candidates.needed(fits(request.limits));
        let all = candidates.len();
        let target = watermark.unwrap_or_else(|| {
            let turn = scan.len().saturating_sub(TURN)..scan.len();
            request.limits.less(turn.len(), scan.tokens_of(turn))
        });
        let step = if enough == 0 {
            0
        } else if fits(target)(candidates.saving(all)) {
            all
        } else if watermark.is_none()
            || staged.is_some_and(|c| matches!(self.splice(scan, c.clone()), Ok(Some(_))))
        {
            0
        } else {
            let block = self.masker.block.max(1);
            let blocks = all / block * block;
            if blocks < enough && fits(request.limits)(candidates.saving(all)) {
                all
            } else {
                blocks
            }
        };
        let masked = self
            .mask_floor(request, start, MaskNeed { enough, step })
            .await;
        candidates.first(masked)
    }

    /// The request over its trigger forwarded with no new summary: any stored one spliced in,
    /// its outputs masked as [`Pipeline::mask_instead`] says.
    async fn without_summary(
        &self,
        request: &Request<'_, '_>,
        splice: Option<&Splice>,
        mask: Masking<'_>,
        figures: &mut Figures,
    ) -> Outcome {
        let mask = self.mask_instead(request, splice, mask).await;
        let (_, tokens) = self.view_size(request.scan, splice, &mask);
        self.reuse(request.scan, splice, &mask, tokens, figures)
    }

    /// `hybrid` over its trigger with no new summary to be had (the conversation's breaker is
    /// open, or the summary failed): masking every maskable output stands in for it, so the
    /// request is as small as masking can make it, and the mask floor keeps the step for the
    /// requests after it. Other strategies, and a `mask` that already masks as much, are left
    /// as they are.
    async fn mask_instead<'b>(
        &self,
        request: &Request<'_, 'b>,
        splice: Option<&Splice>,
        mask: Masking<'b>,
    ) -> Masking<'b> {
        if self.strategy != Strategy::Hybrid {
            return mask;
        }
        let scan = request.scan;
        let start = splice.map_or(0, |s| s.covered);
        let from = match splice.map_or(Ok(0), |s| scan.verbatim_from(s.covered)) {
            Ok(from) => from,
            Err(_) => return mask,
        };
        let candidates = Found::in_scan(scan, &self.masker, start)
            .and_then(|f| f.weigh(scan, from, self.engine.estimator(), usize::MAX));
        let candidates = match candidates {
            Ok(c) if c.len() > mask.masked() => c,
            _ => return mask,
        };
        let all = candidates.len();
        let need = MaskNeed {
            enough: all,
            step: all,
        };
        let masked = self.mask_floor(request, start, need).await;
        candidates.first(masked)
    }

    /// How many outputs `request` masks, from the conversation's stored mask floor and what
    /// it `need`s (see [`MaskFloor::raise`]).
    async fn mask_floor(&self, request: &Request<'_, '_>, covered: usize, need: MaskNeed) -> usize {
        self.store
            .raise_mask_floor(request.tenant, request.session, covered, need)
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "mask floor unavailable; masking as if it were the first step");
                MaskFloor::raise(None, covered, need).1
            })
    }

    /// Old outputs that cannot be read: forwarded as sent, counted.
    fn unreadable<'b>(&self, scan: &Scan<'_>, e: &DialectError) -> Masking<'b> {
        self.metrics.mask_failed(scan.dialect());
        tracing::warn!(error = %e, "old outputs not readable; forwarding them as sent");
        Masking::default()
    }

    /// After waiting on another request's compaction: splice whatever it stored. A request
    /// that needed compaction and is still over its limits afterwards (the other compaction
    /// failed, stored nothing, or covers too little) is counted and logged as failed, never
    /// forwarded silently.
    async fn after_wait(
        &self,
        request: &Request<'_, '_>,
        trigger: Trigger,
        figures: &mut Figures,
    ) -> Outcome {
        let scan = request.scan;
        let splice = self.stored_splice(request).await;
        if let Some(s) = &splice {
            // What it waited for may have been a background summary: needed now.
            self.promote(request, s).await;
        }
        let mask = self.mask_view(request, splice.as_ref(), None).await;
        let (count, tokens) = self.view_size(scan, splice.as_ref(), &mask);
        let outcome = self.reuse(scan, splice.as_ref(), &mask, tokens, figures);
        if request.limits.check(count, tokens).is_none() {
            return outcome;
        }
        self.record(trigger, CompactionOutcome::Failed);
        tracing::warn!(
            session = request.session,
            trigger = trigger.label(),
            messages = count,
            tokens,
            "compaction due but the concurrent compaction this request waited for did not bring it under the limits"
        );
        match outcome {
            Outcome::Unchanged => Outcome::Failed,
            reused => reused,
        }
    }

    /// The stored checkpoint that can stand in for a prefix of `scan`, if any.
    async fn stored_splice(&self, request: &Request<'_, '_>) -> Option<Splice> {
        let scan = request.scan;
        let checkpoint = self.lookup(request.tenant, &scan.messages).await?;
        self.splice(scan, checkpoint).ok().flatten()
    }

    /// A compaction that is not the trigger's (manual, or after a refusal for length):
    /// beyond any stored checkpoint, timed from `started`.
    async fn compact_now(
        &self,
        request: &Request<'_, '_>,
        transcript: &Transcript,
        instructions: Option<&str>,
        started: Instant,
    ) -> Result<Compacted, Failure> {
        let splice = self.stored_splice(request).await;
        let result = self
            .compact_and_store(request, transcript, splice.as_ref(), instructions, None)
            .await;
        self.metrics
            .compaction_duration
            .observe(started.elapsed().as_secs_f64());
        result
    }

    /// Compacts (beyond any spliced prefix), rewrites, and stores the new checkpoint.
    async fn compact_and_store(
        &self,
        request: &Request<'_, '_>,
        transcript: &Transcript,
        splice: Option<&Splice>,
        instructions: Option<&str>,
        forwarded: Option<Forwarded<'_>>,
    ) -> Result<Compacted, Failure> {
        let mut compaction = self
            .compact_view(request, transcript, splice, instructions, forwarded)
            .await?;
        let summary = (
            compaction.head,
            compaction.boundary,
            compaction.summary_message.as_str(),
        );
        // The tail after the new summary is masked by the same rule as any later request's.
        let view = (compaction.counted, compaction.result.post_tokens);
        let mut mask = self
            .plan_mask(request, Some(compaction.boundary), view, None)
            .await;
        let body = match request.scan.rewrite_with(Some(summary), &mask.edits) {
            Ok(body) => body,
            Err(e) if !mask.edits.is_empty() => {
                self.metrics.mask_failed(request.scan.dialect());
                tracing::warn!(error = %e, "masking old outputs failed; forwarding them as sent");
                mask = Masking::default();
                request.scan.rewrite(summary.0, summary.1, summary.2)?
            }
            Err(e) => return Err(e.into()),
        };
        let stored = self.store_checkpoint(request, &compaction, None).await;
        compaction.result.post_tokens = compaction.result.post_tokens.saturating_sub(mask.saved);
        Ok(Compacted {
            body,
            compaction,
            stored,
            masked: mask.masked(),
        })
    }

    /// Compacts the request beyond any spliced prefix: the engine's result, its boundary
    /// counted in the request's own messages. With the request as `forwarded`, the first
    /// summarizer call may be asked inside it: when it fits the window beside the answer (with
    /// a twentieth to spare for the estimate's error) and costs less than the standalone
    /// prompt at the model's prices, the forwarded request read from the provider's cache as
    /// the agents' own compaction reads it (GPT-4o's cache at half the input price makes a
    /// conversation of full tool outputs dearer than a prompt of truncated ones; a tenth
    /// makes it far cheaper). A model without a price is asked inside, as the agents ask.
    async fn compact_view(
        &self,
        request: &Request<'_, '_>,
        transcript: &Transcript,
        splice: Option<&Splice>,
        instructions: Option<&str>,
        forwarded: Option<Forwarded<'_>>,
    ) -> Result<Compaction, CompactError> {
        let scan = request.scan;
        let estimator = self.engine.estimator();
        let window = request.limits.summarizer_window;
        let room = window.saturating_sub(window / 20);
        let dialect = scan.dialect();
        let price = scan
            .model
            .as_deref()
            .and_then(|m| self.engine.models().price(m));
        let ask = |turn: &str, max_output: u32, prompt_tokens: usize| -> Option<Arc<[u8]>> {
            let f = forwarded?;
            let turn_tokens = estimator.text(turn);
            let needed = f.tokens.saturating_add(turn_tokens);
            if needed.saturating_add(max_output as usize) > room {
                return None;
            }
            if let Some(p) = price {
                let inside = f.tokens as f64 * p.cache_read() + turn_tokens as f64 * p.input;
                if inside >= prompt_tokens as f64 * p.input {
                    return None;
                }
            }
            match dialect.ask_for_summary(f.body, turn, max_output) {
                Ok((body, asked)) if needed.saturating_add(asked) <= room => Some(body.into()),
                Ok(_) => None,
                Err(e) => {
                    tracing::debug!(error = %e, "the summary cannot be asked inside this conversation");
                    None
                }
            }
        };
        // The engine sees the conversation without the covered prefix (after the head the
        // stored summary follows); the prior summary travels in `<prior-summary>` and is
        // refined, not repeated.
        let (view, offset) = match splice {
            None => (None, 0),
            Some(s) => (
                Some(transcript.without(s.head..s.covered)),
                s.covered - s.head,
            ),
        };
        // The stored summary is refined, its file lists carried forward.
        let prior = splice.map(|s| Prior {
            summary: s.checkpoint.summary.clone(),
            read_files: s.checkpoint.read_files.clone(),
            modified_files: s.checkpoint.modified_files.clone(),
            compaction_num: s.checkpoint.compaction_num,
        });
        let mut compaction = self
            .engine
            .compact(CompactionInput {
                transcript: view.as_ref().unwrap_or(transcript),
                model: scan.model.as_deref(),
                limits: request.limits,
                fixed_tokens: scan.fixed_tokens,
                prior: prior.as_ref(),
                instructions,
                caller: request.caller,
                attempts: request.attempts,
                smallest_tail: request.pays,
                in_conversation: forwarded.is_some().then_some(InConversation(&ask)),
            })
            .await?;
        compaction.boundary += offset;
        self.record_summarizer_cost(request, &compaction).await;
        Ok(compaction)
    }

    /// Adds what a compaction's summaries cost (as the backend reported, at the models
    /// table's prices) to the conversation's cost in the store (the admin API's session
    /// detail). Nothing for a backend that reports nothing or a model without a price.
    async fn record_summarizer_cost(&self, request: &Request<'_, '_>, compaction: &Compaction) {
        let usd = self.summary_usd(compaction);
        if usd <= 0.0 {
            return;
        }
        let cost = SessionCost {
            summarizer_usd: usd,
            ..SessionCost::default()
        };
        if let Err(e) = self
            .store
            .record_cost(request.tenant, request.session, cost)
            .await
        {
            tracing::debug!(error = %e, "summarizer cost not recorded");
        }
    }

    /// What a compaction's summarizer calls cost, in USD (priced models that report usage).
    fn summary_usd(&self, compaction: &Compaction) -> f64 {
        let models = self.engine.models();
        compaction
            .usage
            .iter()
            .filter_map(|u| Some(Bill::of(&u.into(), &models.price(&u.model)?).total()))
            .sum()
    }

    /// The single flight of a summary of `request`'s conversation after `splice`.
    fn flight_key(&self, request: &Request<'_, '_>, splice: Option<&Splice>) -> FlightKey {
        FlightKey {
            tenant: request.tenant,
            session: request.session.to_string(),
            covered: splice.map_or(0, |s| s.covered),
        }
    }

    /// A staged summary spliced into the request, with the outputs masked after it, and the
    /// messages and estimated tokens the upstream would receive; `None` when it cannot stand in
    /// for a prefix of this request.
    async fn staged_view<'b>(
        &self,
        request: &Request<'_, 'b>,
        staged: Arc<Checkpoint>,
    ) -> Result<Option<(Splice, Masking<'b>, usize, usize)>, DialectError> {
        let Some(ready) = self.splice(request.scan, staged)? else {
            return Ok(None);
        };
        let mask = self.mask_view(request, Some(&ready), None).await;
        let (count, tokens) = self.view_size(request.scan, Some(&ready), &mask);
        Ok(Some((ready, mask, count, tokens)))
    }

    /// Below the trigger, where compacting pays ([`payback`]): a summary made ahead is spliced
    /// in if one is ready and makes the request smaller, else one is started in the
    /// background. Either way the request goes on at once: it fits its window.
    async fn pay_back(
        self: &Arc<Self>,
        request: &Request<'_, '_>,
        splice: Option<&Splice>,
        staged: Option<Arc<Checkpoint>>,
        mask: &Masking<'_>,
        tokens: usize,
        figures: &mut Figures,
    ) -> Outcome {
        let Some(staged) = staged else {
            self.spawn_background(request, splice, mask, Trigger::Cost);
            return self.reuse(request.scan, splice, mask, tokens, figures);
        };
        if let Ok(Some((ready, ready_mask, _, ready_tokens))) =
            self.staged_view(request, staged).await
        {
            if ready_tokens < tokens {
                self.promote(request, &ready).await;
                return self.reuse(
                    request.scan,
                    Some(&ready),
                    &ready_mask,
                    ready_tokens,
                    figures,
                );
            }
        }
        self.reuse(request.scan, splice, mask, tokens, figures)
    }

    /// Starts the summary of a request over the background watermark (below the trigger) off
    /// the request path, unless background summaries are off; see
    /// [`Pipeline::spawn_background`]. Whether it started one.
    fn start_background(
        self: &Arc<Self>,
        request: &Request<'_, '_>,
        splice: Option<&Splice>,
        mask: &Masking<'_>,
        count: usize,
        tokens: usize,
    ) -> bool {
        let Some(trigger) = request
            .background_at
            .and_then(|soft| soft.check(count, tokens))
        else {
            return false;
        };
        self.spawn_background(request, splice, mask, trigger)
    }

    /// Starts the summary of a request off the request path, unless one of this prefix is
    /// already being made or was tried before (a failed one is not retried: the request
    /// crossing the trigger compacts), or all `summarizer.max_concurrent` slots are taken
    /// (counted `busy`). Whether it started one.
    fn spawn_background(
        self: &Arc<Self>,
        request: &Request<'_, '_>,
        splice: Option<&Splice>,
        mask: &Masking<'_>,
        trigger: Trigger,
    ) -> bool {
        let key = self.flight_key(request, splice);
        if self.flights.is_running(&key) || !self.background.first_attempt(&key) {
            return false;
        }
        let forwarded = self.forwarded_body(request, splice, mask).map(|body| {
            let body = match body {
                Cow::Borrowed(_) => request.body.clone(),
                Cow::Owned(body) => Bytes::from(body),
            };
            (body, self.view_size(request.scan, splice, mask).1)
        });
        let job = BackgroundJob {
            dialect: request.scan.dialect(),
            body: request.body.clone(),
            caller: request.caller.clone(),
            session: request.session.to_string(),
            limits: request.limits.for_background(self.background_ratio),
            key,
            trigger,
            forwarded,
        };
        let this = self.clone();
        // Running from now, not from when the task is first polled: a request answered before
        // then is never told no summary runs (the gauge is what tests and dashboards wait on).
        let running = Running::start(&self.metrics);
        let key = job.key.clone();
        let started = self.background.spawn(&key, async move {
            let _running = running;
            this.compact_in_background(job).await
        });
        if !started {
            self.metrics.background_compaction(BackgroundOutcome::Busy);
        }
        started
    }

    /// A background summary: made as the request path would make it, within the single
    /// flight of its prefix (so a request crossing the trigger meanwhile waits for it instead
    /// of starting a second), and stored staged unless the conversation was edited meanwhile.
    async fn compact_in_background(self: Arc<Self>, job: BackgroundJob) {
        let started = Instant::now();
        let mut outcome = BackgroundOutcome::Failed;
        let slot = &mut outcome;
        let job_ref = &job;
        let this: &Pipeline = &self;
        let flight = self
            .flights
            .run(job.key.clone(), self.flight_wait, move || async move {
                *slot = this.background_summary(job_ref).await;
            })
            .await;
        if flight.is_ok_and(|f| !f.led) {
            // Another compaction of the prefix ran first: nothing left to do.
            outcome = BackgroundOutcome::Skipped;
        }
        self.metrics.background_compaction(outcome);
        if outcome == BackgroundOutcome::Stored {
            self.record(job.trigger, CompactionOutcome::Compacted);
            self.metrics
                .compaction_duration
                .observe(started.elapsed().as_secs_f64());
            self.pace.summary_took(started.elapsed());
        }
        tracing::info!(
            session = job.session,
            trigger = job.trigger.label(),
            outcome = outcome.label(),
            duration_ms = started.elapsed().as_millis() as u64,
            "background compaction"
        );
    }

    async fn background_summary(&self, job: &BackgroundJob) -> BackgroundOutcome {
        // Another process compacting this prefix already: leave it to them, without waiting.
        let Some(_lease) = self.claim(&job.key, Duration::ZERO).await else {
            return BackgroundOutcome::Skipped;
        };
        let Ok(scan) = job.dialect.scan(&job.body, self.engine.estimator()) else {
            return BackgroundOutcome::Failed;
        };
        let Ok(transcript) = scan.transcript(job.limits.opening_budget) else {
            return BackgroundOutcome::Failed;
        };
        let request = Request {
            scan: &scan,
            body: &job.body,
            caller: &job.caller,
            tenant: job.key.tenant,
            session: &job.session,
            limits: job.limits,
            background_at: None,
            slow_summaries: false,
            attempts: &Attempts::per_request(),
            pays: job.trigger == Trigger::Cost,
        };
        // The checkpoint in use when the job started; one that covers more (another summary
        // finished first) leaves nothing to do.
        let found = self.find_checkpoint(request.tenant, &scan.messages).await;
        let base = match found {
            Some(c) if c.covered > job.key.covered || c.staged.is_some() => {
                return BackgroundOutcome::Skipped
            }
            other => other,
        };
        let splice = match base.map(|c| self.splice(&scan, c)) {
            Some(Ok(Some(s))) => Some(s),
            Some(_) => return BackgroundOutcome::Failed,
            None => None,
        };
        // The conversation's one breaker: a summary made ahead is an attempt like any other.
        if !self.breaker_allows(request.tenant, request.session).await {
            return BackgroundOutcome::Breaker;
        }
        let compacted = self
            .compact_view(
                &request,
                &transcript,
                splice.as_ref(),
                None,
                job.forwarded.as_ref().map(|(body, tokens)| Forwarded {
                    body,
                    tokens: *tokens,
                }),
            )
            .await;
        let compaction = match compacted {
            // Nothing yet worth summarising ahead (the tail the request keeps holds it all, or
            // a summary would not make it smaller): not a failure of the summarizer, so the
            // breaker is not told (a half-open trial this took waits out its cooldown).
            Err(CompactError::NothingToCompact | CompactError::NotSmaller { .. }) => {
                tracing::debug!(session = job.session, "no summary needed ahead yet");
                return BackgroundOutcome::NotNeeded;
            }
            Err(e) => {
                self.feed_breaker(request.tenant, request.session, false)
                    .await;
                self.log_failure(&job.session, job.trigger, e.outcome());
                tracing::warn!(session = job.session, error = %e, "background compaction failed");
                return BackgroundOutcome::Failed;
            }
            Ok(c) => {
                let fits = request
                    .limits
                    .check(c.counted, c.result.post_tokens)
                    .is_none();
                self.feed_breaker(request.tenant, request.session, fits)
                    .await;
                c
            }
        };
        if self.edited_since(&request, compaction.boundary).await {
            return BackgroundOutcome::Discarded;
        }
        let staged = Staged {
            base: splice.map(|s| s.checkpoint),
        };
        match self
            .store_checkpoint(&request, &compaction, Some(staged))
            .await
        {
            Some(_) => BackgroundOutcome::Stored,
            None => BackgroundOutcome::Failed,
        }
    }

    /// Claims the compaction of `key`'s prefix across the processes sharing the store, waiting
    /// up to `wait` for another's. `None`: another process held it; what it stored is in the
    /// store. A failing store claims nothing and lets this process compact (fail open: at
    /// worst a second summary of the prefix).
    async fn claim(&self, key: &FlightKey, wait: Duration) -> Option<Lease> {
        match self
            .store
            .claim_compaction(key.tenant, &key.session, key.covered, wait)
            .await
        {
            Ok(Claim::Won(lease)) => Some(lease),
            Ok(Claim::Waited) => None,
            Err(e) => {
                tracing::warn!(error = %e, "compaction claim failed; compacting in this process");
                Some(Lease::local())
            }
        }
    }

    /// Whether the session's latest request no longer starts with the first `covered`
    /// messages of `request` (the person edited or rewound the conversation while its summary
    /// was being made): such a summary would never be spliced.
    ///
    /// A latest request shorter than `covered` that `request` extends is not an edit: it is an
    /// earlier request of the conversation (with a shared store, the latest one written may
    /// lag behind the request another replica is answering).
    async fn edited_since(&self, request: &Request<'_, '_>, covered: usize) -> bool {
        let latest = match self.store.latest_request(request.session).await {
            Ok(Some(latest)) if latest.tenant == request.tenant => latest,
            _ => return false,
        };
        let Ok(now) = latest.dialect.scan(&latest.body, self.engine.estimator()) else {
            return true;
        };
        let common = covered.min(now.messages.len());
        let (Some(then), Some(now)) = (
            request.scan.messages.get(..common),
            now.messages.get(..common),
        ) else {
            return true;
        };
        let last = |messages: &[&str]| {
            self.memo
                .chain(&request.tenant, messages)
                .ok()
                .and_then(|h| h.last().copied())
        };
        last(then) != last(now)
    }

    /// Stores a staged checkpoint again as one in use, now that a request needed it, so the
    /// conversation's next requests splice it whatever their size.
    async fn promote(&self, request: &Request<'_, '_>, splice: &Splice) {
        if splice.checkpoint.staged.is_none() {
            return;
        }
        let Some(prefix) = request.scan.messages.get(..splice.covered) else {
            return;
        };
        let Ok(Some(hash)) = self
            .memo
            .chain(&request.tenant, prefix)
            .map(|h| h.last().copied())
        else {
            return;
        };
        let in_use = Arc::new(Checkpoint {
            staged: None,
            ..(*splice.checkpoint).clone()
        });
        if let Err(e) = self
            .store
            .put_checkpoint(request.tenant, hash, in_use)
            .await
        {
            tracing::warn!(error = %e, "promoting a background summary failed");
        }
    }

    /// Stores the checkpoint of a compaction under the chain hash of the prefix it covers.
    async fn store_checkpoint(
        &self,
        request: &Request<'_, '_>,
        compaction: &Compaction,
        staged: Option<Staged>,
    ) -> Option<Arc<Checkpoint>> {
        let prefix = request.scan.messages.get(..compaction.boundary)?;
        let hash = match self
            .memo
            .chain(&request.tenant, prefix)
            .map(|h| h.last().copied())
        {
            Ok(Some(hash)) => hash,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "checkpoint not stored: messages not hashable");
                return None;
            }
        };
        let r = &compaction.result;
        let checkpoint = Arc::new(Checkpoint {
            session_id: request.session.to_string(),
            covered: compaction.boundary,
            head: Some(compaction.head),
            summary: r.summary.clone(),
            read_files: r.read_files.clone(),
            modified_files: r.modified_files.clone(),
            pre_tokens: r.pre_tokens,
            post_tokens: r.post_tokens,
            compaction_num: r.compaction_num,
            created_unix: crate::session::store::unix_now(),
            staged,
        });
        match self
            .store
            .put_checkpoint(request.tenant, hash, checkpoint.clone())
            .await
        {
            Ok(()) => Some(checkpoint),
            Err(e) => {
                tracing::warn!(error = %e, "storing the checkpoint failed; the next request compacts again");
                None
            }
        }
    }

    /// Compacts a chat request the provider refused for its length, to send it once more:
    /// forced, to the window the refusal named (if any), and smaller than what was refused
    /// (`forwarded`, the estimate of the body that was sent). The checkpoint is stored, so the
    /// conversation's next requests splice it. `None` when no smaller request can be made
    /// (counted, and a failure of the conversation's breaker); never fails otherwise, and a
    /// panic is caught and counted. Whether the smaller request worked is the provider's to say:
    /// report its answer with [`Pipeline::retry_answered`].
    pub async fn compact_after_refusal(
        &self,
        dialect: DialectKind,
        body: &Bytes,
        context: &RequestContext<'_>,
        refusal: Overflow,
        forwarded: usize,
    ) -> Option<Smaller> {
        let compacted = AssertUnwindSafe(
            self.compact_after_refusal_unguarded(dialect, body, context, refusal, forwarded),
        )
        .catch_unwind()
        .await;
        compacted.unwrap_or_else(|_| {
            self.record(Trigger::Overflow, CompactionOutcome::Panic);
            tracing::error!("compaction after a refusal for length panicked");
            None
        })
    }

    async fn compact_after_refusal_unguarded(
        &self,
        dialect: DialectKind,
        body: &Bytes,
        context: &RequestContext<'_>,
        refusal: Overflow,
        forwarded: usize,
    ) -> Option<Smaller> {
        let scan = dialect.scan(body, self.engine.estimator()).ok()?;
        let tenant = TenantId::from_caller(context.caller);
        let session = self
            .session_of(&scan, &tenant, context.session_header)
            .await;
        if let Some(model) = scan.model.as_deref() {
            let upstream = &context.caller.upstream_base_url;
            // A refusal that names no window still bounds it: the refused request did not fit.
            // Only a bound below the window in use teaches anything.
            let learned = match refusal.window {
                Some(window) => Some((window, WindowSource::Error)),
                None => {
                    let asked = forwarded.saturating_add(scan.requested_output.unwrap_or(0));
                    let in_use = self
                        .limits(upstream, Some(model), context.long_context, None)
                        .await
                        .context_window;
                    (asked < in_use).then_some((asked, WindowSource::Refused))
                }
            };
            if let Some((window, source)) = learned {
                let model = window_model(model, context.long_context);
                self.learn_window(upstream, &model, window, source).await;
            }
        }
        let limits = self
            .limits(
                &context.caller.upstream_base_url,
                scan.model.as_deref(),
                context.long_context,
                scan.requested_output,
            )
            .await
            .after_refusal(
                self.engine.settings(),
                refusal.window,
                refusal.requested,
                forwarded,
            );
        let request = Request {
            scan: &scan,
            body,
            caller: context.caller,
            tenant,
            session: &session,
            limits,
            background_at: None,
            slow_summaries: false,
            attempts: context.attempts,
            pays: false,
        };
        if context.attempts.left() == 0 {
            // The compaction before the request was sent made every call the request may.
            self.record(Trigger::Overflow, CompactionOutcome::Failed);
            tracing::warn!(
                session,
                "refused for length after this request made every summarizer call it may; not compacted again"
            );
            return None;
        }
        if !self.breaker_allows(tenant, &session).await {
            self.record(Trigger::Overflow, CompactionOutcome::Breaker);
            tracing::warn!(
                session,
                "refused for length while the session breaker is open; not compacted again"
            );
            return None;
        }
        let Ok(transcript) = scan.transcript(request.limits.opening_budget) else {
            self.record(Trigger::Overflow, CompactionOutcome::Failed);
            return None;
        };
        let started = Instant::now();
        let compacted = self.compact_now(&request, &transcript, None, started).await;
        let smaller = matches!(&compacted, Ok(c) if c.compaction.result.post_tokens < forwarded);
        if !smaller {
            self.feed_breaker(tenant, &session, false).await;
        }
        match compacted {
            Ok(Compacted {
                body, compaction, ..
            }) if compaction.result.post_tokens < forwarded => {
                self.record(Trigger::Overflow, CompactionOutcome::Compacted);
                self.history.record(
                    &session,
                    Point::now(
                        scan.tokens,
                        compaction.result.post_tokens,
                        request.limits.token_threshold,
                        Done::Retried,
                        compaction.result.compaction_num,
                    ),
                );
                self.log_compaction(
                    &session,
                    Trigger::Overflow,
                    scan.len(),
                    &compaction,
                    started,
                );
                Some(Smaller {
                    body: Bytes::from(body),
                    tenant,
                    session,
                })
            }
            Ok(_) => {
                self.record(Trigger::Overflow, CompactionOutcome::Failed);
                tracing::warn!(
                    session,
                    "compaction after a refusal for length was not smaller than what was refused"
                );
                None
            }
            Err(e) => {
                self.record(Trigger::Overflow, e.outcome());
                self.log_failure(&session, Trigger::Overflow, e.outcome());
                tracing::warn!(session, error = %e, "compaction after a refusal for length failed");
                None
            }
        }
    }

    /// How the provider answered a request compacted after a refusal for length: a success of
    /// the conversation's breaker unless it refused the smaller request for its length too
    /// (a conversation that cannot be brought under the provider's window stops calling the
    /// summarizer after three such refusals, as after three failed compactions).
    pub async fn retry_answered(&self, retried: &Smaller, refused_for_length: bool) {
        if refused_for_length {
            tracing::warn!(
                session = retried.session,
                "the compacted request was refused for its length too; counted toward the session breaker"
            );
        }
        self.feed_breaker(retried.tenant, &retried.session, !refused_for_length)
            .await;
    }

    /// Compacts the latest request of a session now (admin API), with optional focus
    /// instructions, whatever the triggers say. A panic (a bug) is caught and counted like in
    /// [`Pipeline::handle`].
    pub async fn compact_session(&self, id: &str, instructions: Option<&str>) -> ManualOutcome {
        let compacted = AssertUnwindSafe(self.compact_session_unguarded(id, instructions))
            .catch_unwind()
            .await;
        compacted.unwrap_or_else(|_| {
            self.record(Trigger::Manual, CompactionOutcome::Panic);
            tracing::error!(session = id, "manual compaction panicked");
            ManualOutcome::NotCompacted { reason: "panic" }
        })
    }

    async fn compact_session_unguarded(
        &self,
        id: &str,
        instructions: Option<&str>,
    ) -> ManualOutcome {
        let latest = match self.store.latest_request(id).await {
            Ok(Some(l)) => l,
            Ok(None) => return ManualOutcome::UnknownSession,
            Err(e) => {
                tracing::warn!(error = %e, "session store unavailable");
                return ManualOutcome::NotCompacted {
                    reason: "store_unavailable",
                };
            }
        };
        // The latest request may come from Redis, written by any replica (or anyone who can
        // write Redis). Its destination is where a summarizer without its own `base_url`
        // sends its configured key and the conversation: only an upstream this replica routes
        // to is trusted with them.
        if !self
            .upstreams
            .iter()
            .any(|u| *u == latest.caller.upstream_base_url)
        {
            tracing::warn!(
                session = id,
                "the session's latest request names an upstream this replica does not route to; not compacted"
            );
            return ManualOutcome::NotCompacted {
                reason: "unknown_upstream",
            };
        }
        let not_understood = ManualOutcome::NotCompacted {
            reason: "request_not_understood",
        };
        let Ok(scan) = latest.dialect.scan(&latest.body, self.engine.estimator()) else {
            return not_understood;
        };
        let limits = self
            .limits(
                &latest.caller.upstream_base_url,
                scan.model.as_deref(),
                false,
                scan.requested_output,
            )
            .await;
        let Ok(transcript) = scan.transcript(limits.opening_budget) else {
            return not_understood;
        };
        let request = Request {
            scan: &scan,
            body: &latest.body,
            caller: &latest.caller,
            tenant: latest.tenant,
            session: id,
            limits,
            background_at: None,
            slow_summaries: false,
            attempts: &Attempts::per_request(),
            pays: false,
        };
        if !self.breaker_allows(latest.tenant, id).await {
            self.record(Trigger::Manual, CompactionOutcome::Breaker);
            return ManualOutcome::NotCompacted {
                reason: "breaker_open",
            };
        }
        let started = Instant::now();
        let compacted = self
            .compact_now(&request, &transcript, instructions, started)
            .await;
        let succeeded = matches!(&compacted, Ok(c) if !c.still_over(&request.limits));
        self.feed_breaker(latest.tenant, id, succeeded).await;
        match compacted {
            Ok(Compacted {
                compaction,
                stored: Some(checkpoint),
                ..
            }) => {
                self.record(Trigger::Manual, CompactionOutcome::Compacted);
                self.log_compaction(id, Trigger::Manual, scan.len(), &compaction, started);
                ManualOutcome::Compacted(checkpoint)
            }
            // Made but not stored: nothing of it reaches the session, so the answer and the
            // metric both say so.
            Ok(Compacted { stored: None, .. }) => {
                self.record(Trigger::Manual, CompactionOutcome::NotStored);
                tracing::warn!(
                    session = id,
                    "manual compaction summarised but its checkpoint was not stored"
                );
                ManualOutcome::NotCompacted {
                    reason: "checkpoint_not_stored",
                }
            }
            Err(e) => {
                let outcome = e.outcome();
                self.record(Trigger::Manual, outcome);
                tracing::warn!(session = id, error = %e, "manual compaction did not happen");
                ManualOutcome::NotCompacted {
                    reason: match e {
                        Failure::Engine(CompactError::NothingToCompact) => "nothing_to_compact",
                        Failure::Engine(CompactError::Summarizer(SummarizeError::Blank)) => {
                            "blank_summary"
                        }
                        Failure::Engine(CompactError::Summarizer(_) | CompactError::Timeout(_)) => {
                            "summarizer_failed"
                        }
                        Failure::Engine(CompactError::NotSmaller { .. }) => "not_smaller",
                        Failure::Engine(CompactError::Prompt(_)) => "prompt_too_large",
                        Failure::Engine(CompactError::NoAttemptsLeft) => "summarizer_failed",
                        Failure::Dialect(_) => "rewrite_failed",
                    },
                }
            }
        }
    }

    fn log_compaction(
        &self,
        session: &str,
        trigger: Trigger,
        messages: usize,
        compaction: &Compaction,
        started: Instant,
    ) {
        let r = &compaction.result;
        tracing::info!(
            session,
            trigger = trigger.label(),
            outcome = "compacted",
            messages_before = messages,
            messages_after = compaction.messages,
            tokens_before = r.pre_tokens,
            tokens_after = r.post_tokens,
            compaction_num = r.compaction_num,
            attempts = compaction.attempts,
            summarizer = self.engine.summarizer_name(),
            duration_ms = started.elapsed().as_millis() as u64,
            "compaction"
        );
        if let Some(events) = &self.events {
            let kind = match trigger {
                Trigger::Overflow => event_log::Kind::Retry,
                _ => event_log::Kind::Compaction,
            };
            let usd = self.summary_usd(compaction);
            events.record(
                Event {
                    trigger: Some(trigger.label()),
                    summarizer: Some(self.engine.summarizer_name()),
                    cost_usd: (usd > 0.0).then_some(usd),
                    ..Event::new(kind, session).tokens(r.pre_tokens, r.post_tokens)
                }
                .took(started.elapsed()),
            );
        }
    }

    /// A compaction that was due and did not happen, in the event log.
    fn log_failure(&self, session: &str, trigger: Trigger, outcome: CompactionOutcome) {
        if let Some(events) = &self.events {
            events.record(Event {
                trigger: Some(trigger.label()),
                outcome: Some(outcome.label()),
                summarizer: Some(self.engine.summarizer_name()),
                ..Event::new(event_log::Kind::CompactionFailed, session)
            });
        }
    }

    fn record(&self, trigger: Trigger, outcome: CompactionOutcome) {
        self.metrics.compaction(trigger, outcome);
    }

    /// The session id of a scanned request: the header when sent, else derived from its
    /// opening messages. Two conversations that open alike (the same task started twice)
    /// cannot be told apart until the model's first reply, where they part: the first to
    /// reply keeps the opening's id (so every request of a conversation has one id, its first
    /// included), and another is named by its messages through its own first reply
    /// ([`SessionStore::claim_opening`]). From there on they never share a breaker, a latest
    /// request, summaries made ahead or an admin entry. A store that cannot answer leaves the
    /// opening's id (as before conversations were told apart).
    async fn session_of(&self, scan: &Scan<'_>, tenant: &TenantId, header: Option<&str>) -> String {
        if header.is_some_and(|h| !h.trim().is_empty()) {
            return session_id(tenant, header, &[]);
        }
        let messages = &scan.messages;
        let opening = SESSION_ID_MESSAGES.min(messages.len());
        let through_reply = first_reply(scan.dialect(), messages).map_or(0, |i| i + 1);
        let (opening, then) = messages.split_at(opening);
        let then = &then[..through_reply.saturating_sub(opening.len()).min(then.len())];
        let print = self
            .session_ids
            .print(&messages[..opening.len() + then.len()]);
        if let Some(id) = self.session_ids.get(tenant, print) {
            return id;
        }
        let (id, own) = derived_session_ids(tenant, opening, then);
        let settled = if then.is_empty() {
            id
        } else {
            match self.store.claim_opening(*tenant, &id, &own).await {
                Ok(owner) if owner == own => id,
                Ok(_) => own,
                Err(e) => {
                    // Not remembered: the store may settle it otherwise once it answers.
                    tracing::warn!(error = %e, "session store unavailable; naming the session by its opening");
                    return id;
                }
            }
        };
        self.session_ids.insert(tenant, print, settled.clone());
        settled
    }
}

/// Holds `compactor_background_compactions_running` up while a background summary runs.
struct Running(Arc<Metrics>);

impl Running {
    fn start(metrics: &Arc<Metrics>) -> Running {
        metrics.background_running.inc();
        Running(metrics.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.background_running.dec();
    }
}

/// A request compacted after a refusal for length ([`Pipeline::compact_after_refusal`]).
#[derive(Debug)]
pub struct Smaller {
    /// The smaller body to send once more.
    pub body: Bytes,
    tenant: TenantId,
    session: String,
}

/// What the proxy should forward.
#[derive(Debug, Default)]
pub enum Outcome {
    /// No compaction needed (or the body is not one compactor understands): forward the
    /// original bytes.
    #[default]
    Unchanged,
    /// Forward this body instead of the original.
    Rewritten {
        /// The rewritten request body.
        body: bytes::Bytes,
        /// What the compaction produced.
        result: CompactionResult,
        /// Which trigger fired.
        trigger: Trigger,
    },
    /// No new compaction, but a stored summary of this conversation stands in for the prefix
    /// it covers: forward this body.
    Reused {
        /// The request with the stored summary spliced in.
        body: bytes::Bytes,
        /// The stored compaction's figures, with this request's token estimates.
        result: CompactionResult,
    },
    /// Compaction was needed but did not happen (already counted and logged): forward the
    /// original bytes.
    Failed,
    /// No summary, but old tool outputs masked (`compaction.strategy` `mask` or `hybrid`):
    /// forward this body.
    Masked {
        /// The request with old tool outputs replaced by placeholders.
        body: bytes::Bytes,
        /// Estimated input tokens of the request as received.
        pre_tokens: usize,
        /// Estimated input tokens of `body`.
        post_tokens: usize,
        /// Outputs masked.
        masked: usize,
    },
}

mod background;
pub mod history;
mod masking;
pub mod pace;
mod payback;
mod shadow;

use background::Background;
use history::{Done, History, Point};
use masking::{Found, Masker, Masking};
use pace::Pace;
use payback::{Economics, Payback, Shape};

#[cfg(test)]
mod dialect_props;
#[cfg(test)]
mod engine_tests;
#[cfg(test)]
mod fuzz;
#[cfg(test)]
mod mask_props;
#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
