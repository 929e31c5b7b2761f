//! The application value: everything a request needs, built once from a validated config.
//!
//! Owning the metrics registry, the upstream pool and the compaction engine in one value (not
//! in globals) is what lets several proxies run side by side in one test process.

use std::sync::{Arc, PoisonError, RwLock};

use crate::config::Config;
use crate::error::Error;
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use crate::proxy::budget::BufferBudget;
use crate::proxy::tunnel::Tunnels;
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
    pub compactor: Arc<Pipeline>,
    /// `server.max_buffered_bytes`: chat bodies held at once (kept across reloads).
    pub buffers: Arc<BufferBudget>,
    /// Upgraded connections joined to the upstream (kept across reloads, closed at shutdown).
    pub tunnels: Arc<Tunnels>,
}

impl App {
    /// Builds an app for `config` that keeps this one's metrics registry and session store,
    /// so a reload changes behaviour without losing counters, sessions, summaries or calibration,
    /// and this one's connection pool while `[upstream]` is unchanged.
    /// (Store limits and listener addresses are fixed at start-up.)
    pub fn reconfigure(&self, config: Config) -> Result<App, Error> {
        config.validate()?;
        let summarizer = summarizer::build(&config, self.metrics.clone())?;
        let compactor = Arc::new(
            Pipeline::with_store(
                &config,
                summarizer,
                self.metrics.clone(),
                self.compactor.store().clone(),
            )
            .succeeding(&self.compactor),
        );
        let upstream = if config.upstream == self.config.upstream {
            self.upstream.with_routes(&config)?
        } else {
            Upstream::new(&config)?
        };
        Ok(App {
            config,
            metrics: self.metrics.clone(),
            upstream,
            compactor,
            buffers: self.buffers.clone(),
            tunnels: self.tunnels.clone(),
        })
    }

    /// Builds every component; fails on anything a request would otherwise discover later.
    pub fn new(config: Config) -> Result<App, Error> {
        config.validate()?;
        let metrics = Arc::new(Metrics::new()?);
        let summarizer = summarizer::build(&config, metrics.clone())?;
        let compactor = Arc::new(Pipeline::new(&config, summarizer, metrics.clone()));
        let upstream = Upstream::new(&config)?;
        let buffers = BufferBudget::new(config.server.max_buffered_bytes);
        let tunnels = Tunnels::new(config.server.max_connections);
        Ok(App {
            config,
            metrics,
            upstream,
            compactor,
            buffers,
            tunnels,
        })
    }
}

/// The current app, swapped atomically by a reload: each request takes the app that is current
/// when it arrives and keeps it to the end, so in-flight requests finish on the old settings.
pub struct AppHandle(RwLock<Arc<App>>);

impl AppHandle {
    /// Wraps the initial app.
    pub fn new(app: App) -> AppHandle {
        AppHandle(RwLock::new(Arc::new(app)))
    }

    /// The app for a new request.
    pub fn current(&self) -> Arc<App> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Makes `app` current for every request that arrives from now on.
    pub fn replace(&self, app: App) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(app);
    }
}
