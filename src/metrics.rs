//! Metrics: the only module that names a metric.
//!
//! One [`Metrics`] value owns one Prometheus [`Registry`]; nothing is global, so parallel tests
//! (each with its own app) never share counters. Labels are bounded enums or short static
//! strings: never a path, a key or a session id.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

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

/// Values of the `dialect` label (`DialectKind::label`).
const DIALECT_VALUES: [&str; 3] = ["chat_completions", "messages", "responses"];

/// The `route` label of a request that is not a chat call; chat calls are labelled with their
/// dialect. A closed set, never a raw path.
pub const OTHER_ROUTE: &str = "other";

/// Values of the `stage` label of `compactor_request_tokens`.
pub const TOKEN_STAGES: [&str; 2] = ["received", "forwarded"];

/// Values of the `kind` label of `compactor_upstream_usage_tokens_total`.
pub const USAGE_KINDS: [&str; 4] = ["input", "output", "cache_read", "cache_write"];

/// Values of the `result` label of `compactor_config_reloads_total`.
pub const RELOAD_RESULTS: [&str; 2] = ["ok", "error"];

/// Every metric compactor exports.
pub struct Metrics {
    registry: Registry,
    /// `compactor_requests_total{route,method,status_class}`
    pub requests: IntCounterVec,
    /// `compactor_request_duration_seconds{route}`
    pub request_duration: HistogramVec,
    /// `compactor_upstream_ttfb_seconds`
    pub upstream_ttfb: Histogram,
    /// `compactor_in_flight_requests`
    pub in_flight: IntGauge,
    /// `compactor_upstream_errors_total{kind}`
    pub upstream_errors: IntCounterVec,
    /// `compactor_build_info{version}`
    pub build_info: IntGaugeVec,
    /// `compactor_compactions_total{trigger,outcome}`
    pub compactions: IntCounterVec,
    /// `compactor_compaction_duration_seconds`
    pub compaction_duration: Histogram,
    /// `compactor_request_tokens_estimated`
    pub request_tokens_estimated: Histogram,
    /// `compactor_tokens_saved_total`
    pub tokens_saved: IntCounter,
    /// `compactor_summarizer_requests_total{backend,outcome}`
    pub summarizer_requests: IntCounterVec,
    /// `compactor_summarizer_duration_seconds{backend}`
    pub summarizer_duration: HistogramVec,
    /// `compactor_checkpoint_lookups_total{result}`
    pub checkpoint_lookups: IntCounterVec,
    /// `compactor_sessions`
    pub sessions: IntGauge,
    /// `compactor_store_evictions_total`: raised through [`Metrics::observe_store_evictions`].
    pub store_evictions: IntCounter,
    /// The store's eviction total already added to `store_evictions`.
    store_evictions_counted: AtomicU64,
    /// `compactor_breaker_open_total`
    pub breaker_open: IntCounter,
    /// `compactor_overhead_seconds{route}`: time compactor itself adds before the response
    /// head (see [`crate::timing::Overhead`]).
    pub overhead: HistogramVec,
    /// `compactor_request_tokens{dialect,stage}`: estimated input tokens as received and as
    /// forwarded (`stage` ∈ [`TOKEN_STAGES`]).
    pub request_tokens: HistogramVec,
    /// `compactor_compaction_ratio`: forwarded ÷ received estimated tokens of compacted
    /// requests.
    pub compaction_ratio: Histogram,
    /// `compactor_context_utilization_ratio{dialect}`: estimated input tokens ÷ the model's
    /// context window.
    pub context_utilization: HistogramVec,
    /// `compactor_upstream_usage_tokens_total{kind}`: tokens the upstream reported in `usage`
    /// (`kind` ∈ [`USAGE_KINDS`]).
    pub upstream_usage_tokens: IntCounterVec,
    /// `compactor_estimate_error_ratio`: (estimated − actual) ÷ actual input tokens.
    pub estimate_error: Histogram,
    /// `compactor_config_reloads_total{result}` (`result` ∈ [`RELOAD_RESULTS`]).
    pub config_reloads: IntCounterVec,
}

/// `1xx` … `5xx` for a status code.
pub fn status_class(status: u16) -> &'static str {
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
        let m = Metrics {
            requests: counter_vec(
                r,
                "compactor_requests_total",
                "Requests handled, by route kind, method and response status class.",
                &["route", "method", "status_class"],
            )?,
            request_duration: histogram_vec(
                r,
                "compactor_request_duration_seconds",
                "Time from request received to response head sent, by route kind.",
                &["route"],
                LATENCY_BUCKETS,
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
                    "Estimated input tokens removed from forwarded requests by compaction.",
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
            checkpoint_lookups: counter_vec(
                r,
                "compactor_checkpoint_lookups_total",
                "Checkpoint lookups of chat requests by result (hit or miss).",
                &["result"],
            )?,
            sessions: register(
                r,
                IntGauge::new("compactor_sessions", "Sessions held by the session store.")?,
            )?,
            store_evictions: register(
                r,
                IntCounter::new(
                    "compactor_store_evictions_total",
                    "Sessions evicted from the store (capacity, bytes or TTL).",
                )?,
            )?,
            breaker_open: register(
                r,
                IntCounter::new(
                    "compactor_breaker_open_total",
                    "Times a session's breaker opened after repeated failed compactions.",
                )?,
            )?,
            overhead: histogram_vec(
                r,
                "compactor_overhead_seconds",
                "Time compactor itself added before the response head: request duration minus \
                 time spent waiting on the upstream and the summarizer.",
                &["route"],
                OVERHEAD_BUCKETS,
            )?,
            request_tokens: histogram_vec(
                r,
                "compactor_request_tokens",
                "Estimated input tokens of chat requests, as received and as forwarded.",
                &["dialect", "stage"],
                TOKEN_BUCKETS,
            )?,
            compaction_ratio: histogram(
                r,
                "compactor_compaction_ratio",
                "Estimated tokens forwarded divided by tokens received, for compacted requests.",
                COMPACTION_RATIO_BUCKETS,
            )?,
            context_utilization: histogram_vec(
                r,
                "compactor_context_utilization_ratio",
                "Estimated input tokens of chat requests as received divided by the model's \
                 context window.",
                &["dialect"],
                UTILIZATION_BUCKETS,
            )?,
            upstream_usage_tokens: counter_vec(
                r,
                "compactor_upstream_usage_tokens_total",
                "Tokens reported by the upstream in response usage, by kind (input includes \
                 cached and cache-write tokens).",
                &["kind"],
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
            store_evictions_counted: AtomicU64::new(0),
            registry,
        };
        m.build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        m.initialise_labels();
        Ok(m)
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

    /// Creates the children of every bounded label combination of the newer vectors, so they
    /// are exported (as 0) before their first observation: `rate()` and dashboards then see
    /// a series from the start instead of "no data".
    fn initialise_labels(&self) {
        for route in DIALECT_VALUES.iter().chain([&OTHER_ROUTE]) {
            self.overhead.with_label_values(&[route]);
        }
        for dialect in DIALECT_VALUES {
            self.context_utilization.with_label_values(&[dialect]);
            for stage in TOKEN_STAGES {
                self.request_tokens.with_label_values(&[dialect, stage]);
            }
        }
        for kind in USAGE_KINDS {
            self.upstream_usage_tokens.with_label_values(&[kind]);
        }
        for result in RELOAD_RESULTS {
            self.config_reloads.with_label_values(&[result]);
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
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
        // The dialect label values are DialectKind's.
        use crate::dialect::DialectKind;
        let kinds = [
            DialectKind::ChatCompletions,
            DialectKind::Messages,
            DialectKind::Responses,
        ];
        assert_eq!(DIALECT_VALUES, kinds.map(DialectKind::label));
    }

    #[test]
    fn overhead_buckets_resolve_sub_millisecond_times() {
        let m = Metrics::new().expect("metrics");
        m.overhead
            .with_label_values(&["chat_completions"])
            .observe(0.000_2);
        let text = m.render();
        assert!(text.contains(
            "compactor_overhead_seconds_bucket{route=\"chat_completions\",le=\"0.0001\"} 0"
        ));
        assert!(text.contains(
            "compactor_overhead_seconds_bucket{route=\"chat_completions\",le=\"0.00025\"} 1"
        ));
    }
}
