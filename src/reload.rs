//! Hot reload: on SIGHUP, or when the config file changes, read and validate the new
//! configuration and swap it in atomically for new requests.
//!
//! Thresholds, the models table, summarizer settings and routes take effect for every request
//! that arrives after the swap (in-flight requests finish on the settings they started with).
//! Counters, sessions and stored summaries survive; new connections take the new client
//! timeout. What is bound at start-up (listener addresses, inbound TLS, log format, the
//! connection limit, the buffered-bytes budget, the summarizer concurrency limit, the `[store]`
//! settings) needs a restart, and the log says so. An invalid file keeps the running
//! configuration, logs why and counts the failure.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::app::AppHandle;
use crate::config::Config;
use crate::error::Error;

/// How often the config file's modification time and size are checked.
pub const POLL_INTERVAL: Duration = Duration::from_secs(2);

/// Re-reads one config file (or the defaults) into one app handle.
#[derive(Clone)]
pub struct Reloader {
    handle: Arc<AppHandle>,
    path: Option<PathBuf>,
    stamp: Option<(SystemTime, u64)>,
}

impl Reloader {
    /// Watches `path` (or `config/compactor.toml` when it exists, as at start-up).
    pub fn new(handle: Arc<AppHandle>, path: Option<PathBuf>) -> Reloader {
        let path = Config::file(path.as_deref());
        let stamp = path.as_deref().and_then(stamp);
        Reloader {
            handle,
            path,
            stamp,
        }
    }

    /// Loads, validates and swaps in the configuration now. On success returns the settings
    /// that changed but need a restart; on failure the running configuration stays.
    pub fn reload(&self) -> Result<Vec<&'static str>, Error> {
        let current = self.handle.current();
        let result = Config::load(self.path.as_deref())
            .map_err(Error::from)
            .and_then(|config| {
                let pending = restart_needed(&current.config, &config);
                let app = current.reconfigure(config)?;
                self.handle.replace(app);
                Ok(pending)
            });
        current.metrics.config_reload(result.is_ok());
        match &result {
            Ok(pending) if pending.is_empty() => tracing::info!("configuration reloaded"),
            Ok(pending) => tracing::warn!(
                needs_restart = ?pending,
                "configuration reloaded; these settings changed but take effect only after a restart"
            ),
            Err(e) => {
                tracing::error!(error = %e, "configuration reload failed; keeping the running configuration")
            }
        }
        result
    }

    /// Reloads on every SIGHUP and whenever the file's modification time or size changes,
    /// until the task is dropped.
    pub async fn run(mut self) {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hangup = match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; reloading on file changes only");
                None
            }
        };
        let mut ticker = tokio::time::interval(POLL_INTERVAL);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let by_signal = tokio::select! {
                Some(()) = async { hangup.as_mut()?.recv().await } => true,
                _ = ticker.tick() => false,
            };
            let now = self.path.as_deref().and_then(stamp);
            if by_signal {
                tracing::info!("SIGHUP received: reloading the configuration");
            } else if now == self.stamp {
                continue;
            }
            self.stamp = now;
            // Reading the file, loading certificates and building summarizers block: keep
            // them off the runtime's worker threads.
            let reloader = self.clone();
            let _ = tokio::task::spawn_blocking(move || reloader.reload()).await;
        }
    }
}

/// Modification time and size: a change in either means the file was rewritten.
fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// Settings bound at start-up that differ between `old` and `new`.
fn restart_needed(old: &Config, new: &Config) -> Vec<&'static str> {
    let (o, n) = (&old.server, &new.server);
    [
        ("server.listen", o.listen != n.listen),
        ("server.admin_listen", o.admin_listen != n.admin_listen),
        (
            "server.tls_cert",
            o.tls_cert != n.tls_cert || o.tls_key != n.tls_key,
        ),
        ("server.log_format", o.log_format != n.log_format),
        (
            "server.max_connections",
            o.max_connections != n.max_connections,
        ),
        (
            "server.max_buffered_bytes",
            o.max_buffered_bytes != n.max_buffered_bytes,
        ),
        (
            "summarizer.max_concurrent",
            old.summarizer.max_concurrent != new.summarizer.max_concurrent,
        ),
        ("store", old.store != new.store),
    ]
    .into_iter()
    .filter_map(|(key, changed)| changed.then_some(key))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Seconds;

    #[test]
    fn start_up_bound_settings_are_reported() {
        let old = Config::default();
        let mut new = old.clone();
        new.compaction.max_messages = 10;
        assert!(restart_needed(&old, &new).is_empty());
        new.server.client_timeout_secs = Seconds::try_from(31.0).expect("seconds");
        assert!(
            restart_needed(&old, &new).is_empty(),
            "new connections take the new client timeout"
        );
        new.server.listen = "127.0.0.1:1".parse().expect("addr");
        new.server.max_buffered_bytes += 1;
        new.store.max_sessions = 1;
        assert_eq!(
            restart_needed(&old, &new),
            vec!["server.listen", "server.max_buffered_bytes", "store"]
        );
    }
}
