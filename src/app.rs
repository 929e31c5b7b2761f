//! The application value: everything a request needs, built once from a validated config.
//!
//! Owning the metrics registry, the upstream pool and the compaction engine in one value (not
//! in globals) is what lets several proxies run side by side in one test process.

use std::sync::Arc;

use crate::compaction::Compactor;
use crate::config::Config;
use crate::error::Error;
use crate::metrics::Metrics;
use crate::summarizer;
use crate::upstream::Upstream;

/// Shared state of a running compactor.
pub struct App {
    /// The configuration it was built from.
    pub config: Config,
    /// Its metrics registry.
    pub metrics: Arc<Metrics>,
    /// The upstream routing table and pooled client.
    pub upstream: Upstream,
    /// The compaction engine.
    pub compactor: Compactor,
}

impl App {
    /// Builds every component; fails on anything a request would otherwise discover later.
    pub fn new(config: Config) -> Result<App, Error> {
        config.validate()?;
        let metrics = Arc::new(Metrics::new()?);
        let summarizer = summarizer::build(&config, metrics.clone())?;
        let compactor = Compactor::new(&config, summarizer, metrics.clone());
        let upstream = Upstream::new(&config)?;
        Ok(App {
            config,
            metrics,
            upstream,
            compactor,
        })
    }
}
