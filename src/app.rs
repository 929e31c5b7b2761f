//! The application value: everything a request needs, built once from a validated config.
//!
//! Owning the metrics registry, the upstream pool and the compaction engine in one value (not
//! in globals) is what lets several proxies run side by side in one test process.

use std::sync::{Arc, PoisonError, RwLock};

use crate::budget::BufferBudget;
use crate::config::Config;
use crate::error::Error;
use crate::event_log::EventLog;
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use crate::proxy::body_pool::BodyPool;
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
    pub pipeline: Arc<Pipeline>,
    /// The pipelines of the `[[routes]]` entries with compaction settings of their own (by
    /// route index; `None` for a route compacted as `compactor`). They share its store,
    /// calibration, single flights and background summaries.
    pub route_pipelines: Vec<Option<Arc<Pipeline>>>,
    /// `server.max_buffered_bytes`: chat bodies held at once (kept across reloads).
    pub buffers: Arc<BufferBudget>,
    /// Freed buffers of large chat bodies, for the next of their size (kept across reloads).
    pub bodies: Arc<BodyPool>,
    /// Upgraded connections joined to the upstream (kept across reloads, closed at shutdown).
    pub tunnels: Arc<Tunnels>,
    /// `server.event_log`, open (kept across reloads that leave it as it is).
    pub events: Option<Arc<EventLog>>,
}

impl App {
    /// Builds an app for `config` that keeps this one's metrics registry and session store,
    /// so a reload changes behaviour without losing counters, sessions, summaries or calibration,
    /// and this one's connection pool while `[upstream]` is unchanged.
    /// (Store limits and listener addresses are fixed at start-up.)
    pub fn reconfigure(&self, config: Config) -> Result<App, Error> {
        config.validate()?;
        let events = if (&config.server.event_log, config.server.event_log_max_bytes)
            == (
                &self.config.server.event_log,
                self.config.server.event_log_max_bytes,
            ) {
            self.events.clone()
        } else {
            open_events(&config)?
        };
        let summarizer = summarizer::build(&config, self.metrics.clone())?;
        let pipeline = Arc::new(
            Pipeline::with_store(
                &config,
                summarizer,
                self.metrics.clone(),
                self.pipeline.store().clone(),
            )
            .succeeding(&self.pipeline)
            .with_events(events.clone()),
        );
        let upstream = if config.upstream == self.config.upstream {
            self.upstream.with_routes(&config)?
        } else {
            Upstream::new(&config)?
        };
        let route_pipelines = route_pipelines(&config, &pipeline, &self.metrics, &events)?;
        Ok(App {
            config,
            metrics: self.metrics.clone(),
            upstream,
            pipeline,
            route_pipelines,
            buffers: self.buffers.clone(),
            bodies: self.bodies.clone(),
            tunnels: self.tunnels.clone(),
            events,
        })
    }

    /// Builds every component; fails on anything a request would otherwise discover later.
    pub fn new(config: Config) -> Result<App, Error> {
        config.validate()?;
        let events = open_events(&config)?;
        let metrics = Arc::new(Metrics::new()?);
        let summarizer = summarizer::build(&config, metrics.clone())?;
        let pipeline = Arc::new(
            Pipeline::new(&config, summarizer, metrics.clone()).with_events(events.clone()),
        );
        let upstream = Upstream::new(&config)?;
        let buffers = BufferBudget::new(config.server.max_buffered_bytes);
        // Idle buffers: a quarter of what bodies in flight may hold.
        let bodies = BodyPool::new(config.server.max_buffered_bytes / 4);
        let tunnels = Tunnels::new(config.server.max_connections);
        let route_pipelines = route_pipelines(&config, &pipeline, &metrics, &events)?;
        Ok(App {
            config,
            metrics,
            upstream,
            pipeline,
            route_pipelines,
            buffers,
            bodies,
            tunnels,
            events,
        })
    }
}

impl App {
    /// The pipeline of a request on `route` ([`crate::upstream::Resolved::route`]).
    pub fn pipeline_for(&self, route: Option<usize>) -> &Arc<Pipeline> {
        route
            .and_then(|i| self.route_pipelines.get(i)?.as_ref())
            .unwrap_or(&self.pipeline)
    }
}

/// A pipeline for each route with compaction settings of its own, succeeding `default` (so it
/// shares its store, calibration, single flights, background summaries and pace).
fn route_pipelines(
    config: &Config,
    default: &Arc<Pipeline>,
    metrics: &Arc<Metrics>,
    events: &Option<Arc<EventLog>>,
) -> Result<Vec<Option<Arc<Pipeline>>>, Error> {
    let mut pipelines = Vec::with_capacity(config.routes.len());
    for (i, route) in config.routes.iter().enumerate() {
        if route.compaction.is_empty() {
            pipelines.push(None);
            continue;
        }
        let own = config.for_route(i);
        let summarizer = summarizer::build(&own, metrics.clone())?;
        let pipeline =
            Pipeline::with_store(&own, summarizer, metrics.clone(), default.store().clone())
                .succeeding(default)
                .with_events(events.clone());
        pipelines.push(Some(Arc::new(pipeline)));
    }
    // The strategy gauge shows the `[compaction]` section's, whatever the routes use.
    metrics.strategy_in_use(config.compaction.strategy);
    Ok(pipelines)
}

/// `server.event_log`, opened for appending; an unset one is `None`.
fn open_events(config: &Config) -> Result<Option<Arc<EventLog>>, Error> {
    let Some(path) = &config.server.event_log else {
        return Ok(None);
    };
    EventLog::open(path, config.server.event_log_max_bytes)
        .map(|log| Some(Arc::new(log)))
        .map_err(|e| Error::EventLog {
            path: path.display().to_string(),
            source: e,
        })
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
