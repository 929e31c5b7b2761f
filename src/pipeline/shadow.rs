//! The shadow pipeline: what `compaction.mode = "shadow"` (or a request's
//! `x-compactor-mode: shadow`) decides with, while the request goes upstream as received.
//!
//! It is the pipeline's own settings (trigger, strategy, masking, background summaries, the
//! cost trigger) with two differences that keep a shadow from touching real traffic: summaries
//! are written by the local `extractive` backend (no summarizer call, no provider spend), and
//! they are kept in a memory store of its own, so a conversation moved from shadow to enforce
//! never has a shadow summary spliced into a request forwarded for real. It shares the real
//! pipeline's calibration (the provider's usage is read from the requests actually sent) and
//! reads windows from the models table (windows learned from refusals live in the real store).
//! Its metrics go to a registry nobody scrapes: what it would have done is counted by the real
//! pipeline in the `compactor_cohort_*` series, `cohort="shadow"`.

use std::sync::Arc;

use crate::calibration::Calibration;
use crate::config::{Config, Mode, StoreBackend};
use crate::metrics::Metrics;
use crate::session::memory::MemoryStore;
use crate::session::StoreLimits;
use crate::summarizer;

use super::Pipeline;

/// The shadow of a pipeline built from `config`, sharing its `calibration`; `None` (logged)
/// if it cannot be built, when shadow requests are forwarded without being decided on.
pub(super) fn pipeline(config: &Config, calibration: &Arc<Calibration>) -> Option<Pipeline> {
    let mut config = config.clone();
    config.compaction.mode = Mode::Enforce;
    config.compaction.sample_ratio = 1.0;
    config.store.backend = StoreBackend::Memory;
    config.summarizer.backend = "extractive".into();
    config.summarizer.fallback = Vec::new();
    let built = Metrics::new()
        .map_err(|e| e.to_string())
        .and_then(|metrics| {
            let metrics = Arc::new(metrics);
            summarizer::build(&config, metrics.clone())
                .map(|s| (s, metrics))
                .map_err(|e| e.to_string())
        });
    let (summarizer, metrics) = match built {
        Ok(built) => built,
        Err(e) => {
            tracing::error!(error = %e, "shadow compaction unavailable; shadow requests are only forwarded");
            return None;
        }
    };
    let store = MemoryStore::new(StoreLimits {
        max_sessions: config.store.max_sessions,
        max_bytes: config.store.max_bytes,
        max_sessions_per_tenant: config.store.max_sessions_per_tenant,
        ttl: config.store_ttl(),
    })
    .with_breaker_cooldown(config.breaker_cooldown());
    let mut shadow = Pipeline::build(&config, summarizer, metrics, Arc::new(store));
    shadow.calibration = calibration.clone();
    Some(shadow)
}

/// The shadow `new` of a reloaded pipeline, keeping what `old` (the shadow it replaces) held:
/// its store and what outlives a reload, and the real pipeline's `calibration`.
pub(super) fn succeeding(
    new: Arc<Pipeline>,
    old: &Pipeline,
    calibration: &Arc<Calibration>,
) -> Arc<Pipeline> {
    // Built a moment ago and shared with nobody yet: always the case. Otherwise it starts
    // afresh.
    let mut new = match Arc::try_unwrap(new) {
        Ok(new) => new.succeeding(old),
        Err(shared) => return shared,
    };
    new.store = old.store.clone();
    new.calibration = calibration.clone();
    Arc::new(new)
}
