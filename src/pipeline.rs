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
//!
//! This file holds the types and the construction; the flow lives in one module per concern:
//! `request` (steps 1-2 and the panic guard), `rewrite` (steps 3-5 for a followed
//! conversation), `splice` (checkpoints), `mask_plan` and `mask_candidates` (old outputs),
//! `compacting` (one compaction), `ahead` and `background` (summaries made off the
//! request path), `retry` (compact-and-retry after a refusal for length), `manual` (the
//! admin API's compaction), `windows` (limits), `accounting` (what a request is counted
//! as), `payback`, `pace`, `shadow` and `history`.

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
use crate::compaction::mask_rule::MaskRule;
use crate::compaction::models::{window_model, LearnedWindow, WindowKey, WindowSource};
use crate::compaction::prompt::{summary_message, OUTPUT_CHARS_READ};
use crate::compaction::trigger::{BackgroundOutcome, CompactionOutcome, Limits, Trigger};
use crate::compaction::{Attempts, CompactionResult, MAX_ATTEMPTS_PER_REQUEST};
use crate::config::{Config, Mode, Price, Strategy};
use crate::cost::{cached_prefix, Bill, Repeats};
use crate::dialect::reply::first_reply;
use crate::dialect::scan_memo::{MemoUse, Remembering, ScanMemo};
use crate::dialect::{DialectError, DialectKind, Scan};
use crate::event_log::{self, Event, EventLog};
use crate::metrics::Metrics;
use crate::overflow::Overflow;
use crate::session::hash::SESSION_ID_MESSAGES;
use crate::session::{
    derived_session_ids, session_id, ChainMemo, Checkpoint, Claim, LatestRequest, Lease, MaskFloor,
    MaskNeed, SessionCost, SessionIdMemo, SessionStore, SingleFlight, Staged, StoreError, TenantId,
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
    /// The caller's tenant (hashed from its credential once, for the pipeline and the proxy).
    pub tenant: TenantId,
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

    /// A pipeline with the store `[store]` describes ([`crate::session::store::configured`]).
    pub fn new(config: &Config, summarizer: Arc<dyn Summarizer>, metrics: Arc<Metrics>) -> Self {
        let store = crate::session::store::configured(config, metrics.clone());
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

    /// The engine, for callers that compact parsed transcripts themselves.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The session store (admin API, metrics).
    pub fn store(&self) -> &Arc<dyn SessionStore> {
        &self.store
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

mod accounting;
mod ahead;
mod background;
mod compacting;
pub mod history;
mod manual;
mod mask_candidates;
mod mask_plan;
pub mod pace;
mod payback;
mod request;
mod retry;
mod rewrite;
mod shadow;
mod splice;
mod windows;

use background::Background;
use compacting::transcript_to_summarise;
use history::{Done, History, Point};
use mask_candidates::{Found, Masker, Masking};
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
