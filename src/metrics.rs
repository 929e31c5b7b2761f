//! Metrics: the only module that names a metric.
//!
//! One [`Metrics`] value owns one Prometheus [`Registry`]; nothing is global, so parallel tests
//! (each with its own app) never share counters. Labels are bounded enums or short static
//! strings: never a path, a key or a session id. Each event is recorded through one typed
//! method ([`Metrics::upstream_error`], [`Metrics::compaction`], ...) taking the enums whose
//! `label()` gives the value, so label values are written here or in those `label()` methods
//! and never at a call site. Every labelled counter is created for all its known label values
//! at registration (summarizer backends when the chain is built), so a scrape shows 0, not "no
//! series", before the first event.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use compactor_plugin_api::SummarizeError;
use http::Method;

use prometheus::{
    CounterVec, Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::cohort::Cohort;
use crate::compaction::models::WindowSource;
use crate::compaction::trigger::{BackgroundOutcome, CompactionOutcome, Trigger};
use crate::config::Strategy;
use crate::dialect::DialectKind;
use crate::process::ProcessStats;

/// The session store calls `compactor_store_errors_total` counts, by `op`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOp {
    /// Checkpoint lookups on the request path.
    Lookup,
    /// Storing a checkpoint.
    Put,
    /// Recording a session's latest request.
    Touch,
    /// Admin reads: one session, the list, a latest request.
    Sessions,
    /// The per-session breaker.
    Breaker,
    /// Compaction claims across replicas (take, renew, release, wait).
    Claim,
    /// Learned context windows.
    Windows,
    /// How far `hybrid` has masked a conversation.
    MaskFloor,
    /// The gauges read at scrape time.
    Stats,
    /// A session's spend (for the admin API).
    Cost,
}

impl StoreOp {
    /// Every op (pre-initialised label values).
    pub const ALL: [StoreOp; 10] = [
        StoreOp::Lookup,
        StoreOp::Put,
        StoreOp::Touch,
        StoreOp::Sessions,
        StoreOp::Breaker,
        StoreOp::Claim,
        StoreOp::Windows,
        StoreOp::MaskFloor,
        StoreOp::Stats,
        StoreOp::Cost,
    ];

    /// The `op` label value.
    pub fn label(self) -> &'static str {
        match self {
            StoreOp::Lookup => "lookup",
            StoreOp::Put => "put",
            StoreOp::Touch => "touch",
            StoreOp::Sessions => "sessions",
            StoreOp::Breaker => "breaker",
            StoreOp::Claim => "claim",
            StoreOp::Windows => "windows",
            StoreOp::MaskFloor => "mask_floor",
            StoreOp::Stats => "stats",
            StoreOp::Cost => "cost",
        }
    }
}

/// Latency buckets for whole requests and upstream waits (seconds).
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Buckets for slower work such as compactions and summaries (seconds).
const WORK_BUCKETS: &[f64] = &[
    0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Token-count buckets for request sizes.
const TOKEN_BUCKETS: &[f64] = &[
    100.0,
    500.0,
    1_000.0,
    2_000.0,
    5_000.0,
    10_000.0,
    20_000.0,
    50_000.0,
    100_000.0,
    200_000.0,
    500_000.0,
    1_000_000.0,
];

/// Buckets for the time compactor itself adds to a request (seconds): sub-millisecond first.
const OVERHEAD_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
];

/// Buckets for forwarded ÷ received tokens of a compacted request.
const COMPACTION_RATIO_BUCKETS: &[f64] =
    &[0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0];

/// Buckets for estimated input tokens ÷ the model's context window.
const UTILIZATION_BUCKETS: &[f64] = &[
    0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.1, 1.25, 1.5,
];

/// Buckets for (estimated − actual) ÷ actual input tokens: −1 (estimate 0) up to 4× over.
const ESTIMATE_ERROR_BUCKETS: &[f64] = &[
    -1.0, -0.75, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 4.0,
];

/// Every dialect, in the order of their `dialect` / `route` label values.
const DIALECTS: [DialectKind; DialectKind::COUNT] = DialectKind::ALL;

/// Routes: every dialect, then other routes (`None`).
const ROUTES: usize = DialectKind::COUNT + 1;

/// The `route` label of a request that is not a chat call; chat calls are labelled with their
/// dialect. A closed set, never a raw path.
const OTHER_ROUTE: &str = "other";

/// Values of the `stage` label of `compactor_request_tokens`: as received, with old tool
/// outputs masked (before any new summary; only when `compaction.strategy` masks), and as
/// forwarded.
const TOKEN_STAGES: [&str; 3] = ["received", "masked", "forwarded"];

/// The strategies that mask old tool outputs: the `strategy` label values of
/// `compactor_masked_outputs_total`.
const MASKING_STRATEGIES: [Strategy; 2] = [Strategy::Mask, Strategy::Hybrid];

/// Values of the `result` label of `compactor_config_reloads_total`.
const RELOAD_RESULTS: [&str; 2] = ["ok", "error"];

/// Values of the `result` label of `compactor_checkpoint_lookups_total`.
const LOOKUP_RESULTS: [&str; 2] = ["hit", "miss"];

/// Values of the `outcome` label of `compactor_retries_total`: sent again compacted, or
/// answered with the provider's refusal because no smaller request could be made.
const RETRY_OUTCOMES: [&str; 2] = ["retried", "not_compacted"];

/// The `reason` label of `compactor_retries_total`.
const RETRY_REASON_OVERFLOW: &str = "context_length";

/// Values of the `method` label of `compactor_requests_total` ([`method_label`]).
const METHOD_VALUES: [&str; 8] = [
    "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "other",
];

/// Values of the `status_class` label ([`status_class`]).
const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// The `trigger` label of a compaction event that has no trigger: a panic caught around the
/// whole request, a Responses request whose history is held by the provider, or a body that
/// could not be read.
const NO_TRIGGER: &str = "none";

/// The `outcome` label (with [`NO_TRIGGER`]) of a Responses request passed through because its
/// history lives on the provider (`previous_response_id`, `conversation`).
const SERVER_STATE: &str = "server_state";

/// The `outcome` label (with [`NO_TRIGGER`]) of a chat request whose body compactor could not
/// read (not JSON, or not its dialect's shape): forwarded as sent, for the provider to judge.
const UNREADABLE: &str = "unreadable";

/// The `outcome` labels of `compactor_summarizer_requests_total` for an answer: from the first
/// backend, or from a later one. (Failures are labelled with [`SummarizeError::kind`].)
const SUMMARIZER_ANSWERS: [&str; 2] = ["ok", "fallback_ok"];

/// Why the upstream exchange failed: the `kind` label of `compactor_upstream_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamErrorKind {
    /// Could not connect (refused, DNS, TLS handshake, connect timeout).
    Connect,
    /// No response head within `upstream.response_timeout_secs`.
    Timeout,
    /// Connected, but the exchange failed (reset, malformed response).
    Protocol,
    /// The response head came, but its body broke off (the upstream closed or reset the
    /// stream mid-body): the client got what came before.
    StreamCut,
}

impl UpstreamErrorKind {
    /// Every kind, pre-initialised at registration.
    pub const ALL: [UpstreamErrorKind; 4] = [
        UpstreamErrorKind::Connect,
        UpstreamErrorKind::Timeout,
        UpstreamErrorKind::Protocol,
        UpstreamErrorKind::StreamCut,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            UpstreamErrorKind::Connect => "connect",
            UpstreamErrorKind::Timeout => "timeout",
            UpstreamErrorKind::Protocol => "protocol",
            UpstreamErrorKind::StreamCut => "stream_cut",
        }
    }
}

/// A kind of token the upstream reports in `usage`: the `kind` label of
/// `compactor_upstream_usage_tokens_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageKind {
    /// Input tokens (cached and cache-write ones included).
    Input,
    /// Output tokens.
    Output,
    /// Input tokens read from the provider's prompt cache.
    CacheRead,
    /// Input tokens written to the provider's prompt cache.
    CacheWrite,
}

impl UsageKind {
    /// Every kind, pre-initialised at registration.
    pub const ALL: [UsageKind; 4] = [
        UsageKind::Input,
        UsageKind::Output,
        UsageKind::CacheRead,
        UsageKind::CacheWrite,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            UsageKind::Input => "input",
            UsageKind::Output => "output",
            UsageKind::CacheRead => "cache_read",
            UsageKind::CacheWrite => "cache_write",
        }
    }
}

/// How the provider refused a chat request for its length: the `via` label of
/// `compactor_retries_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalVia {
    /// An error status (400, 413, 422, 500) with the refusal as its body.
    Status,
    /// A `200` event stream whose first event after the preamble is the refusal (Responses
    /// `response.failed`, an Anthropic `error` event, a Chat Completions error chunk).
    Stream,
}

impl RefusalVia {
    /// Every way, pre-initialised at registration.
    pub const ALL: [RefusalVia; 2] = [RefusalVia::Status, RefusalVia::Stream];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            RefusalVia::Status => "status",
            RefusalVia::Stream => "stream",
        }
    }
}

/// A reload that changed where requests go or tried to remove admin auth: the `change` label
/// of `compactor_config_risky_reloads_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RiskyChange {
    /// Applied: the default upstream, a route or a summarizer endpoint changed.
    Upstream,
    /// Refused: the new file had no `admin.token` while the running one had.
    AdminAuthRemoved,
}

impl RiskyChange {
    /// Every change, pre-initialised at registration.
    pub const ALL: [RiskyChange; 2] = [RiskyChange::Upstream, RiskyChange::AdminAuthRemoved];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            RiskyChange::Upstream => "upstream",
            RiskyChange::AdminAuthRemoved => "admin_auth_removed",
        }
    }
}

/// How an upgrade request (WebSocket) ended (`compactor_tunnels_total{outcome}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TunnelOutcome {
    /// The upstream switched protocols and the two connections were joined.
    Opened,
    /// The upstream answered something other than `101`, passed back as it came.
    Refused,
    /// The upstream switched protocols but an upgraded connection could not be taken over.
    Failed,
    /// `server.max_connections` tunnels were open: forwarded as a plain request.
    Busy,
}

impl TunnelOutcome {
    /// Every outcome, pre-initialised at registration.
    pub const ALL: [TunnelOutcome; 4] = [
        TunnelOutcome::Opened,
        TunnelOutcome::Refused,
        TunnelOutcome::Failed,
        TunnelOutcome::Busy,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            TunnelOutcome::Opened => "opened",
            TunnelOutcome::Refused => "refused",
            TunnelOutcome::Failed => "failed",
            TunnelOutcome::Busy => "busy",
        }
    }
}

/// Holds `compactor_tunnels_open` up while a tunnel is open.
pub struct TunnelOpen(IntGauge);

impl Drop for TunnelOpen {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Every metric compactor exports.
pub struct Metrics {
    registry: Registry,
    /// `compactor_requests_total{route,method,status_class}`
    requests: IntCounterVec,
    /// `compactor_upstream_ttfb_seconds`
    upstream_ttfb: Histogram,
    /// `compactor_in_flight_requests`
    in_flight: IntGauge,
    /// `compactor_upstream_errors_total{kind}`
    upstream_errors: IntCounterVec,
    /// `compactor_build_info{version}`
    build_info: IntGaugeVec,
    /// `compactor_compactions_total{trigger,outcome}`
    compactions: IntCounterVec,
    /// `compactor_compaction_duration_seconds`
    pub compaction_duration: Histogram,
    /// `compactor_summarizer_wait_seconds`
    pub summarizer_wait: Histogram,
    /// `compactor_unbuffered_requests_total`
    unbuffered_requests: IntCounter,
    /// `compactor_background_compactions_total{outcome}`
    background_compactions: IntCounterVec,
    /// `compactor_background_compactions_running`
    pub background_running: IntGauge,
    /// `compactor_compactions_deferred_total`
    compactions_deferred: IntCounter,
    /// `compactor_tunnels_total{outcome}`
    tunnels: IntCounterVec,
    /// `compactor_tunnels_open`
    tunnels_open: IntGauge,
    /// `compactor_request_tokens_estimated`
    pub request_tokens_estimated: Histogram,
    /// `compactor_tokens_saved_total`
    pub tokens_saved: IntCounter,
    /// `compactor_summarizer_requests_total{backend,outcome}`
    summarizer_requests: IntCounterVec,
    /// `compactor_summarizer_duration_seconds{backend}`
    summarizer_duration: HistogramVec,
    /// `compactor_retries_total{reason,outcome,via}`
    retries: IntCounterVec,
    /// `compactor_context_window_learned_total{source}`
    windows_learned: IntCounterVec,
    /// `compactor_cost_usd_total{dialect,kind}`
    cost: CounterVec,
    /// `compactor_cost_without_compactor_usd_total{dialect}`
    cost_without: CounterVec,
    /// `compactor_over_window_without_compactor_total{dialect}`
    over_window_without: IntCounterVec,
    /// `compactor_store_errors_total{op}`
    store_errors: IntCounterVec,
    /// `compactor_sessions`
    pub sessions: IntGauge,
    /// `compactor_store_evictions_total`: raised through [`Metrics::observe_store_evictions`].
    pub store_evictions: IntCounter,
    /// The store's eviction total already added to `store_evictions`.
    store_evictions_counted: AtomicU64,
    /// `compactor_breaker_open_total`
    pub breaker_open: IntCounter,
    /// `compactor_request_tokens{dialect,stage}`: estimated input tokens as received and as
    /// forwarded (`stage` ∈ [`TOKEN_STAGES`]).
    request_tokens: HistogramVec,
    /// `compactor_compaction_ratio`: forwarded ÷ received estimated tokens of compacted
    /// requests.
    compaction_ratio: Histogram,
    /// `compactor_estimate_error_ratio`: (estimated − actual) ÷ actual input tokens.
    estimate_error: Histogram,
    /// `compactor_config_reloads_total{result}` (`result` ∈ [`RELOAD_RESULTS`]).
    config_reloads: IntCounterVec,
    /// `compactor_config_risky_reloads_total{change}` (`change` ∈ [`RiskyChange`]).
    risky_reloads: IntCounterVec,
    /// `compactor_masked_outputs_total{dialect,strategy}`: tool outputs replaced by a
    /// placeholder in forwarded requests.
    masked_outputs: IntCounterVec,
    /// `compactor_mask_failures_total{dialect}`: requests whose old outputs could not be
    /// masked and were forwarded as sent.
    mask_failures: IntCounterVec,
    /// `compactor_compaction_strategy{strategy}`: 1 for the strategy in use, 0 for the others.
    strategy: IntGaugeVec,
    /// `compactor_client_send_timeouts_total`: connections closed because the client read
    /// nothing for the client timeout.
    client_send_timeouts: IntCounter,
    /// `compactor_request_duration_seconds{route}`, `compactor_overhead_seconds{route}` (see
    /// [`crate::timing::Overhead`]), `compactor_checkpoint_lookups_total{result}`,
    /// `compactor_context_utilization_ratio{dialect}` (estimated input tokens ÷ the model's
    /// context window), `compactor_upstream_usage_tokens_total{kind}` and the received and
    /// forwarded `compactor_request_tokens`: every child, looked up once.
    hot: Hot,
    /// The `compactor_cohort_*` series, per cohort.
    cohorts: Cohorts,
    /// The `process_*` series, read from `/proc` at each scrape.
    process: Process,
}

/// `process_resident_memory_bytes`, `process_open_fds`, `process_max_fds`,
/// `process_cpu_seconds_total`, `process_start_time_seconds`.
struct Process {
    resident: IntGauge,
    open_fds: IntGauge,
    max_fds: IntGauge,
    cpu: prometheus::Counter,
    start_time: prometheus::Gauge,
    /// Held while updating, so concurrent scrapes add the CPU time once.
    updating: std::sync::Mutex<()>,
}

impl Process {
    fn new(r: &Registry) -> Result<Process, prometheus::Error> {
        let gauge = |name: &str, help: &str| register(r, IntGauge::new(name, help)?);
        Ok(Process {
            resident: gauge(
                "process_resident_memory_bytes",
                "Resident memory of the compactor process, in bytes (Linux).",
            )?,
            open_fds: gauge(
                "process_open_fds",
                "Open file descriptors of the compactor process (Linux).",
            )?,
            max_fds: gauge(
                "process_max_fds",
                "The compactor process's limit on open file descriptors (Linux).",
            )?,
            cpu: register(
                r,
                prometheus::Counter::new(
                    "process_cpu_seconds_total",
                    "User and system CPU time of the compactor process, in seconds (Linux).",
                )?,
            )?,
            start_time: register(
                r,
                prometheus::Gauge::new(
                    "process_start_time_seconds",
                    "When the compactor process started, in seconds since the Unix epoch (Linux).",
                )?,
            )?,
            updating: std::sync::Mutex::new(()),
        })
    }

    /// Brings the series to a fresh reading (the CPU counter only ever rises).
    fn update(&self) {
        let _one = self
            .updating
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(now) = ProcessStats::read() else {
            return;
        };
        let clamp = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.resident.set(clamp(now.resident_bytes));
        self.open_fds.set(clamp(now.open_fds));
        self.max_fds.set(clamp(now.max_fds));
        self.start_time.set(now.start_time_secs);
        let rise = now.cpu.as_secs_f64() - self.cpu.get();
        if rise > 0.0 {
            self.cpu.inc_by(rise);
        }
    }
}

/// The `compactor_cohort_*` series, each in [`Cohort::ALL`] order: what a rollout compares
/// between the conversations compacted, watched (shadow), left alone for comparison (control)
/// and opted out.
struct Cohorts {
    /// `compactor_cohort_requests_total{cohort}`
    requests: [IntCounter; 4],
    /// `compactor_cohort_conversations_total{cohort}`
    conversations: [IntCounter; 4],
    /// `compactor_cohort_tokens_total{cohort,stage}`, received then forwarded.
    received: [IntCounter; 4],
    forwarded: [IntCounter; 4],
    /// `compactor_cohort_compacted_requests_total{cohort}`
    compacted: [IntCounter; 4],
    /// `compactor_cohort_cost_usd_total{cohort}`
    cost: [prometheus::Counter; 4],
    /// `compactor_cohort_context_errors_total{cohort}`
    context_errors: [IntCounter; 4],
    /// `compactor_cohort_conversation_tokens{cohort}`
    length: [Histogram; 4],
}

impl Cohorts {
    fn new(r: &Registry) -> Result<Cohorts, prometheus::Error> {
        let per = |name: &str, help: &str| -> Result<[IntCounter; 4], prometheus::Error> {
            let vec = counter_vec(r, name, help, &["cohort"])?;
            Ok(Cohort::ALL.map(|c| vec.with_label_values(&[c.label()])))
        };
        let tokens = counter_vec(
            r,
            "compactor_cohort_tokens_total",
            "Estimated input tokens of chat requests by cohort, as received and as forwarded (shadow: what enforce would have forwarded; the request itself went as received).",
            &["cohort", "stage"],
        )?;
        let cost = register(
            r,
            CounterVec::new(
                Opts::new(
                    "compactor_cohort_cost_usd_total",
                    "What the provider billed for chat requests by cohort, in USD (priced models only; summaries not included).",
                ),
                &["cohort"],
            )?,
        )?;
        let length = histogram_vec(
            r,
            "compactor_cohort_conversation_tokens",
            "Estimated input tokens of each chat request as received (how long its conversation has grown), by cohort.",
            &["cohort"],
            TOKEN_BUCKETS,
        )?;
        Ok(Cohorts {
            requests: per(
                "compactor_cohort_requests_total",
                "Chat requests by cohort: enforce (compacted), shadow (decided, forwarded as received), control (outside compaction.sample_ratio) and off (x-compactor-mode: off).",
            )?,
            conversations: per(
                "compactor_cohort_conversations_total",
                "Conversations by cohort, counted at their first request this process sees.",
            )?,
            received: Cohort::ALL.map(|c| tokens.with_label_values(&[c.label(), "received"])),
            forwarded: Cohort::ALL.map(|c| tokens.with_label_values(&[c.label(), "forwarded"])),
            compacted: per(
                "compactor_cohort_compacted_requests_total",
                "Chat requests forwarded smaller than received (a summary or masked outputs), by cohort; shadow: would have been.",
            )?,
            cost: Cohort::ALL.map(|c| cost.with_label_values(&[c.label()])),
            context_errors: per(
                "compactor_cohort_context_errors_total",
                "Provider refusals of chat requests for their length (before any compact-and-retry), by cohort.",
            )?,
            length: Cohort::ALL.map(|c| length.with_label_values(&[c.label()])),
        })
    }
}

/// The series every chat request updates, resolved from their vectors once. A label lookup
/// hashes the values, takes the vector's lock and clones the child (atomics that two
/// workers' requests contend for); ten of them per request were measurable at 1 KB.
struct Hot {
    /// `compactor_request_duration_seconds` and `compactor_overhead_seconds` per route: the
    /// three dialects in [`DIALECTS`] order, then other routes.
    duration: [Histogram; ROUTES],
    overhead: [Histogram; ROUTES],
    /// `compactor_request_tokens` as received and as forwarded, and
    /// `compactor_context_utilization_ratio`, per dialect.
    received: [Histogram; DialectKind::COUNT],
    forwarded: [Histogram; DialectKind::COUNT],
    utilization: [Histogram; DialectKind::COUNT],
    /// `compactor_checkpoint_lookups_total`, in [`LOOKUP_RESULTS`] order.
    lookups: [IntCounter; 2],
    /// `compactor_upstream_usage_tokens_total`, in [`UsageKind::ALL`] order.
    usage: [IntCounter; 4],
    /// `compactor_cost_usd_total` per dialect, in [`COST_KINDS`] order (every priced
    /// response adds to four of them), and `compactor_cost_without_compactor_usd_total`.
    cost: [[prometheus::Counter; 4]; DialectKind::COUNT],
    cost_without: [prometheus::Counter; DialectKind::COUNT],
}

impl Hot {
    /// Looks every known child up, which creates it (exported as 0 before its first event, as
    /// `Metrics::initialise_labels` does for the other vectors).
    fn resolve(
        request_duration: &HistogramVec,
        overhead: &HistogramVec,
        request_tokens: &HistogramVec,
        context_utilization: &HistogramVec,
        checkpoint_lookups: &IntCounterVec,
        upstream_usage_tokens: &IntCounterVec,
        (cost, cost_without): (&CounterVec, &CounterVec),
    ) -> Hot {
        let routes: [Option<DialectKind>; ROUTES] =
            std::array::from_fn(|i| DIALECTS.get(i).copied());
        let [received, _, forwarded] = TOKEN_STAGES;
        let tokens =
            |stage: &str| DIALECTS.map(|d| request_tokens.with_label_values(&[d.label(), stage]));
        Hot {
            duration: routes.map(|r| request_duration.with_label_values(&[route_label(r)])),
            overhead: routes.map(|r| overhead.with_label_values(&[route_label(r)])),
            received: tokens(received),
            forwarded: tokens(forwarded),
            utilization: DIALECTS.map(|d| context_utilization.with_label_values(&[d.label()])),
            lookups: LOOKUP_RESULTS.map(|r| checkpoint_lookups.with_label_values(&[r])),
            usage: UsageKind::ALL.map(|k| upstream_usage_tokens.with_label_values(&[k.label()])),
            cost: DIALECTS
                .map(|d| COST_KINDS.map(|kind| cost.with_label_values(&[d.label(), kind]))),
            cost_without: DIALECTS.map(|d| cost_without.with_label_values(&[d.label()])),
        }
    }
}

/// `kind` values of `compactor_cost_usd_total`.
pub const COST_KINDS: [&str; 4] = ["input", "cache_read", "cache_write", "output"];

/// The `kind` of `compactor_cost_usd_total` for the summarizer's own calls.
const SUMMARIZER_COST: &str = "summarizer";

/// A route's place in [`Hot`]'s per-route arrays: the dialect's, other routes last.
fn route_index(route: Option<DialectKind>) -> usize {
    route.map_or(DialectKind::COUNT, DialectKind::index)
}

/// The `route` label (and log field): the dialect of a chat call, else `other`.
pub fn route_label(route: Option<DialectKind>) -> &'static str {
    route.map_or(OTHER_ROUTE, DialectKind::label)
}

/// A bounded method label: the standard methods, else `other`.
pub fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// `1xx` … `5xx` for a status code.
fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

impl Metrics {
    /// Creates and registers every metric in a fresh registry.
    pub fn new() -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new();
        let r = &registry;
        let request_duration = histogram_vec(
            r,
            "compactor_request_duration_seconds",
            "Time from request received to response head sent, by route kind.",
            &["route"],
            LATENCY_BUCKETS,
        )?;
        let checkpoint_lookups = counter_vec(
            r,
            "compactor_checkpoint_lookups_total",
            "Checkpoint lookups of chat requests by result (hit or miss).",
            &["result"],
        )?;
        let overhead = histogram_vec(
            r,
            "compactor_overhead_seconds",
            "Time compactor itself added before the response head: request duration minus \
             time spent waiting on the upstream and the summarizer.",
            &["route"],
            OVERHEAD_BUCKETS,
        )?;
        let request_tokens = histogram_vec(
            r,
            "compactor_request_tokens",
            "Estimated input tokens of chat requests, as received and as forwarded.",
            &["dialect", "stage"],
            TOKEN_BUCKETS,
        )?;
        let context_utilization = histogram_vec(
            r,
            "compactor_context_utilization_ratio",
            "Estimated input tokens of chat requests as received divided by the model's \
             context window.",
            &["dialect"],
            UTILIZATION_BUCKETS,
        )?;
        let upstream_usage_tokens = counter_vec(
            r,
            "compactor_upstream_usage_tokens_total",
            "Tokens reported by the upstream in response usage, by kind (input includes \
             cached and cache-write tokens).",
            &["kind"],
        )?;
        let cost = register(
            r,
            CounterVec::new(
                Opts::new(
                    "compactor_cost_usd_total",
                    "What the provider billed for forwarded chat requests, in USD, from each response's usage and the model's price (models without a price are not counted), by kind: input (read without the prompt cache), cache_read, cache_write, output; and summarizer, what the summarizer's model billed for summaries (backends that report usage).",
                ),
                &["dialect", "kind"],
            )?,
        )?;
        let cost_without = register(
            r,
            CounterVec::new(
                Opts::new(
                    "compactor_cost_without_compactor_usd_total",
                    "What the chat requests the agents sent would have cost without compactor, in USD (input and output; priced models only): the request as received, scaled by the response's actual / estimated input, its part repeating the session's previous request read from the prompt cache.",
                ),
                &["dialect"],
            )?,
        )?;
        let hot = Hot::resolve(
            &request_duration,
            &overhead,
            &request_tokens,
            &context_utilization,
            &checkpoint_lookups,
            &upstream_usage_tokens,
            (&cost, &cost_without),
        );
        let m = Metrics {
            requests: counter_vec(
                r,
                "compactor_requests_total",
                "Requests handled, by route kind, method and response status class.",
                &["route", "method", "status_class"],
            )?,
            upstream_ttfb: histogram(
                r,
                "compactor_upstream_ttfb_seconds",
                "Time from forwarding a request to receiving the upstream's response head.",
                LATENCY_BUCKETS,
            )?,
            in_flight: register(
                r,
                IntGauge::new(
                    "compactor_in_flight_requests",
                    "Requests whose response has not finished streaming.",
                )?,
            )?,
            upstream_errors: counter_vec(
                r,
                "compactor_upstream_errors_total",
                "Upstream failures by kind (connect, timeout, protocol).",
                &["kind"],
            )?,
            build_info: register(
                r,
                IntGaugeVec::new(
                    Opts::new("compactor_build_info", "Always 1; the version as a label."),
                    &["version"],
                )?,
            )?,
            compactions: counter_vec(
                r,
                "compactor_compactions_total",
                "Compactions attempted, by trigger and outcome.",
                &["trigger", "outcome"],
            )?,
            compaction_duration: histogram(
                r,
                "compactor_compaction_duration_seconds",
                "Time spent compacting one request, summarizer included.",
                WORK_BUCKETS,
            )?,
            summarizer_wait: histogram(
                r,
                "compactor_summarizer_wait_seconds",
                "Time a chat request over the trigger waited for a summary before it was forwarded (0 when a background summary was ready).",
                LATENCY_BUCKETS,
            )?,
            unbuffered_requests: register(
                r,
                IntCounter::new(
                    "compactor_unbuffered_requests_total",
                    "Chat requests streamed upstream uncompacted because server.max_buffered_bytes was held by other requests.",
                )?,
            )?,
            background_compactions: counter_vec(
                r,
                "compactor_background_compactions_total",
                "Summaries made off the request path, by outcome.",
                &["outcome"],
            )?,
            cost,
            cost_without,
            over_window_without: counter_vec(
                r,
                "compactor_over_window_without_compactor_total",
                "Chat requests of priced models whose original, as received, was over the model's window: without compactor the provider would have refused them (counted, not priced).",
                &["dialect"],
            )?,
            tunnels: counter_vec(
                r,
                "compactor_tunnels_total",
                "Upgrade requests (WebSocket) tunnelled to the upstream, by outcome.",
                &["outcome"],
            )?,
            tunnels_open: register(
                r,
                IntGauge::new(
                    "compactor_tunnels_open",
                    "Upgraded connections (WebSocket) joined to the upstream now.",
                )?,
            )?,
            background_running: register(
                r,
                IntGauge::new(
                    "compactor_background_compactions_running",
                    "Summaries being made off the request path now (at most summarizer.max_concurrent).",
                )?,
            )?,
            compactions_deferred: register(
                r,
                IntCounter::new(
                    "compactor_compactions_deferred_total",
                    "Requests over the trigger forwarded without waiting for the summary being made for them, because they fit below the wait threshold (three quarters of the way from the trigger to the usable window); a later request splices it.",
                )?,
            )?,
            request_tokens_estimated: histogram(
                r,
                "compactor_request_tokens_estimated",
                "Estimated input tokens of chat requests as received.",
                TOKEN_BUCKETS,
            )?,
            tokens_saved: register(
                r,
                IntCounter::new(
                    "compactor_tokens_saved_total",
                    "Estimated input tokens removed from forwarded chat requests (received minus forwarded), by new or stored summaries and masked outputs.",
                )?,
            )?,
            summarizer_requests: counter_vec(
                r,
                "compactor_summarizer_requests_total",
                "Summarizer calls by backend and outcome (ok, fallback_ok, or an error kind).",
                &["backend", "outcome"],
            )?,
            summarizer_duration: histogram_vec(
                r,
                "compactor_summarizer_duration_seconds",
                "Time one summarizer backend took to answer.",
                &["backend"],
                WORK_BUCKETS,
            )?,
            retries: counter_vec(
                r,
                "compactor_retries_total",
                "Chat requests the provider refused for their length, by whether they were compacted and sent again and by how the refusal came (an error status, or inside a 200 stream).",
                &["reason", "outcome", "via"],
            )?,
            windows_learned: counter_vec(
                r,
                "compactor_context_window_learned_total",
                "Context windows learned from providers (a refusal that named one, or usage above the window assumed), by source.",
                &["source"],
            )?,
            store_errors: counter_vec(
                r,
                "compactor_store_errors_total",
                "Session store calls that did not reach the shared store (unreachable, slow, failing, or skipped while it recovers); the request went on with this replica's memory.",
                &["op"],
            )?,
            sessions: register(
                r,
                IntGauge::new("compactor_sessions", "Sessions held by the session store.")?,
            )?,
            store_evictions: register(
                r,
                IntCounter::new(
                    "compactor_store_evictions_total",
                    "Sessions evicted from the store (capacity, bytes, a tenant's share, or TTL).",
                )?,
            )?,
            breaker_open: register(
                r,
                IntCounter::new(
                    "compactor_breaker_open_total",
                    "Times a session's breaker opened after repeated failed compactions.",
                )?,
            )?,
            request_tokens,
            compaction_ratio: histogram(
                r,
                "compactor_compaction_ratio",
                "Estimated tokens forwarded divided by tokens received, for compacted requests.",
                COMPACTION_RATIO_BUCKETS,
            )?,
            estimate_error: histogram(
                r,
                "compactor_estimate_error_ratio",
                "Estimated minus actual input tokens, divided by the actual input tokens the \
                 upstream reported.",
                ESTIMATE_ERROR_BUCKETS,
            )?,
            config_reloads: counter_vec(
                r,
                "compactor_config_reloads_total",
                "Configuration reloads by result (ok or error).",
                &["result"],
            )?,
            risky_reloads: counter_vec(
                r,
                "compactor_config_risky_reloads_total",
                "Configuration reloads that changed where requests go (upstream, applied) or \
                 would have removed admin auth (admin_auth_removed, refused).",
                &["change"],
            )?,
            masked_outputs: counter_vec(
                r,
                "compactor_masked_outputs_total",
                "Tool outputs replaced by a placeholder in forwarded chat requests (counted in \
                 every request that forwards them masked), by dialect and strategy.",
                &["dialect", "strategy"],
            )?,
            mask_failures: counter_vec(
                r,
                "compactor_mask_failures_total",
                "Chat requests whose old tool outputs could not be masked and were forwarded \
                 as sent.",
                &["dialect"],
            )?,
            strategy: register(
                r,
                IntGaugeVec::new(
                    Opts::new(
                        "compactor_compaction_strategy",
                        "The compaction strategy in use (1) and the others (0).",
                    ),
                    &["strategy"],
                )?,
            )?,
            client_send_timeouts: register(
                r,
                IntCounter::new(
                    "compactor_client_send_timeouts_total",
                    "Client connections closed because a write to the client made no progress for server.client_timeout_secs (the client stopped reading).",
                )?,
            )?,
            store_evictions_counted: AtomicU64::new(0),
            hot,
            cohorts: Cohorts::new(r)?,
            process: Process::new(r)?,
            registry,
        };
        m.build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        m.initialise_labels();
        Ok(m)
    }

    /// One line of what this process did, for `compactor run` on exit: requests,
    /// compactions, estimated input tokens received and forwarded, and the provider's bill
    /// for chat requests of priced models.
    pub fn run_summary(&self) -> String {
        let families = self.registry.gather();
        let sum = |name: &str, keep: &dyn Fn(&prometheus::proto::Metric) -> bool| -> f64 {
            families
                .iter()
                .filter(|f| f.name() == name)
                .flat_map(|f| f.get_metric())
                .filter(|m| keep(m))
                .map(|m| m.get_counter().get_value())
                .sum()
        };
        let label = |m: &prometheus::proto::Metric, name: &str, value: &str| {
            m.get_label()
                .iter()
                .any(|l| l.name() == name && l.value() == value)
        };
        let requests = sum("compactor_requests_total", &|_| true);
        let compactions = sum("compactor_compactions_total", &|m| {
            label(m, "outcome", "compacted")
        });
        let received = sum("compactor_cohort_tokens_total", &|m| {
            label(m, "stage", "received")
        });
        let forwarded = sum("compactor_cohort_tokens_total", &|m| {
            label(m, "stage", "forwarded") && !label(m, "cohort", "shadow")
        }) + sum("compactor_cohort_tokens_total", &|m| {
            label(m, "stage", "received") && label(m, "cohort", "shadow")
        });
        let cost = sum("compactor_cohort_cost_usd_total", &|_| true);
        let mut line = format!(
            "compactor: {requests} requests, {compactions} compactions, {forwarded} of {received} \
             estimated input tokens forwarded"
        );
        if received > 0.0 {
            line.push_str(&format!(" ({:.0}%)", 100.0 * forwarded / received));
        }
        if cost > 0.0 {
            line.push_str(&format!(", ${cost:.4} billed"));
        }
        line
    }

    /// A chat request of `cohort`: `received` and `forwarded` estimated input tokens (shadow:
    /// what enforce would have forwarded), the first of its conversation this process sees or
    /// not.
    pub fn cohort_request(&self, cohort: Cohort, received: usize, forwarded: usize, first: bool) {
        let c = &self.cohorts;
        let i = cohort.index();
        c.requests[i].inc();
        if first {
            c.conversations[i].inc();
        }
        c.received[i].inc_by(received as u64);
        c.forwarded[i].inc_by(forwarded as u64);
        if forwarded < received {
            c.compacted[i].inc();
        }
        c.length[i].observe(received as f64);
    }

    /// What the provider billed for a chat request of `cohort`, in USD.
    pub fn cohort_cost(&self, cohort: Cohort, usd: f64) {
        if usd.is_finite() && usd > 0.0 {
            self.cohorts.cost[cohort.index()].inc_by(usd);
        }
    }

    /// The provider refused a chat request of `cohort` for its length.
    pub fn cohort_context_error(&self, cohort: Cohort) {
        self.cohorts.context_errors[cohort.index()].inc();
    }

    /// Brings `compactor_store_evictions_total` up to the store's own running `total` (the
    /// store counts; the registry mirrors it at scrape time). Concurrent scrapes add each
    /// eviction once.
    pub fn observe_store_evictions(&self, total: u64) {
        let counted = self
            .store_evictions_counted
            .fetch_max(total, Ordering::AcqRel);
        self.store_evictions.inc_by(total.saturating_sub(counted));
    }

    /// Creates the children of every known label combination, so they are exported (as 0)
    /// before their first observation: `rate()` and dashboards then see a series from the
    /// start instead of "no data". `compactor_requests_total` gets the combinations a request
    /// can produce: chat routes are `POST` only.
    fn initialise_labels(&self) {
        for dialect in DIALECTS {
            for class in STATUS_CLASSES {
                self.requests.with_label_values(&[
                    dialect.label(),
                    method_label(&Method::POST),
                    class,
                ]);
            }
        }
        for method in METHOD_VALUES {
            for class in STATUS_CLASSES {
                self.requests
                    .with_label_values(&[OTHER_ROUTE, method, class]);
            }
        }
        for kind in UpstreamErrorKind::ALL {
            self.upstream_errors.with_label_values(&[kind.label()]);
        }
        for dialect in DIALECTS {
            for kind in COST_KINDS.iter().chain([&SUMMARIZER_COST]) {
                self.cost.with_label_values(&[dialect.label(), kind]);
            }
            self.cost_without.with_label_values(&[dialect.label()]);
            self.over_window_without
                .with_label_values(&[dialect.label()]);
        }
        for trigger in Trigger::ALL {
            for outcome in CompactionOutcome::ALL {
                self.compactions
                    .with_label_values(&[trigger.label(), outcome.label()]);
            }
        }
        for outcome in [CompactionOutcome::Panic.label(), SERVER_STATE, UNREADABLE] {
            self.compactions.with_label_values(&[NO_TRIGGER, outcome]);
        }
        for outcome in RETRY_OUTCOMES {
            for via in RefusalVia::ALL {
                self.retries
                    .with_label_values(&[RETRY_REASON_OVERFLOW, outcome, via.label()]);
            }
        }
        for outcome in BackgroundOutcome::ALL {
            self.background_compactions
                .with_label_values(&[outcome.label()]);
        }
        for outcome in TunnelOutcome::ALL {
            self.tunnels.with_label_values(&[outcome.label()]);
        }
        for source in WindowSource::ALL {
            self.windows_learned.with_label_values(&[source.label()]);
        }
        for op in StoreOp::ALL {
            self.store_errors.with_label_values(&[op.label()]);
        }
        for dialect in DIALECTS {
            for stage in TOKEN_STAGES {
                self.request_tokens
                    .with_label_values(&[dialect.label(), stage]);
            }
        }
        for result in RELOAD_RESULTS {
            self.config_reloads.with_label_values(&[result]);
        }
        for change in RiskyChange::ALL {
            self.risky_reloads.with_label_values(&[change.label()]);
        }
        for dialect in DIALECTS {
            for strategy in MASKING_STRATEGIES {
                self.masked_outputs
                    .with_label_values(&[dialect.label(), strategy.label()]);
            }
            self.mask_failures.with_label_values(&[dialect.label()]);
        }
        for strategy in Strategy::ALL {
            self.strategy.with_label_values(&[strategy.label()]);
        }
    }

    /// A request finished (its response head was sent): counts it and records how long it
    /// took and how much of that compactor itself added. `route` is the dialect of a chat
    /// call, `None` for anything else.
    pub fn request_finished(
        &self,
        route: Option<DialectKind>,
        method: &Method,
        status: u16,
        duration: Duration,
        overhead: Duration,
    ) {
        self.requests
            .with_label_values(&[
                route_label(route),
                method_label(method),
                status_class(status),
            ])
            .inc();
        let route = route_index(route);
        self.hot.duration[route].observe(duration.as_secs_f64());
        self.hot.overhead[route].observe(overhead.as_secs_f64());
    }

    /// An upgrade request ended this way.
    pub fn tunnel(&self, outcome: TunnelOutcome) {
        self.tunnels.with_label_values(&[outcome.label()]).inc();
    }

    /// A tunnel opened: counted open until the guard is dropped.
    pub fn tunnel_open(&self) -> TunnelOpen {
        self.tunnels_open.inc();
        TunnelOpen(self.tunnels_open.clone())
    }

    /// A request went upstream: one more in flight until [`Metrics::request_ended`].
    pub fn request_started(&self) {
        self.in_flight.inc();
    }

    /// A request's response finished streaming (or was dropped).
    pub fn request_ended(&self) {
        self.in_flight.dec();
    }

    /// The upstream answered with a response head after `ttfb`.
    pub fn upstream_answered(&self, ttfb: Duration) {
        self.upstream_ttfb.observe(ttfb.as_secs_f64());
    }

    /// The upstream exchange failed.
    pub fn upstream_error(&self, kind: UpstreamErrorKind) {
        self.upstream_errors
            .with_label_values(&[kind.label()])
            .inc();
    }

    /// A compaction ended (or was skipped) with `outcome`.
    pub fn compaction(&self, trigger: Trigger, outcome: CompactionOutcome) {
        self.compactions
            .with_label_values(&[trigger.label(), outcome.label()])
            .inc();
    }

    /// A panic was caught around a whole request, before any trigger was known:
    /// `{trigger="none",outcome="panic"}`.
    pub fn compaction_panicked(&self) {
        self.compactions
            .with_label_values(&[NO_TRIGGER, CompactionOutcome::Panic.label()])
            .inc();
    }

    /// A Responses request was passed through because its history lives on the provider:
    /// `{trigger="none",outcome="server_state"}`.
    pub fn server_state_passthrough(&self) {
        self.compactions
            .with_label_values(&[NO_TRIGGER, SERVER_STATE])
            .inc();
    }

    /// A chat request's body could not be read and was forwarded as sent:
    /// `{trigger="none",outcome="unreadable"}`.
    pub fn unreadable_passthrough(&self) {
        self.compactions
            .with_label_values(&[NO_TRIGGER, UNREADABLE])
            .inc();
    }

    /// The value of `compactor_background_compactions_total{outcome}` (tests).
    pub fn background_counted(&self, outcome: BackgroundOutcome) -> u64 {
        self.background_compactions
            .get_metric_with_label_values(&[outcome.label()])
            .map_or(0, |c| c.get())
    }

    /// The count of `compactor_compactions_total{trigger,outcome}` (0 for a combination never
    /// recorded), for tests and the replay tool.
    pub fn compactions_counted(&self, trigger: &str, outcome: &str) -> u64 {
        self.compactions
            .get_metric_with_label_values(&[trigger, outcome])
            .map_or(0, |c| c.get())
    }

    /// The provider refused a chat request for its length, `via` an error status or inside
    /// a `200` stream: it was compacted and sent again (`retried`), or no smaller request
    /// could be made (`not_compacted`).
    pub fn overflow_retry(&self, retried: bool, via: RefusalVia) {
        let outcome = if retried {
            RETRY_OUTCOMES[0]
        } else {
            RETRY_OUTCOMES[1]
        };
        self.retries
            .with_label_values(&[RETRY_REASON_OVERFLOW, outcome, via.label()])
            .inc();
    }

    /// A chat request was streamed upstream uncompacted: the buffer budget was spent.
    pub fn unbuffered_request(&self) {
        self.unbuffered_requests.inc();
    }

    /// A client connection was closed because the client stopped reading its answer.
    pub fn client_send_timeout(&self) {
        self.client_send_timeouts.inc();
    }

    /// A request over the trigger went on without waiting for the summary being made for it.
    pub fn compaction_deferred(&self) {
        self.compactions_deferred.inc();
    }

    /// Requests over the trigger that went on without waiting (tests).
    pub fn compactions_deferred(&self) -> u64 {
        self.compactions_deferred.get()
    }

    /// A background summary ended (or was not started) this way.
    pub fn background_compaction(&self, outcome: BackgroundOutcome) {
        self.background_compactions
            .with_label_values(&[outcome.label()])
            .inc();
    }

    /// A call to the shared session store failed, timed out, or was skipped while the store
    /// recovers.
    pub fn store_error(&self, op: StoreOp) {
        self.store_errors.with_label_values(&[op.label()]).inc();
    }

    /// A model's context window was learned (or changed) from a provider.
    pub fn window_learned(&self, source: WindowSource) {
        self.windows_learned
            .with_label_values(&[source.label()])
            .inc();
    }

    /// The estimated input tokens of a chat request with its old tool outputs masked (and any
    /// stored summary spliced in), before a new summary: `compactor_request_tokens{stage=
    /// "masked"}`.
    pub fn masked_request_tokens(&self, dialect: DialectKind, tokens: usize) {
        self.request_tokens
            .with_label_values(&[dialect.label(), TOKEN_STAGES[1]])
            .observe(tokens as f64);
    }

    /// A forwarded chat request carried `outputs` tool outputs masked by `strategy`.
    pub fn masked_outputs(&self, dialect: DialectKind, strategy: Strategy, outputs: usize) {
        self.masked_outputs
            .with_label_values(&[dialect.label(), strategy.label()])
            .inc_by(u64::try_from(outputs).unwrap_or(u64::MAX));
    }

    /// A chat request's old tool outputs could not be masked; it was forwarded with them as
    /// sent.
    pub fn mask_failed(&self, dialect: DialectKind) {
        self.mask_failures
            .with_label_values(&[dialect.label()])
            .inc();
    }

    /// `strategy` is the compaction strategy in use (set at start and on every reload).
    pub fn strategy_in_use(&self, strategy: Strategy) {
        for s in Strategy::ALL {
            self.strategy
                .with_label_values(&[s.label()])
                .set(i64::from(s == strategy));
        }
    }

    /// The count of `compactor_masked_outputs_total{dialect,strategy}`, for tests and the
    /// replay tool.
    pub fn masked_outputs_counted(&self, dialect: DialectKind, strategy: Strategy) -> u64 {
        self.masked_outputs
            .get_metric_with_label_values(&[dialect.label(), strategy.label()])
            .map_or(0, |c| c.get())
    }

    /// A chat request's checkpoint lookup found a stored summary (`hit`) or not.
    pub fn checkpoint_lookup(&self, hit: bool) {
        self.hot.lookups[usize::from(!hit)].inc();
    }

    /// The token figures of one chat request: estimated input tokens as `received` and as
    /// `forwarded`, their share of the model's `context_window` (skipped when unknown, 0), and
    /// for a request that was made smaller, forwarded ÷ received.
    pub fn chat_request_tokens(
        &self,
        dialect: DialectKind,
        received: usize,
        forwarded: usize,
        context_window: usize,
    ) {
        let d = dialect.index();
        self.hot.received[d].observe(received as f64);
        self.hot.forwarded[d].observe(forwarded as f64);
        if context_window > 0 {
            self.hot.utilization[d].observe(received as f64 / context_window as f64);
        }
        if forwarded != received && received > 0 {
            self.compaction_ratio
                .observe(forwarded as f64 / received as f64);
        }
    }

    /// Creates the series of a configured summarizer backend (every outcome at 0), so its
    /// counters show before its first call; called when the chain is built.
    pub fn summarizer_backend(&self, backend: &str) {
        self.summarizer_duration.with_label_values(&[backend]);
        for outcome in SUMMARIZER_ANSWERS.into_iter().chain(SummarizeError::KINDS) {
            self.summarizer_requests
                .with_label_values(&[backend, outcome]);
        }
    }

    /// Summarizer `backend` answered after `elapsed`; `fallback`: it was not the first backend
    /// of the chain.
    pub fn summarizer_answered(&self, backend: &str, fallback: bool, elapsed: Duration) {
        let [ok, fallback_ok] = SUMMARIZER_ANSWERS;
        self.summarizer_attempt(backend, if fallback { fallback_ok } else { ok }, elapsed);
    }

    /// Summarizer `backend` failed with `error` after `elapsed`.
    pub fn summarizer_failed(&self, backend: &str, error: &SummarizeError, elapsed: Duration) {
        self.summarizer_attempt(backend, error.kind(), elapsed);
    }

    fn summarizer_attempt(&self, backend: &str, outcome: &str, elapsed: Duration) {
        self.summarizer_duration
            .with_label_values(&[backend])
            .observe(elapsed.as_secs_f64());
        self.summarizer_requests
            .with_label_values(&[backend, outcome])
            .inc();
    }

    /// A forwarded `dialect` request's response was billed `usd`, by kind in [`COST_KINDS`]
    /// order (input, cache read, cache write, output).
    pub fn cost(&self, dialect: DialectKind, usd: [f64; 4]) {
        for (counter, usd) in self.hot.cost[dialect.index()].iter().zip(usd) {
            counter.inc_by(usd);
        }
    }

    /// A summary of a `dialect` request cost `usd`.
    pub fn summarizer_cost(&self, dialect: DialectKind, usd: f64) {
        self.cost
            .with_label_values(&[dialect.label(), SUMMARIZER_COST])
            .inc_by(usd);
    }

    /// Without compactor, a `dialect` request would have cost `usd`.
    pub fn cost_without_compactor(&self, dialect: DialectKind, usd: f64) {
        self.hot.cost_without[dialect.index()].inc_by(usd);
    }

    /// Without compactor, a `dialect` request would have been over its model's window.
    pub fn over_window_without_compactor(&self, dialect: DialectKind) {
        self.over_window_without
            .with_label_values(&[dialect.label()])
            .inc();
    }

    /// The upstream reported `tokens` of `kind` in a response's `usage`.
    pub fn upstream_usage(&self, kind: UsageKind, tokens: u64) {
        self.hot.usage[kind as usize].inc_by(tokens);
    }

    /// A response's reported input tokens differed from the estimate by `ratio` of them
    /// ((estimated − actual) ÷ actual).
    pub fn estimate_error(&self, ratio: f64) {
        self.estimate_error.observe(ratio);
    }

    /// A configuration reload was applied (`succeeded`) or refused.
    pub fn config_reload(&self, succeeded: bool) {
        let [ok, error] = RELOAD_RESULTS;
        self.config_reloads
            .with_label_values(&[if succeeded { ok } else { error }])
            .inc();
    }

    /// A reload carried a risky change (applied or refused, see [`RiskyChange`]).
    pub fn risky_reload(&self, change: RiskyChange) {
        self.risky_reloads
            .with_label_values(&[change.label()])
            .inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        self.process.update();
        let mut buf = Vec::new();
        let encoder = TextEncoder::new();
        if let Err(e) = encoder.encode(&self.registry.gather(), &mut buf) {
            tracing::warn!(error = %e, "metrics encoding failed");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

fn register<M: prometheus::core::Collector + Clone + 'static>(
    r: &Registry,
    m: M,
) -> Result<M, prometheus::Error> {
    r.register(Box::new(m.clone()))?;
    Ok(m)
}

fn counter_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec, prometheus::Error> {
    register(r, IntCounterVec::new(Opts::new(name, help), labels)?)
}

fn histogram(
    r: &Registry,
    name: &str,
    help: &str,
    buckets: &[f64],
) -> Result<Histogram, prometheus::Error> {
    register(
        r,
        Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))?,
    )
}

fn histogram_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> Result<HistogramVec, prometheus::Error> {
    register(
        r,
        HistogramVec::new(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
            labels,
        )?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registries_are_independent_and_render_help() {
        let a = Metrics::new().expect("metrics");
        let b = Metrics::new().expect("metrics");
        a.tokens_saved.inc_by(7);
        assert!(a.render().contains("compactor_tokens_saved_total 7"));
        assert!(b.render().contains("compactor_tokens_saved_total 0"));
        assert!(a.render().contains("# HELP compactor_build_info"));
    }

    #[test]
    fn concurrent_scrapes_count_each_store_eviction_once() {
        let m = Metrics::new().expect("metrics");
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    for total in [3, 5, 5, 4, 9] {
                        m.observe_store_evictions(total);
                    }
                });
            }
        });
        assert_eq!(m.store_evictions.get(), 9);
        m.observe_store_evictions(9);
        m.observe_store_evictions(12);
        assert_eq!(m.store_evictions.get(), 12);
    }

    #[test]
    fn every_metric_has_a_readme_row() {
        let readme = include_str!("../README.md");
        let text = Metrics::new().expect("metrics").render();
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# HELP "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        assert!(families.contains(&"compactor_masked_outputs_total"));
        for family in families {
            assert!(
                readme.contains(&format!("| `{family}` |")),
                "README's metrics table has no row for {family}"
            );
        }
    }

    #[test]
    fn masking_metrics_are_exported_before_their_first_observation_and_count() {
        let m = Metrics::new().expect("metrics");
        m.strategy_in_use(Strategy::Hybrid);
        let text = m.render();
        for line in [
            "compactor_masked_outputs_total{dialect=\"messages\",strategy=\"hybrid\"} 0",
            "compactor_masked_outputs_total{dialect=\"responses\",strategy=\"mask\"} 0",
            "compactor_mask_failures_total{dialect=\"chat_completions\"} 0",
            "compactor_request_tokens_count{dialect=\"chat_completions\",stage=\"masked\"} 0",
            "compactor_compaction_strategy{strategy=\"hybrid\"} 1",
            "compactor_compaction_strategy{strategy=\"summarize\"} 0",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
        m.masked_outputs(DialectKind::Messages, Strategy::Mask, 7);
        m.mask_failed(DialectKind::Responses);
        m.masked_request_tokens(DialectKind::Messages, 1_234);
        m.strategy_in_use(Strategy::Summarize);
        let text = m.render();
        assert_eq!(
            m.masked_outputs_counted(DialectKind::Messages, Strategy::Mask),
            7
        );
        for line in [
            "compactor_masked_outputs_total{dialect=\"messages\",strategy=\"mask\"} 7",
            "compactor_mask_failures_total{dialect=\"responses\"} 1",
            "compactor_request_tokens_sum{dialect=\"messages\",stage=\"masked\"} 1234",
            "compactor_compaction_strategy{strategy=\"hybrid\"} 0",
            "compactor_compaction_strategy{strategy=\"summarize\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
    }

    #[test]
    fn newer_vectors_are_exported_before_their_first_observation() {
        let m = Metrics::new().expect("metrics");
        let text = m.render();
        for name in [
            "compactor_overhead_seconds",
            "compactor_request_tokens",
            "compactor_compaction_ratio",
            "compactor_context_utilization_ratio",
            "compactor_upstream_usage_tokens_total",
            "compactor_estimate_error_ratio",
            "compactor_config_reloads_total",
            "compactor_client_send_timeouts_total",
        ] {
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "{name} missing:\n{text}"
            );
        }
        assert!(text.contains("compactor_upstream_usage_tokens_total{kind=\"cache_write\"} 0"));
        assert!(text.contains("compactor_config_reloads_total{result=\"error\"} 0"));
        assert!(text.contains(
            "compactor_request_tokens_count{dialect=\"responses\",stage=\"forwarded\"} 0"
        ));
        assert!(
            text.contains("compactor_overhead_seconds_bucket{route=\"other\",le=\"0.00005\"} 0")
        );
    }

    #[test]
    fn labelled_counters_show_every_known_label_at_zero_before_any_event() {
        let m = Metrics::new().expect("metrics");
        let text = m.render();
        let zero = |series: &str| {
            assert!(
                text.contains(&format!("{series} 0\n")),
                "{series} missing:\n{text}"
            );
        };
        for kind in ["connect", "timeout", "protocol"] {
            zero(&format!(
                "compactor_upstream_errors_total{{kind=\"{kind}\"}}"
            ));
        }
        for trigger in ["messages", "tokens", "manual"] {
            for outcome in ["compacted", "failed", "blank", "breaker", "panic"] {
                zero(&format!(
                    "compactor_compactions_total{{outcome=\"{outcome}\",trigger=\"{trigger}\"}}"
                ));
            }
        }
        zero("compactor_compactions_total{outcome=\"panic\",trigger=\"none\"}");
        zero("compactor_compactions_total{outcome=\"server_state\",trigger=\"none\"}");
        zero("compactor_checkpoint_lookups_total{result=\"hit\"}");
        zero("compactor_checkpoint_lookups_total{result=\"miss\"}");
        zero("compactor_requests_total{method=\"POST\",route=\"messages\",status_class=\"5xx\"}");
        zero("compactor_requests_total{method=\"other\",route=\"other\",status_class=\"1xx\"}");
        zero("compactor_request_duration_seconds_count{route=\"responses\"}");
        // Chat routes are POST only: no series that no request can produce.
        assert!(!text.contains("method=\"GET\",route=\"chat_completions\""));
        // Summarizer series exist per configured backend, once the chain names it.
        assert!(!text.contains("compactor_summarizer_requests_total{"));
        m.summarizer_backend("extractive");
        let text = m.render();
        for outcome in [
            "ok",
            "fallback_ok",
            "timeout",
            "transport",
            "status",
            "invalid",
            "blank",
            "config",
            "too_large",
        ] {
            let series = format!(
                "compactor_summarizer_requests_total{{backend=\"extractive\",outcome=\"{outcome}\"}} 0\n"
            );
            assert!(text.contains(&series), "{series} missing:\n{text}");
        }
    }

    #[test]
    fn typed_events_land_on_their_labels() {
        let m = Metrics::new().expect("metrics");
        m.upstream_error(UpstreamErrorKind::Timeout);
        m.compaction(Trigger::Tokens, CompactionOutcome::Blank);
        m.compaction_panicked();
        m.server_state_passthrough();
        m.server_state_passthrough();
        m.checkpoint_lookup(false);
        m.config_reload(false);
        m.risky_reload(RiskyChange::AdminAuthRemoved);
        m.upstream_usage(UsageKind::CacheRead, 40);
        m.summarizer_failed("exec", &SummarizeError::Blank, Duration::from_millis(5));
        m.summarizer_answered("extractive", true, Duration::from_millis(5));
        m.request_finished(
            Some(DialectKind::Responses),
            &Method::POST,
            502,
            Duration::from_millis(3),
            Duration::from_micros(200),
        );
        m.request_finished(None, &Method::TRACE, 200, Duration::ZERO, Duration::ZERO);
        m.chat_request_tokens(DialectKind::Messages, 1_000, 250, 2_000);
        let text = m.render();
        for series in [
            "compactor_upstream_errors_total{kind=\"timeout\"} 1",
            "compactor_upstream_errors_total{kind=\"connect\"} 0",
            "compactor_compactions_total{outcome=\"blank\",trigger=\"tokens\"} 1",
            "compactor_compactions_total{outcome=\"panic\",trigger=\"none\"} 1",
            "compactor_compactions_total{outcome=\"server_state\",trigger=\"none\"} 2",
            "compactor_checkpoint_lookups_total{result=\"miss\"} 1",
            "compactor_config_reloads_total{result=\"error\"} 1",
            "compactor_config_risky_reloads_total{change=\"admin_auth_removed\"} 1",
            "compactor_config_risky_reloads_total{change=\"upstream\"} 0",
            "compactor_upstream_usage_tokens_total{kind=\"cache_read\"} 40",
            "compactor_summarizer_requests_total{backend=\"exec\",outcome=\"blank\"} 1",
            "compactor_summarizer_requests_total{backend=\"extractive\",outcome=\"fallback_ok\"} 1",
            "compactor_requests_total{method=\"POST\",route=\"responses\",status_class=\"5xx\"} 1",
            "compactor_requests_total{method=\"other\",route=\"other\",status_class=\"2xx\"} 1",
            "compactor_request_tokens_sum{dialect=\"messages\",stage=\"forwarded\"} 250",
            "compactor_context_utilization_ratio_sum{dialect=\"messages\"} 0.5",
            "compactor_compaction_ratio_sum 0.25",
        ] {
            assert!(
                text.contains(&format!("{series}\n")),
                "{series} missing:\n{text}"
            );
        }
        assert_eq!(m.compactions_counted("tokens", "blank"), 1);
        assert_eq!(m.compactions_counted("nonsense", "blank"), 0);
    }

    #[test]
    fn every_pre_resolved_series_is_its_own_label() {
        let m = Metrics::new().expect("metrics");
        let routes = DIALECTS.map(Some).into_iter().chain([None]);
        for (i, route) in routes.enumerate() {
            let ms = (i + 1) as u64;
            let d = Duration::from_millis(ms);
            m.request_finished(route, &Method::POST, 200, d, d / 2);
        }
        for (i, dialect) in DIALECTS.into_iter().enumerate() {
            m.chat_request_tokens(dialect, 100 + i, 10 + i, 1_000);
        }
        m.checkpoint_lookup(true);
        m.checkpoint_lookup(true);
        m.checkpoint_lookup(false);
        for (i, kind) in UsageKind::ALL.into_iter().enumerate() {
            m.upstream_usage(kind, 1 + i as u64);
        }
        let text = m.render();
        let mut expected = vec![
            "compactor_checkpoint_lookups_total{result=\"hit\"} 2".to_string(),
            "compactor_checkpoint_lookups_total{result=\"miss\"} 1".to_string(),
        ];
        let routes = DIALECTS.map(Some).into_iter().chain([None]);
        for (i, route) in routes.enumerate() {
            let r = route_label(route);
            let secs = (i + 1) as f64 / 1000.0;
            expected.push(format!(
                "compactor_request_duration_seconds_sum{{route=\"{r}\"}} {secs}"
            ));
            expected.push(format!(
                "compactor_overhead_seconds_sum{{route=\"{r}\"}} {}",
                secs / 2.0
            ));
        }
        for (i, dialect) in DIALECTS.into_iter().enumerate() {
            let d = dialect.label();
            expected.push(format!(
                "compactor_request_tokens_sum{{dialect=\"{d}\",stage=\"received\"}} {}",
                100 + i
            ));
            expected.push(format!(
                "compactor_request_tokens_sum{{dialect=\"{d}\",stage=\"forwarded\"}} {}",
                10 + i
            ));
            expected.push(format!(
                "compactor_context_utilization_ratio_sum{{dialect=\"{d}\"}} {}",
                (100 + i) as f64 / 1_000.0
            ));
        }
        for (i, kind) in UsageKind::ALL.into_iter().enumerate() {
            expected.push(format!(
                "compactor_upstream_usage_tokens_total{{kind=\"{}\"}} {}",
                kind.label(),
                1 + i
            ));
        }
        for series in expected {
            assert!(
                text.contains(&format!("{series}\n")),
                "{series} missing:\n{text}"
            );
        }
    }

    #[test]
    fn overhead_buckets_resolve_sub_millisecond_times() {
        let m = Metrics::new().expect("metrics");
        m.hot.overhead[route_index(Some(DialectKind::ChatCompletions))].observe(0.000_2);
        let text = m.render();
        assert!(text.contains(
            "compactor_overhead_seconds_bucket{route=\"chat_completions\",le=\"0.0001\"} 0"
        ));
        assert!(text.contains(
            "compactor_overhead_seconds_bucket{route=\"chat_completions\",le=\"0.00025\"} 1"
        ));
    }
}
