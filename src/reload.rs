//! Hot reload: on SIGHUP, or when the config file changes and has settled, read and validate
//! the new configuration and swap it in atomically for new requests.
//!
//! Thresholds, the models table, summarizer settings and routes take effect for every request
//! that arrives after the swap (in-flight requests finish on the settings they started with).
//! Counters, sessions and stored summaries survive; new connections take the new client
//! timeout. What is bound at start-up (listener addresses, inbound TLS, log format, the
//! connection limit, the buffered-bytes budget, the summarizer concurrency limit, the `[store]`
//! settings) needs a restart, and the log says so. An invalid file keeps the running
//! configuration, logs why and counts the failure.
//!
//! A reload must never send the callers' credentials somewhere by accident, nor drop the admin
//! token: a file caught mid-write would otherwise load as "all defaults". So the watcher reloads
//! only a file whose size and modification time held still across two polls ([`Settle`]); a
//! file that sets nothing is refused ([`Config::reread`]); so is one that would remove
//! `admin.token` (a restart is the explicit way to run without it) or put the upstream back to
//! its built-in default by no longer naming it. Every reload logs the names of the settings it
//! changed, never their values; one that changes where requests go is a warning and is counted.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use crate::app::AppHandle;
use crate::config::{Config, ConfigError, Reread};
use crate::error::Error;
use crate::metrics::RiskyChange;

/// How often the config file's modification time and size are checked. A change is reloaded
/// at the first poll that sees it unchanged since the one before: one to two intervals after
/// the last write.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// The keys that decide where requests go, and with them the callers' credentials: the
/// default upstream, the routes, and the summarizer endpoints (which get the caller's own
/// credentials when no `api_key_env` is set). Arrays are compared whole ([`changed_keys`]).
const DESTINATION_KEYS: [&str; 4] = [
    "upstream.base_url",
    "routes",
    "summarizer.openai.base_url",
    "summarizer.anthropic.base_url",
];

/// Re-reads one config file (or the defaults) into one app handle.
#[derive(Clone)]
pub struct Reloader {
    handle: Arc<AppHandle>,
    path: Option<PathBuf>,
    settle: Settle,
}

/// What a reload changed, by name (values are never kept: some are secrets).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Changes {
    /// Every effective setting that changed, as a dotted key (`compaction.max_messages`,
    /// `models."gpt-4o*".context_window`); an array is named whole (`routes`).
    pub keys: Vec<String>,
    /// Those that take effect only after a restart.
    pub needs_restart: Vec<&'static str>,
}

impl Changes {
    /// The changed keys among `DESTINATION_KEYS`.
    pub fn destinations(&self) -> Vec<&str> {
        self.keys
            .iter()
            .map(String::as_str)
            .filter(|key| DESTINATION_KEYS.contains(key))
            .collect()
    }
}

impl Reloader {
    /// Watches `path` (or `config/compactor.toml` when it exists, as at start-up).
    pub fn new(handle: Arc<AppHandle>, path: Option<PathBuf>) -> Reloader {
        let path = Config::file(path.as_deref());
        let settle = Settle::new(path.as_deref().and_then(stamp));
        Reloader {
            handle,
            path,
            settle,
        }
    }

    /// Loads, validates and swaps in the configuration now. On success returns what changed;
    /// on failure, or a refusal (`refusal`), the running configuration stays.
    pub fn reload(&self) -> Result<Changes, Error> {
        let current = self.handle.current();
        let metrics = &current.metrics;
        let result = Config::reread(self.path.as_deref())
            .map_err(Error::from)
            .and_then(|reread| {
                if let Some((risk, refused)) = refusal(&current.config, &reread) {
                    if let Some(risk) = risk {
                        metrics.risky_reload(risk);
                    }
                    return Err(refused.into());
                }
                let changes = Changes {
                    keys: changed_keys(&current.config, &reread.config),
                    needs_restart: restart_needed(&current.config, &reread.config),
                };
                let destinations = destinations(&reread.config);
                let app = current.reconfigure(reread.config)?;
                self.handle.replace(app);
                if !changes.destinations().is_empty() {
                    metrics.risky_reload(RiskyChange::Upstream);
                    tracing::warn!(
                        changed = ?changes.destinations(),
                        now = ?destinations,
                        "configuration reloaded: requests now go to a different upstream"
                    );
                }
                Ok(changes)
            });
        metrics.config_reload(result.is_ok());
        match &result {
            Ok(changes) if changes.keys.is_empty() => {
                tracing::info!("configuration reloaded; no setting changed")
            }
            Ok(changes) => tracing::info!(changed = ?changes.keys, "configuration reloaded"),
            Err(e) => {
                tracing::error!(error = %e, "configuration reload failed; keeping the running configuration")
            }
        }
        if let Ok(Changes { needs_restart, .. }) = &result {
            if !needs_restart.is_empty() {
                tracing::warn!(
                    needs_restart = ?needs_restart,
                    "these settings changed but take effect only after a restart"
                );
            }
        }
        result
    }

    /// Reloads on every SIGHUP, and once the file's modification time or size has changed and
    /// then held still for a poll, until the task is dropped.
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
                // The operator says the file is ready: no waiting for it to settle.
                tracing::info!("SIGHUP received: reloading the configuration");
                self.settle.loaded(now);
            } else if !self.settle.poll(now) {
                continue;
            }
            // Reading the file, loading certificates and building summarizers block: keep
            // them off the runtime's worker threads.
            let reloader = self.clone();
            let _ = tokio::task::spawn_blocking(move || reloader.reload()).await;
        }
    }
}

/// Modification time and size: a change in either means the file was rewritten.
type Stamp = Option<(SystemTime, u64)>;

fn stamp(path: &Path) -> Stamp {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// When the watcher reloads: a file that is still being written (an editor saving, `cat >`
/// or a copy in progress) changes between two polls, so it is loaded only once a poll finds it
/// as the previous poll did, and different from what was last loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settle {
    /// The stamp of the file last loaded (or refused: a refused file is not retried until it
    /// changes again).
    loaded: Stamp,
    /// The stamp the previous poll saw.
    seen: Stamp,
}

impl Settle {
    /// Starts with the file loaded at start-up.
    pub fn new(loaded: Stamp) -> Settle {
        Settle {
            loaded,
            seen: loaded,
        }
    }

    /// One poll found the file at `now`: whether to reload it.
    pub fn poll(&mut self, now: Stamp) -> bool {
        let settled = now == self.seen && now != self.loaded;
        self.seen = now;
        if settled {
            self.loaded = now;
        }
        settled
    }

    /// The file at `now` was loaded outside the polls (on SIGHUP).
    pub fn loaded(&mut self, now: Stamp) {
        self.loaded = now;
        self.seen = now;
    }
}

/// Why `reread` must not replace `running`, if it must not: a [`ConfigError::Invalid`] naming
/// the key, with the risk to count when there is one.
///
/// Removing `admin.token` is refused outright rather than applied with a warning: a file that
/// lost its `[admin]` section (cut short, or a wrong copy) would open the session API to anyone
/// who reaches the admin listener, and a reload cannot tell that from intent. Restarting is the
/// explicit way to run without a token. An upstream no longer named anywhere is refused too:
/// it would be the built-in `https://api.openai.com`, so every caller's key would go there.
/// Naming a different upstream is allowed (a warning, counted).
fn refusal(running: &Config, reread: &Reread) -> Option<(Option<RiskyChange>, ConfigError)> {
    let new = &reread.config;
    if running.admin.token.is_some() && new.admin.token.is_none() {
        return Some((
            Some(RiskyChange::AdminAuthRemoved),
            ConfigError::Invalid {
                key: "admin.token".into(),
                reason: "set in the running configuration but not in the new one; a reload \
                         never removes admin auth (restart compactor to run without a token)"
                    .into(),
            },
        ));
    }
    if !reread.upstream_written && new.upstream.base_url != running.upstream.base_url {
        return Some((
            None,
            ConfigError::Invalid {
                key: "upstream.base_url".into(),
                reason: "no longer set, which would send every request to the built-in default; \
                         a reload changes the upstream only to one it names"
                    .into(),
            },
        ));
    }
    None
}

/// The dotted names of the settings that differ between `old` and `new`, in key order.
/// Tables are compared key by key, arrays and values whole.
fn changed_keys(old: &Config, new: &Config) -> Vec<String> {
    fn walk(prefix: &str, old: &Value, new: &Value, out: &mut Vec<String>) {
        match (old, new) {
            (Value::Object(o), Value::Object(n)) => {
                let mut keys: Vec<&String> = o.keys().chain(n.keys()).collect();
                keys.sort();
                keys.dedup();
                for key in keys {
                    let name = if key
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                    {
                        key.clone()
                    } else {
                        format!("\"{key}\"")
                    };
                    let path = if prefix.is_empty() {
                        name
                    } else {
                        format!("{prefix}.{name}")
                    };
                    let missing = Value::Null;
                    walk(
                        &path,
                        o.get(key).unwrap_or(&missing),
                        n.get(key).unwrap_or(&missing),
                        out,
                    );
                }
            }
            (o, n) if o != n => out.push(prefix.to_owned()),
            _ => {}
        }
    }
    let (Ok(old), Ok(new)) = (serde_json::to_value(old), serde_json::to_value(new)) else {
        // Not expected (every key is a string); the reload itself does not depend on it.
        return vec!["(unknown)".into()];
    };
    let mut out = Vec::new();
    walk("", &old, &new, &mut out);
    out
}

/// Where requests go under `config`, for the log: scheme, host and port of the default
/// upstream and of each route (by prefix). Paths and any user-info are left out: they can
/// carry account names or passwords.
fn destinations(config: &Config) -> Vec<String> {
    let origin = |url: &str| -> String {
        let Ok(uri) = url.parse::<http::Uri>() else {
            return "(unparsable)".into();
        };
        let host = uri.host().unwrap_or_default();
        match (uri.scheme_str(), uri.port_u16()) {
            (Some(scheme), Some(port)) => format!("{scheme}://{host}:{port}"),
            (Some(scheme), None) => format!("{scheme}://{host}"),
            _ => host.to_owned(),
        }
    };
    std::iter::once(origin(&config.upstream.base_url))
        .chain(
            config
                .routes
                .iter()
                .map(|r| format!("{} -> {}", r.prefix, origin(&r.base_url))),
        )
        .collect()
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

    fn at(secs: u64, len: u64) -> Stamp {
        Some((SystemTime::UNIX_EPOCH + Duration::from_secs(secs), len))
    }

    #[test]
    fn a_changed_file_is_reloaded_once_it_holds_still_for_a_poll() {
        let mut settle = Settle::new(at(1, 100));
        assert!(!settle.poll(at(1, 100)), "unchanged since start-up");
        // A write in progress: truncated, then growing.
        assert!(!settle.poll(at(2, 0)), "first sight of a change");
        assert!(!settle.poll(at(2, 40)), "still growing");
        assert!(!settle.poll(at(3, 120)), "still growing");
        assert!(settle.poll(at(3, 120)), "held still for a poll");
        assert!(!settle.poll(at(3, 120)), "loaded once, not on every poll");
        // Rewritten to what was loaded before the last load: a change all the same.
        assert!(!settle.poll(at(1, 100)));
        assert!(settle.poll(at(1, 100)));
        // The file disappears (a rename in progress) and comes back unchanged: nothing to do.
        assert!(!settle.poll(None));
        assert!(!settle.poll(at(1, 100)));
        assert!(!settle.poll(at(1, 100)));
    }

    #[test]
    fn a_file_loaded_on_sighup_is_not_loaded_again_by_the_watcher() {
        let mut settle = Settle::new(at(1, 100));
        assert!(!settle.poll(at(2, 50)));
        settle.loaded(at(2, 50));
        assert!(!settle.poll(at(2, 50)));
        assert!(!settle.poll(at(2, 50)));
    }

    fn config(toml: &str) -> Config {
        Config::from_toml(toml).expect("valid")
    }

    #[test]
    fn changed_settings_are_named_by_key_without_their_values() {
        let old = config(
            "[admin]\ntoken = \"old-secret\"\n[store]\nredis_url = \"redis://:pw1@db:6379\"\n\
             [[routes]]\nprefix = \"/a\"\nbase_url = \"http://a.example\"\n",
        );
        let new = config(
            "[admin]\ntoken = \"new-secret\"\n[store]\nredis_url = \"redis://:pw2@db:6379\"\n\
             [[routes]]\nprefix = \"/a\"\nbase_url = \"http://b.example\"\n\
             [compaction]\nmax_messages = 10\n[models.\"my-model*\"]\ncontext_window = 1000\n\
             [summarizer.openai]\nbase_url = \"http://summaries.example\"\n",
        );
        let keys = changed_keys(&old, &new);
        assert_eq!(
            keys,
            vec![
                "admin.token",
                "compaction.max_messages",
                "models.\"my-model*\"",
                "routes",
                "store.redis_url",
                "summarizer.openai.base_url",
            ]
        );
        let changes = Changes {
            keys,
            needs_restart: Vec::new(),
        };
        assert_eq!(
            changes.destinations(),
            vec!["routes", "summarizer.openai.base_url"]
        );
        assert!(changed_keys(&new, &new.clone()).is_empty());
    }

    #[test]
    fn destinations_show_origins_only() {
        let c = config(
            "[upstream]\nbase_url = \"https://user:pw@llm.example:8443/account-7/v1\"\n\
             [[routes]]\nprefix = \"/anthropic\"\nbase_url = \"https://api.anthropic.com\"\n",
        );
        assert_eq!(
            destinations(&c),
            vec![
                "https://llm.example:8443",
                "/anthropic -> https://api.anthropic.com"
            ]
        );
    }

    fn reread(toml: &str, upstream_written: bool) -> Reread {
        Reread {
            config: config(toml),
            upstream_written,
        }
    }

    #[test]
    fn removing_admin_auth_or_dropping_the_upstream_is_refused() {
        let running = config("[admin]\ntoken = \"t\"\n[upstream]\nbase_url = \"http://u\"\n");
        let refused = |toml: &str, written: bool| {
            refusal(&running, &reread(toml, written)).map(|(risk, e)| match e {
                ConfigError::Invalid { key, .. } => (risk, key),
                other => panic!("{other}"),
            })
        };
        assert_eq!(
            refused("[upstream]\nbase_url = \"http://u\"\n", true),
            Some((Some(RiskyChange::AdminAuthRemoved), "admin.token".into()))
        );
        assert_eq!(
            refused("[admin]\ntoken = \"t\"\n", false),
            Some((None, "upstream.base_url".into()))
        );
        // Changing either is allowed.
        assert_eq!(
            refused(
                "[admin]\ntoken = \"t2\"\n[upstream]\nbase_url = \"http://v\"\n",
                true
            ),
            None
        );
        // Naming the default explicitly is a change like any other.
        assert_eq!(
            refused(
                "[admin]\ntoken = \"t\"\n[upstream]\nbase_url = \"https://api.openai.com\"\n",
                true
            ),
            None
        );
        // A running default upstream that stays the default needs no naming.
        let running = Config::default();
        assert_eq!(
            refusal(&running, &reread("[compaction]\nmax_messages = 9\n", false)).map(|r| r.0),
            None
        );
        // Adding a token is allowed.
        assert!(refusal(&running, &reread("[admin]\ntoken = \"t\"\n", false)).is_none());
    }
}
