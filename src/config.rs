//! Configuration: the only module that reads files or the environment.
//!
//! Layers, lowest first: built-in defaults (including the shipped models table,
//! `config/models.toml`), the TOML file, then environment variables
//! `COMPACTOR_<SECTION>__<KEY>`. Every struct denies unknown keys, so a typo is an error that
//! names the key rather than a silently ignored setting. Durations are typed as they are read
//! ([`Seconds`]: the `*_secs` keys), so the rest of the app only ever sees a [`Duration`];
//! [`Config::validate`] checks what else serde cannot (URLs, paired TLS files, ratios) so that
//! `check-config` and `serve` fail at start-up, never at the first request.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use compactor_plugin_anthropic::AnthropicSettings;
use compactor_plugin_exec::ExecSettings;
use compactor_plugin_extractive::ExtractiveConfig;
use compactor_plugin_gemini::GeminiSettings;
use compactor_plugin_openai::OpenAiSettings;

/// The path `serve` and `check-config` read when no `--config` is given (if it exists).
pub const DEFAULT_CONFIG_PATH: &str = "config/compactor.toml";

/// The models table shipped with compactor; user entries of the same name override these.
const SHIPPED_MODELS: &str = include_str!("../config/models.toml");

/// Shown instead of a secret by [`Config::redacted`].
const REDACTED: &str = "[redacted]";

/// A configuration problem, always naming the offending key when there is one.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file, the environment or a value could not be read into the schema.
    #[error("{0}")]
    Load(Box<figment::Error>),
    /// A value parsed but makes no sense.
    #[error("invalid `{key}`: {reason}")]
    Invalid {
        /// The dotted key, e.g. `upstream.base_url`.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The file is not TOML (on a reload, often: cut off mid-write).
    #[error(
        "{}: not valid TOML at line {line}, column {column}: {message} (the line is not shown: it may hold a secret)",
        file.display()
    )]
    Syntax {
        /// The file.
        file: PathBuf,
        /// 1-based line of the error.
        line: usize,
        /// 1-based column (in characters).
        column: usize,
        /// The parser's message, without the line it quotes.
        message: String,
    },
    /// On a reload ([`Config::reread`]): the file sets nothing at all. That is what an editor
    /// or `cat >` leaves while it writes, and loading it would put every setting back to its
    /// default (the upstream included); a deliberate defaults-only file is only read at
    /// start-up.
    #[error(
        "{} sets nothing (empty, or comments and section headers only): is it being written?",
        .0.display()
    )]
    Blank(PathBuf),
}

impl From<figment::Error> for ConfigError {
    /// figment's messages quote the offending value; for a secret key that would print the
    /// secret (to stderr, or to the log on a reload), so those errors name the key only.
    /// A `*_secs` value that is a number but not a usable duration ([`Seconds`]) is reported
    /// like every other invalid value: `invalid `key`: reason`.
    fn from(e: figment::Error) -> Self {
        let errors: Vec<figment::Error> = e.clone().into_iter().collect();
        if let Some(key) = errors
            .iter()
            .map(|e| e.path.join("."))
            .find(|k| is_secret_key(k))
        {
            return invalid(key, "must be a string (value not shown: it is a secret)");
        }
        let seconds = errors.iter().find_map(|e| match &e.kind {
            figment::error::Kind::Message(reason)
                if e.path.last().is_some_and(|k| k.ends_with("_secs")) =>
            {
                Some(invalid(e.path.join("."), reason.clone()))
            }
            _ => None,
        });
        seconds.unwrap_or_else(|| ConfigError::Load(Box::new(e)))
    }
}

/// The prefix of configuration variables.
const ENV_PREFIX: &str = "COMPACTOR_";

/// `COMPACTOR_*` variables in the environment that are not `COMPACTOR_<SECTION>__<KEY>`, and so
/// are not read as configuration (worth a warning: a misspelt separator would otherwise be
/// silently lost).
pub fn ignored_env_vars() -> Vec<String> {
    let mut ignored: Vec<String> = std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .filter(|name| {
            name.strip_prefix(ENV_PREFIX)
                .is_some_and(|rest| !rest.contains("__"))
        })
        .collect();
    ignored.sort();
    ignored
}

/// Keys whose values are secrets: never printed, and read from the environment verbatim.
fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key == "admin.token" || key.starts_with("summarizer.exec.env.")
}

/// `COMPACTOR_<SECTION>__<KEY>` variables. figment reads values as typed data (`12345` is a
/// number), so secrets are merged as the exact strings they are: a numeric admin token works
/// and keeps its leading zeros. Keys are lowercased, except the variable names under
/// `summarizer.exec.env`, which the program sees as written.
///
/// Only names of that shape are config: a script's own `COMPACTOR_BIN` or `COMPACTOR_HOME` is
/// none of compactor's business and is ignored ([`ignored_env_vars`] names them for a warning);
/// an unknown key inside a section is still an error.
fn merge_env(figment: Figment) -> Figment {
    let env = Env::prefixed(ENV_PREFIX)
        .split("__")
        .filter(|key| key.as_str().contains('.'));
    let secrets: Vec<(String, String)> = env
        .clone()
        .lowercase(false)
        .iter()
        .filter(|(key, _)| is_secret_key(key.as_str()))
        .map(|(key, value)| {
            let mut segments = key.as_str().splitn(4, '.');
            let mut path: Vec<String> = segments
                .by_ref()
                .take(3)
                .map(str::to_ascii_lowercase)
                .collect();
            path.extend(segments.map(str::to_owned));
            (path.join("."), value)
        })
        .collect();
    let figment = figment.merge(env.filter(|key| !is_secret_key(key.as_str())));
    secrets
        .into_iter()
        .fold(figment, |figment, secret| figment.merge(secret))
}

/// Whether `url` is a Redis URL the client accepts. The reason never repeats the URL: it may
/// hold a password.
fn redis_url_check(url: &str) -> Result<(), &'static str> {
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        return Err("must start with redis:// or rediss://");
    }
    redis::Client::open(url)
        .map(|_| ())
        .map_err(|_| "is not a valid Redis URL")
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

/// A configuration read again for a hot reload ([`Config::reread`]), with what the reload
/// must know about how it was written.
#[derive(Debug)]
pub struct Reread {
    /// The configuration, validated.
    pub config: Config,
    /// Whether the file or the environment sets `upstream.base_url`. When neither does, the
    /// upstream is the built-in default: a file that lost its `[upstream]` section would send
    /// every caller's credentials to `https://api.openai.com`.
    pub upstream_written: bool,
}

/// Whether a parsed TOML table sets anything: a value somewhere, not only (nested) empty
/// tables.
fn sets_anything(table: &toml::Table) -> bool {
    table.values().any(|value| match value {
        toml::Value::Table(inner) => sets_anything(inner),
        _ => true,
    })
}

/// What the file and the environment set, without the defaults under them.
struct Written {
    /// The file (read once: what is checked is what is loaded), then the environment.
    figment: Figment,
    /// The file, when it sets nothing at all.
    blank_file: Option<PathBuf>,
}

/// Reads [`Config::file`] and the environment. An explicitly named file must exist. A file
/// that is not TOML is refused with its line and column but not the line itself, which may
/// hold a secret cut short (`token = "s3cr`).
fn written(path: Option<&Path>) -> Result<Written, ConfigError> {
    let mut written = Written {
        figment: Figment::new(),
        blank_file: None,
    };
    if let Some(file) = Config::file(path) {
        let text = std::fs::read_to_string(&file)
            .map_err(|e| figment::Error::from(format!("cannot read {}: {e}", file.display())))?;
        let table = text
            .parse::<toml::Table>()
            .map_err(|e| syntax_error(&file, &text, &e))?;
        if !sets_anything(&table) {
            written.blank_file = Some(file);
        }
        written.figment = written.figment.merge(Toml::string(&text));
    }
    written.figment = merge_env(written.figment);
    Ok(written)
}

fn syntax_error(file: &Path, text: &str, e: &toml::de::Error) -> ConfigError {
    let at = e
        .span()
        .map_or(text.len(), |span| span.start.min(text.len()));
    let before = text.get(..at).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before
        .rsplit('\n')
        .next()
        .map_or(0, |line| line.chars().count())
        + 1;
    ConfigError::Syntax {
        file: file.to_path_buf(),
        line,
        column,
        message: e.message().to_owned(),
    }
}

/// The whole configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Listeners, limits, logging.
    pub server: ServerConfig,
    /// The default upstream.
    pub upstream: UpstreamConfig,
    /// Extra upstreams selected by path prefix, tried in order before the default.
    pub routes: Vec<RouteConfig>,
    /// The compaction engine.
    pub compaction: CompactionConfig,
    /// Which backend writes summaries.
    pub summarizer: SummarizerConfig,
    /// The admin listener.
    pub admin: AdminConfig,
    /// How conversations are identified.
    pub session: SessionConfig,
    /// Where checkpoints and sessions are kept.
    pub store: StoreConfig,
    /// Context windows by model name or glob (`"gpt-4o*"`).
    pub models: BTreeMap<String, ModelConfig>,
}

/// `[server]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Proxy listener.
    pub listen: SocketAddr,
    /// Admin listener (`/metrics`, `/livez`, `/readyz`, sessions).
    pub admin_listen: SocketAddr,
    /// Largest request body compactor reads into memory (chat requests); larger ones get 413.
    pub max_body_bytes: usize,
    /// Most bytes of chat bodies held in memory at once, across requests; a body beyond it is
    /// streamed upstream uncompacted.
    pub max_buffered_bytes: usize,
    /// How long shutdown waits for in-flight requests and streams.
    pub shutdown_grace_secs: Seconds,
    /// How long a client may take to send a request's head and body (between two frames of a
    /// body streamed through), how long a write of its answer may make no progress (a client
    /// that stops reading), and how long a connection with no request in progress stays open.
    pub client_timeout_secs: Seconds,
    /// Most client connections held on the proxy listener; beyond it accepting waits.
    pub max_connections: usize,
    /// `text` or `json`.
    pub log_format: LogFormat,
    /// Log one line per proxied request (target `compactor::access`, level info): method,
    /// path (never the query), status, upstream, session, estimated tokens in and out,
    /// whether it was compacted, and the time to the response head.
    pub access_log: bool,
    /// A file to append one JSON line to per compaction, mask step, refusal retry and failed
    /// compaction (unset: none).
    pub event_log: Option<PathBuf>,
    /// The event log's bound: past it the file is renamed to `<path>.1` and a new one begun.
    pub event_log_max_bytes: u64,
    /// PEM certificate chain for inbound TLS; set together with `tls_key`.
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for inbound TLS.
    pub tls_key: Option<PathBuf>,
}

/// Log output format.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// `compaction.mode`, or a request's `x-compactor-mode` header: what compactor does with a
/// conversation it would compact.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Forward the compacted request.
    Enforce,
    /// Decide as `enforce` would, forward the request as received.
    Shadow,
    /// Leave the request alone (the header only: `compaction.enabled = false` in the file).
    Off,
}

impl Mode {
    /// The value as written in the config file and the header.
    pub fn label(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
            Mode::Off => "off",
        }
    }

    /// The mode a header value names (`off`, `shadow`, `enforce`, any case).
    pub fn from_header(value: &str) -> Option<Mode> {
        [Mode::Enforce, Mode::Shadow, Mode::Off]
            .into_iter()
            .find(|m| value.trim().eq_ignore_ascii_case(m.label()))
    }
}

/// `compaction.strategy`: how a long conversation is made smaller (docs/architecture.md,
/// *Masking of old observations*).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Replace older turns with a summary when the trigger fires; tool outputs are forwarded
    /// as sent.
    Summarize,
    /// Replace old tool outputs in the forwarded request with a short placeholder; never call
    /// the summarizer on the request path.
    Mask,
    /// Mask old tool outputs, and summarise only when the masked request is still over the
    /// trigger.
    Hybrid,
}

impl Strategy {
    /// Every strategy, in the order of their label values.
    pub const ALL: [Strategy; 3] = [Strategy::Summarize, Strategy::Mask, Strategy::Hybrid];

    /// The configuration value and metric label.
    pub fn label(self) -> &'static str {
        match self {
            Strategy::Summarize => "summarize",
            Strategy::Mask => "mask",
            Strategy::Hybrid => "hybrid",
        }
    }

    /// The strategy named `name` (its configuration value).
    pub fn from_label(name: &str) -> Option<Strategy> {
        Strategy::ALL.into_iter().find(|s| s.label() == name)
    }

    /// Whether old tool outputs are masked in the forwarded request.
    pub fn masks(self) -> bool {
        !matches!(self, Strategy::Summarize)
    }

    /// Whether a request over the trigger is summarised.
    pub fn summarizes(self) -> bool {
        !matches!(self, Strategy::Mask)
    }
}

/// Default of `compaction.strategy`.
pub const DEFAULT_STRATEGY: Strategy = Strategy::Hybrid;

/// Default of `compaction.keep_recent_outputs`.
pub const DEFAULT_KEEP_RECENT_OUTPUTS: usize = 5;

/// Default of `compaction.mask_block`.
pub const DEFAULT_MASK_BLOCK: usize = 10;

/// `[upstream]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// Where requests go unless a route matches; a path here is prepended to request paths.
    pub base_url: String,
    /// TCP (+ TLS) connect timeout.
    pub connect_timeout_secs: Seconds,
    /// How long to wait for the upstream's response head (status + headers).
    pub response_timeout_secs: Seconds,
    /// How long an idle pooled connection is kept.
    pub pool_idle_timeout_secs: Seconds,
    /// Extra PEM root certificates trusted for `https` upstreams (besides webpki and native
    /// roots), e.g. a private CA in front of a self-hosted model server.
    pub ca_file: Option<PathBuf>,
}

/// One `[[routes]]` entry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Path prefix that selects this route, e.g. `/anthropic`.
    pub prefix: String,
    /// Upstream for matching requests.
    pub base_url: String,
    /// Remove `prefix` from the path before forwarding (default true).
    #[serde(default = "yes")]
    pub strip_prefix: bool,
    /// `[compaction]` settings that differ for this route's requests (the rest are the
    /// `[compaction]` section's).
    #[serde(default, skip_serializing_if = "RouteCompaction::is_empty")]
    pub compaction: RouteCompaction,
}

/// `[routes.compaction]`: the `[compaction]` settings a route may set for its own requests,
/// so one proxy serves an agent with `hybrid` and a batch job with compaction off. Unset keys
/// are the `[compaction]` section's.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RouteCompaction {
    /// `compaction.enabled` for this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// `compaction.mode` for this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// `compaction.sample_ratio` for this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_ratio: Option<f64>,
    /// `compaction.strategy` for this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<Strategy>,
    /// `compaction.max_messages` for this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_messages: Option<usize>,
    /// `compaction.trigger_ratio` for this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger_ratio: Option<f64>,
    /// `compaction.background_ratio` for this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub background_ratio: Option<f64>,
    /// `compaction.cost_trigger` for this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_trigger: Option<bool>,
    /// `compaction.min_preserve_tokens` for this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_preserve_tokens: Option<usize>,
    /// `compaction.max_preserve_tokens` for this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_preserve_tokens: Option<usize>,
    /// `compaction.keep_recent_outputs` for this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_recent_outputs: Option<usize>,
}

impl RouteCompaction {
    /// Whether the route sets nothing of its own.
    pub fn is_empty(&self) -> bool {
        *self == RouteCompaction::default()
    }

    /// `base` with this route's settings over it.
    pub fn over(&self, base: &CompactionConfig) -> CompactionConfig {
        fn set<T: Copy>(to: &mut T, from: &Option<T>) {
            if let Some(v) = from {
                *to = *v;
            }
        }
        let mut c = base.clone();
        set(&mut c.enabled, &self.enabled);
        set(&mut c.mode, &self.mode);
        set(&mut c.sample_ratio, &self.sample_ratio);
        set(&mut c.strategy, &self.strategy);
        set(&mut c.max_messages, &self.max_messages);
        set(&mut c.trigger_ratio, &self.trigger_ratio);
        set(&mut c.background_ratio, &self.background_ratio);
        set(&mut c.cost_trigger, &self.cost_trigger);
        set(&mut c.min_preserve_tokens, &self.min_preserve_tokens);
        set(&mut c.max_preserve_tokens, &self.max_preserve_tokens);
        set(&mut c.keep_recent_outputs, &self.keep_recent_outputs);
        c
    }
}

fn yes() -> bool {
    true
}

/// Default of `compaction.max_tracked_files`: files kept in each list.
pub const DEFAULT_MAX_TRACKED_FILES: usize = 50;

/// `[compaction]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CompactionConfig {
    /// Master switch; when false every request passes through unchanged.
    pub enabled: bool,
    /// `enforce` forwards the compacted request; `shadow` decides everything as `enforce`
    /// would (summaries by the local `extractive` backend, kept apart) and forwards the
    /// request as received, counting what enforce would have sent.
    pub mode: Mode,
    /// The share of conversations compacted (0.0 to 1.0), chosen by a stable hash of the
    /// session id; the others are the control cohort, forwarded unchanged.
    pub sample_ratio: f64,
    /// Compact when a request holds more messages than this.
    pub max_messages: usize,
    /// Floor of the tail budget (the verbatim tail a compaction keeps), in estimated tokens,
    /// so a small window still leaves the model recent work to carry on from. A request's
    /// later attempts halve the budget, below this floor if need be, when a rewrite would
    /// still be over the trigger.
    pub min_preserve_tokens: usize,
    /// Ceiling of the tail budget, in estimated tokens, so a large window still leaves a
    /// compaction something worth summarising. It bounds the walk that picks the tail, not
    /// the tail: the last message, the latest user turn (when it fits half the trigger) and
    /// tool calls with their results are kept whole, past it if need be.
    pub max_preserve_tokens: usize,
    /// Mask old tool outputs in the transcript handed to the summarizer.
    pub mask_observations: bool,
    /// How a long conversation is made smaller: `summarize`, `mask` or `hybrid`.
    pub strategy: Strategy,
    /// Tool outputs of the forwarded request kept verbatim, most recent first (`mask`,
    /// `hybrid`).
    pub keep_recent_outputs: usize,
    /// Older outputs are masked this many at a time, so the forwarded prefix stays
    /// byte-identical between steps (`mask`, `hybrid`).
    pub mask_block: usize,
    /// A regular expression that tells an observation sent as a person's turn (`mask`,
    /// `hybrid`): a user message of text only that follows an assistant message and matches
    /// it is masked like a tool output. Empty (the default): only tool outputs are masked,
    /// never what a person wrote.
    pub observation_pattern: String,
    /// Compact when estimated input tokens reach `trigger_ratio × context window − reserved
    /// output`, the reserved output being the request's own `max_tokens` (or
    /// `max_completion_tokens`, `max_output_tokens`) capped at half the window: providers count
    /// the output against the same window, and the ratio leaves room for the estimate's error.
    pub trigger_ratio: f64,
    /// Start the summary in the background when a conversation reaches this share of the
    /// trigger (tokens and messages alike), so the request that crosses the trigger finds it
    /// made; 0 turns background summaries off.
    pub background_ratio: f64,
    /// Also compact below the trigger when it pays (`pipeline::payback`): once the prompt-cache
    /// reads of what a summary would remove have cost a compaction, priced at the model's
    /// prices; made in the background. Models without a price never compact early.
    pub cost_trigger: bool,
    /// Preserve budget as a share of the usable window (then clamped to min/max preserve).
    pub preserve_ratio: f64,
    /// Context window assumed for models missing from the models table.
    pub default_context_window: usize,
    /// After repeated failed compactions a session stops compacting for this long.
    pub breaker_cooldown_secs: Seconds,
    /// Scale token estimates per model by the observed ratio of the provider's reported input
    /// tokens to compactor's estimate, so the token trigger fires at the right point.
    pub calibration: bool,
    /// Most files kept in each of the summary's "read" and "modified" lists (most recent
    /// first).
    pub max_tracked_files: usize,
}

/// `[summarizer]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SummarizerConfig {
    /// The backend tried first: `auto`, `openai`, `anthropic`, `gemini`, `extractive` or
    /// `exec`.
    pub backend: String,
    /// Backends tried in order when the previous one fails.
    pub fallback: Vec<String>,
    /// How long one summary may take, per backend attempt.
    pub timeout_secs: Seconds,
    /// Most summaries made in the background at once; beyond it a conversation is summarised
    /// when it crosses the trigger, as without background summaries.
    pub max_concurrent: usize,
    /// Longest summary accepted from any backend, in bytes. What a backend reads is bounded
    /// by it too: a provider's whole HTTP answer, or an `exec` program's stdout, is read up to
    /// this plus 64 KiB for the JSON around the summary, and refused beyond without reading
    /// the rest. A summary is asked for with a budget of a few thousand tokens (tens of
    /// kilobytes); the default, 1 MiB (some 250,000 tokens), is far above that and above most
    /// context windows, so only a misbehaving backend reaches it.
    pub max_summary_bytes: usize,
    /// `[summarizer.openai]`: declared, defaulted and validated by the plugin.
    pub openai: OpenAiSettings,
    /// `[summarizer.anthropic]`: declared, defaulted and validated by the plugin.
    pub anthropic: AnthropicSettings,
    /// `[summarizer.gemini]`: declared, defaulted and validated by the plugin.
    pub gemini: GeminiSettings,
    /// `[summarizer.extractive]`: declared, defaulted and validated by the plugin.
    pub extractive: ExtractiveConfig,
    /// `[summarizer.exec]`: declared and validated by the plugin.
    pub exec: ExecSettings,
}

/// `[admin]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// When set, admin endpoints other than `/livez` and `/readyz` need `Bearer <token>`.
    pub token: Option<String>,
}

/// `[session]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SessionConfig {
    /// Request header whose value names the session; absent: derived from the tenant and the
    /// conversation's first messages.
    pub header: String,
}

/// Where sessions and checkpoints live (`store.backend`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum StoreBackend {
    /// In this process only (bounded by the `max_*` keys).
    #[default]
    Memory,
    /// Shared through Redis by every replica pointing at the same server and `key_prefix`.
    Redis,
}

/// `[store]`: the session store: in memory (bounded) or shared through Redis.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Most sessions kept; the least recently used is evicted beyond this.
    pub max_sessions: usize,
    /// Most sessions one tenant (credential) keeps, so one tenant cannot evict the rest: a
    /// tenant beyond it loses its own least recently used. It also bounds the tenant's bytes
    /// to the same fraction of `max_bytes`. Counted as at most `max_sessions` (a larger
    /// value is not an error, so lowering `max_sessions` alone stays valid).
    pub max_sessions_per_tenant: usize,
    /// Approximate bytes of summaries, file lists and latest requests kept.
    pub max_bytes: usize,
    /// Sessions unused for longer are forgotten.
    pub ttl_secs: Seconds,
    /// `memory` or `redis`.
    pub backend: StoreBackend,
    /// The Redis server (`redis://host:port/db`, `rediss://` for TLS). Credentials belong in
    /// the `COMPACTOR_STORE__REDIS_URL` environment variable; the URL is never printed.
    pub redis_url: String,
    /// Prefix of every Redis key, so several deployments can share one server.
    pub key_prefix: String,
    /// Bound on each Redis call; beyond it the call counts as failed and the request goes on
    /// without the store.
    pub redis_timeout_secs: Seconds,
    /// Largest latest-request body shared through Redis (larger ones stay in this replica).
    pub max_shared_request_bytes: usize,
}

/// `[models."<name or glob>"]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model's context window in tokens.
    pub context_window: usize,
    /// What the provider charges for the model; without it the model gets no cost figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price: Option<Price>,
}

/// `[models."<name or glob>"].price`: a model's prices in USD per million tokens.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Input tokens read without the prompt cache.
    pub input: f64,
    /// Output tokens (reasoning included).
    pub output: f64,
    /// Input tokens read from the prompt cache (default: `input`, no discount assumed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read: Option<f64>,
    /// Input tokens written to the prompt cache (default: `input`; Anthropic charges more).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write: Option<f64>,
}

impl Price {
    /// USD per million cache-read tokens.
    pub fn cache_read(&self) -> f64 {
        self.cache_read.unwrap_or(self.input)
    }

    /// USD per million cache-written tokens.
    pub fn cache_write(&self) -> f64 {
        self.cache_write.unwrap_or(self.input)
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8787)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9787)),
            max_body_bytes: 32 * 1024 * 1024,
            max_buffered_bytes: 128 * 1024 * 1024,
            shutdown_grace_secs: Seconds::from_secs(30),
            client_timeout_secs: Seconds::from_secs(30),
            max_connections: 4_096,
            log_format: LogFormat::Text,
            access_log: false,
            event_log: None,
            event_log_max_bytes: 64 * 1024 * 1024,
            tls_cert: None,
            tls_key: None,
        }
    }
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            base_url: "https://api.openai.com".into(),
            connect_timeout_secs: Seconds::from_secs(10),
            response_timeout_secs: Seconds::from_secs(600),
            pool_idle_timeout_secs: Seconds::from_secs(90),
            ca_file: None,
        }
    }
}

impl Default for CompactionConfig {
    fn default() -> Self {
        CompactionConfig {
            enabled: true,
            mode: Mode::Enforce,
            sample_ratio: 1.0,
            max_messages: 80,
            min_preserve_tokens: 2_000,
            max_preserve_tokens: 15_000,
            mask_observations: true,
            strategy: DEFAULT_STRATEGY,
            keep_recent_outputs: DEFAULT_KEEP_RECENT_OUTPUTS,
            mask_block: DEFAULT_MASK_BLOCK,
            observation_pattern: String::new(),
            trigger_ratio: 0.85,
            background_ratio: 0.9,
            cost_trigger: true,
            preserve_ratio: 0.25,
            default_context_window: 128_000,
            breaker_cooldown_secs: Seconds::from_secs(300),
            calibration: true,
            max_tracked_files: DEFAULT_MAX_TRACKED_FILES,
        }
    }
}

impl CompactionConfig {
    /// `observation_pattern` compiled; `None` when it is empty (observations in user turns
    /// are not recognised).
    pub fn observation_regex(&self) -> Result<Option<regex::Regex>, regex::Error> {
        if self.observation_pattern.is_empty() {
            return Ok(None);
        }
        regex::Regex::new(&self.observation_pattern).map(Some)
    }
}

impl Default for SummarizerConfig {
    fn default() -> Self {
        SummarizerConfig {
            backend: "auto".into(),
            fallback: Vec::new(),
            timeout_secs: Seconds::from_secs(60),
            max_concurrent: 4,
            max_summary_bytes: compactor_plugin_api::DEFAULT_MAX_SUMMARY_BYTES,
            openai: OpenAiSettings::default(),
            anthropic: AnthropicSettings::default(),
            gemini: GeminiSettings::default(),
            extractive: ExtractiveConfig::default(),
            exec: ExecSettings::default(),
        }
    }
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            header: "x-session-id".into(),
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            max_sessions: 10_000,
            max_sessions_per_tenant: 2_500,
            max_bytes: 256 * 1024 * 1024,
            ttl_secs: Seconds::from_secs(86_400),
            backend: StoreBackend::Memory,
            redis_url: "redis://127.0.0.1:6379".into(),
            key_prefix: "compactor".into(),
            redis_timeout_secs: Seconds::from_millis(250),
            max_shared_request_bytes: 8 * 1024 * 1024,
        }
    }
}

impl Config {
    /// Loads defaults < `path` (or [`DEFAULT_CONFIG_PATH`] when it exists) < environment, and
    /// validates the result.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let config: Config = Config::base().merge(written(path)?.figment).extract()?;
        config.validate()?;
        Ok(config)
    }

    /// Loads like [`Config::load`], for a reload of a running server: a file that sets
    /// nothing is refused ([`ConfigError::Blank`]) rather than read as "all defaults", and the
    /// result says whether the upstream was named. A file that does not parse (one cut off
    /// mid-value) is refused as at start-up.
    pub fn reread(path: Option<&Path>) -> Result<Reread, ConfigError> {
        let written = written(path)?;
        if let Some(file) = written.blank_file {
            return Err(ConfigError::Blank(file));
        }
        let config: Config = Config::base().merge(written.figment.clone()).extract()?;
        config.validate()?;
        Ok(Reread {
            config,
            upstream_written: written.figment.contains("upstream.base_url"),
        })
    }

    /// The file [`Config::load`] reads: `path`, else [`DEFAULT_CONFIG_PATH`] when it exists.
    pub fn file(path: Option<&Path>) -> Option<PathBuf> {
        path.map(Path::to_path_buf).or_else(|| {
            let default = PathBuf::from(DEFAULT_CONFIG_PATH);
            default.exists().then_some(default)
        })
    }

    /// Parses a TOML document over the defaults (no environment): for tests and tools.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let config: Config = Config::base().merge(Toml::string(text)).extract()?;
        config.validate()?;
        Ok(config)
    }

    /// The shipped models table alone (`config/models.toml`), as compactor is built with it.
    pub fn shipped_models() -> BTreeMap<String, ModelConfig> {
        #[derive(Deserialize)]
        struct Shipped {
            models: BTreeMap<String, ModelConfig>,
        }
        // Checked by the tests: the shipped table always parses.
        toml::from_str::<Shipped>(SHIPPED_MODELS).map_or_else(|_| BTreeMap::new(), |s| s.models)
    }

    /// The built-in defaults with the shipped models table over them.
    fn base() -> Figment {
        Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(SHIPPED_MODELS))
    }

    /// Checks what deserialisation cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_base_url("upstream.base_url", &self.upstream.base_url)?;
        for (i, route) in self.routes.iter().enumerate() {
            check_base_url(&format!("routes[{i}].base_url"), &route.base_url)?;
            if !route.prefix.starts_with('/') || route.prefix.len() < 2 {
                return Err(invalid(
                    format!("routes[{i}].prefix"),
                    "must start with `/` and name a path segment",
                ));
            }
            if !route.compaction.is_empty() {
                // The route's settings are checked as the `[compaction]` section they make.
                self.for_route(i).validate().map_err(|e| match e {
                    ConfigError::Invalid { key, reason } => invalid(
                        match key.strip_prefix("compaction.") {
                            Some(k) => format!("routes[{i}].compaction.{k}"),
                            None => key,
                        },
                        reason,
                    ),
                    other => other,
                })?;
            }
        }
        if self.server.tls_cert.is_some() != self.server.tls_key.is_some() {
            return Err(invalid(
                "server.tls_cert",
                "`server.tls_cert` and `server.tls_key` must be set together",
            ));
        }
        if self.server.max_connections == 0 {
            return Err(invalid("server.max_connections", "must be positive"));
        }
        // An empty token can never be sent (header values are trimmed): it would lock every
        // admin client out while looking like auth is on.
        if self
            .admin
            .token
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return Err(invalid(
                "admin.token",
                "must not be blank (leave it unset for no admin auth)",
            ));
        }
        if self.client_timeout().is_zero() {
            return Err(invalid("server.client_timeout_secs", "must be positive"));
        }
        if self.server.max_buffered_bytes == 0 {
            return Err(invalid("server.max_buffered_bytes", "must be positive"));
        }
        if self.server.max_body_bytes == 0 {
            return Err(invalid("server.max_body_bytes", "must be positive"));
        }
        if self.server.event_log_max_bytes == 0 {
            return Err(invalid("server.event_log_max_bytes", "must be positive"));
        }
        let c = &self.compaction;
        for (key, ratio) in [
            ("compaction.trigger_ratio", c.trigger_ratio),
            ("compaction.preserve_ratio", c.preserve_ratio),
        ] {
            if ratio.is_nan() || ratio <= 0.0 || ratio > 1.0 {
                return Err(invalid(key, "must be in (0, 1]"));
            }
        }
        if c.background_ratio.is_nan() || !(0.0..1.0).contains(&c.background_ratio) {
            return Err(invalid(
                "compaction.background_ratio",
                "must be in [0, 1) (0 turns background summaries off)",
            ));
        }
        if c.sample_ratio.is_nan() || !(0.0..=1.0).contains(&c.sample_ratio) {
            return Err(invalid(
                "compaction.sample_ratio",
                "must be in [0, 1] (the share of conversations compacted)",
            ));
        }
        if c.mode == Mode::Off {
            return Err(invalid(
                "compaction.mode",
                "must be `enforce` or `shadow` (`enabled = false` turns compaction off)",
            ));
        }
        if c.mask_block == 0 {
            return Err(invalid("compaction.mask_block", "must be positive"));
        }
        if let Err(e) = c.observation_regex() {
            return Err(invalid("compaction.observation_pattern", e.to_string()));
        }
        if c.keep_recent_outputs == 0 {
            return Err(invalid(
                "compaction.keep_recent_outputs",
                "must be positive (the model must see the output it asked for last)",
            ));
        }
        if self.summarizer.max_concurrent == 0 {
            return Err(invalid("summarizer.max_concurrent", "must be positive"));
        }
        if self.summarizer.max_summary_bytes == 0 {
            return Err(invalid("summarizer.max_summary_bytes", "must be positive"));
        }
        if c.min_preserve_tokens > c.max_preserve_tokens {
            return Err(invalid(
                "compaction.min_preserve_tokens",
                "must not exceed `compaction.max_preserve_tokens`",
            ));
        }
        if c.max_messages < 2 {
            return Err(invalid("compaction.max_messages", "must be at least 2"));
        }
        if self.store.max_sessions == 0 {
            return Err(invalid("store.max_sessions", "must be positive"));
        }
        if self.store.max_sessions_per_tenant == 0 {
            return Err(invalid("store.max_sessions_per_tenant", "must be positive"));
        }
        if self.store.max_bytes == 0 {
            return Err(invalid("store.max_bytes", "must be positive"));
        }
        if self.store.backend == StoreBackend::Redis {
            if let Err(e) = redis_url_check(&self.store.redis_url) {
                return Err(invalid("store.redis_url", e));
            }
        }
        if self.store.key_prefix.is_empty() || self.store.key_prefix.contains(['{', '}']) {
            return Err(invalid(
                "store.key_prefix",
                "must be non-empty and free of braces (they delimit the tenant in keys)",
            ));
        }
        if http::HeaderName::from_bytes(self.session.header.as_bytes()).is_err() {
            return Err(invalid(
                "session.header",
                "must be a valid HTTP header name",
            ));
        }
        if c.default_context_window == 0 {
            return Err(invalid(
                "compaction.default_context_window",
                "must be positive",
            ));
        }
        for (name, model) in &self.models {
            if model.context_window == 0 {
                return Err(invalid(
                    format!("models.\"{name}\".context_window"),
                    "must be positive",
                ));
            }
            if let Some(price) = &model.price {
                let each = [
                    ("input", Some(price.input)),
                    ("output", Some(price.output)),
                    ("cache_read", price.cache_read),
                    ("cache_write", price.cache_write),
                ];
                for (key, value) in each {
                    if value.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
                        return Err(invalid(
                            format!("models.\"{name}\".price.{key}"),
                            "must be a finite number of USD per million tokens, at least 0",
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The configuration route `i`'s requests are compacted by: `[compaction]` with the
    /// route's own settings over it, and no routes (so it validates on its own).
    pub fn for_route(&self, i: usize) -> Config {
        let mut config = self.clone();
        if let Some(route) = self.routes.get(i) {
            config.compaction = route.compaction.over(&self.compaction);
        }
        config.routes = Vec::new();
        config
    }

    /// A copy safe to print: every secret replaced by `[redacted]`.
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        if c.admin.token.is_some() {
            c.admin.token = Some(REDACTED.into());
        }
        for value in c.summarizer.exec.env.values_mut() {
            *value = REDACTED.into();
        }
        c.store.redis_url = REDACTED.into();
        c
    }

    /// The configuration as TOML (call on [`Config::redacted`] before printing).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render: {e}\n"))
    }

    /// For `check-config`: each route with compaction settings of its own and the whole
    /// `[compaction]` its requests get, as TOML comments (the output still loads as it is).
    pub fn route_settings(&self) -> String {
        let mut out = String::new();
        for (i, route) in self.routes.iter().enumerate() {
            if route.compaction.is_empty() {
                continue;
            }
            let effective = route.compaction.over(&self.compaction);
            let table =
                toml::to_string(&effective).unwrap_or_else(|e| format!("cannot render: {e}\n"));
            out.push_str(&format!(
                "\n# routes[{i}] ({}): its requests are compacted with\n# [compaction]\n",
                route.prefix
            ));
            for line in table.lines() {
                out.push_str("# ");
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    /// The upstream response-head timeout.
    pub fn response_timeout(&self) -> Duration {
        self.upstream.response_timeout_secs.duration()
    }

    /// Every upstream base URL a request may be routed to (the default and each route's),
    /// written as a routed request's caller carries it: without a trailing `/`.
    pub fn upstream_base_urls(&self) -> Vec<String> {
        std::iter::once(&self.upstream.base_url)
            .chain(self.routes.iter().map(|r| &r.base_url))
            .map(|url| url.trim_end_matches('/').to_owned())
            .collect()
    }

    /// The shutdown drain period.
    pub fn shutdown_grace(&self) -> Duration {
        self.server.shutdown_grace_secs.duration()
    }

    /// How long a client may take to send a request, stall reading its answer, or leave its
    /// connection idle.
    pub fn client_timeout(&self) -> Duration {
        self.server.client_timeout_secs.duration()
    }

    /// The upstream connect timeout.
    pub fn connect_timeout(&self) -> Duration {
        self.upstream.connect_timeout_secs.duration()
    }

    /// The idle time after which pooled upstream connections close.
    pub fn pool_idle_timeout(&self) -> Duration {
        self.upstream.pool_idle_timeout_secs.duration()
    }

    /// The bound on each Redis call.
    pub fn redis_timeout(&self) -> Duration {
        self.store.redis_timeout_secs.duration()
    }

    /// How long an unused session is kept.
    pub fn store_ttl(&self) -> Duration {
        self.store.ttl_secs.duration()
    }

    /// How long a session's automatic compaction pauses after repeated failures.
    pub fn breaker_cooldown(&self) -> Duration {
        self.compaction.breaker_cooldown_secs.duration()
    }

    /// The per-attempt summarizer timeout.
    pub fn summarizer_timeout(&self) -> Duration {
        self.summarizer.timeout_secs.duration()
    }
}

/// A positive duration, written in the file (and the environment) as a number of seconds:
/// `30`, `0.5`. It is typed once, when the configuration is read, so nothing after reads
/// seconds as a number, and a value that is not a positive number of seconds fitting a
/// [`Duration`] (zero, negative, NaN, infinite, overflowing) never makes it into a [`Config`]:
/// reading it fails with [`ConfigError::Invalid`] naming the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct Seconds(Duration);

impl Seconds {
    /// A whole number of seconds (the built-in defaults); must be positive.
    const fn from_secs(secs: u64) -> Seconds {
        Seconds(Duration::from_secs(secs))
    }

    const fn from_millis(millis: u64) -> Seconds {
        Seconds(Duration::from_millis(millis))
    }

    /// The duration.
    pub fn duration(self) -> Duration {
        self.0
    }
}

impl TryFrom<f64> for Seconds {
    type Error = String;

    fn try_from(secs: f64) -> Result<Seconds, String> {
        if secs.is_nan() || secs <= 0.0 {
            return Err(SECONDS_NOT_POSITIVE.into());
        }
        let duration = Duration::try_from_secs_f64(secs).map_err(|e| e.to_string())?;
        // A value below a nanosecond rounds to zero: as unusable as zero itself.
        if duration.is_zero() {
            return Err(SECONDS_NOT_POSITIVE.into());
        }
        Ok(Seconds(duration))
    }
}

impl From<Seconds> for f64 {
    fn from(s: Seconds) -> f64 {
        s.0.as_secs_f64()
    }
}

/// Why a `*_secs` value was refused.
const SECONDS_NOT_POSITIVE: &str = "must be a positive number of seconds";

fn check_base_url(key: &str, url: &str) -> Result<(), ConfigError> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e: http::uri::InvalidUri| invalid(key, e.to_string()))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => return Err(invalid(key, "must start with http:// or https://")),
    }
    if uri.authority().is_none() {
        return Err(invalid(key, "must name a host"));
    }
    if uri.query().is_some() {
        return Err(invalid(key, "must not carry a query string"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_documented_values() {
        let c = Config::from_toml("").expect("defaults load");
        assert_eq!(c.server.listen.to_string(), "127.0.0.1:8787");
        assert_eq!(c.server.admin_listen.to_string(), "127.0.0.1:9787");
        assert_eq!(c.upstream.base_url, "https://api.openai.com");
        assert_eq!(c.compaction.max_messages, 80);
        assert_eq!(c.compaction.min_preserve_tokens, 2_000);
        assert_eq!(c.compaction.max_preserve_tokens, 15_000);
        assert!(c.compaction.mask_observations);
        assert_eq!(c.compaction.trigger_ratio, 0.85);
        assert_eq!(c.summarizer.max_summary_bytes, 1024 * 1024);
        assert!(
            c.models.contains_key("gpt-4o*"),
            "shipped models table is loaded"
        );
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_name() {
        let err = Config::from_toml("[server]\nlisten_port = 1\n").unwrap_err();
        assert!(err.to_string().contains("listen_port"), "{err}");
        let err = Config::from_toml("[nonsense]\nx = 1\n").unwrap_err();
        assert!(err.to_string().contains("nonsense"), "{err}");
    }

    #[test]
    fn bad_values_name_their_key() {
        let err = Config::from_toml("[upstream]\nbase_url = \"ftp://x\"\n").unwrap_err();
        assert!(err.to_string().contains("upstream.base_url"), "{err}");
        let err =
            Config::from_toml("[[routes]]\nprefix = \"/a\"\nbase_url = \"nope\"\n").unwrap_err();
        assert!(err.to_string().contains("routes[0].base_url"), "{err}");
        let err = Config::from_toml("[server]\nlog_format = \"xml\"\n").unwrap_err();
        assert!(err.to_string().contains("log_format"), "{err}");
        let err = Config::from_toml("[server]\ntls_cert = \"/a.pem\"\n").unwrap_err();
        assert!(err.to_string().contains("server.tls_cert"), "{err}");
        let err = Config::from_toml("[summarizer]\nmax_summary_bytes = 0\n").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid `summarizer.max_summary_bytes`: must be positive"),
            "{err}"
        );
        let err = Config::from_toml("[compaction]\ntrigger_ratio = 1.5\n").unwrap_err();
        assert!(
            err.to_string().contains("compaction.trigger_ratio"),
            "{err}"
        );
        let err = Config::from_toml("[store]\nmax_sessions_per_tenant = 0\n").unwrap_err();
        assert!(
            err.to_string().contains("store.max_sessions_per_tenant"),
            "{err}"
        );
        // Above `max_sessions` is the whole store, not an error.
        Config::from_toml("[store]\nmax_sessions = 10\n").expect("valid");
        for (toml, key) in [
            ("strategy = \"squash\"", "strategy"),
            ("mask_block = 0", "compaction.mask_block"),
            ("keep_recent_outputs = 0", "compaction.keep_recent_outputs"),
            (
                "observation_pattern = \"(unclosed\"",
                "compaction.observation_pattern",
            ),
        ] {
            let err = Config::from_toml(&format!("[compaction]\n{toml}\n")).unwrap_err();
            assert!(err.to_string().contains(key), "{toml}: {err}");
        }
        let c = Config::from_toml("[compaction]\nstrategy = \"hybrid\"\nmask_block = 3\n")
            .expect("valid");
        assert_eq!(c.compaction.strategy, Strategy::Hybrid);
        assert_eq!(
            (c.compaction.keep_recent_outputs, c.compaction.mask_block),
            (DEFAULT_KEEP_RECENT_OUTPUTS, 3)
        );
        assert_eq!(
            Config::default().compaction.strategy,
            DEFAULT_STRATEGY,
            "the README's default"
        );
    }

    #[test]
    fn durations_are_typed_when_read_and_unusable_ones_name_their_key() {
        let c = Config::from_toml("[store]\nttl_secs = 0.25\n[summarizer]\ntimeout_secs = 2\n")
            .expect("valid");
        assert_eq!(c.store_ttl(), Duration::from_millis(250));
        assert_eq!(c.summarizer_timeout(), Duration::from_secs(2));
        assert_eq!(c.breaker_cooldown(), Duration::from_secs(300));
        for (key, value) in [
            ("store.ttl_secs", "0"),
            ("store.ttl_secs", "-1"),
            ("store.ttl_secs", "nan"),
            ("store.ttl_secs", "inf"),
            ("store.ttl_secs", "1e30"),
            ("store.ttl_secs", "1e-12"),
            ("server.shutdown_grace_secs", "0"),
            ("upstream.connect_timeout_secs", "-0.5"),
            ("upstream.response_timeout_secs", "1e300"),
            ("upstream.pool_idle_timeout_secs", "0.0"),
            ("summarizer.timeout_secs", "0"),
            ("compaction.breaker_cooldown_secs", "-inf"),
        ] {
            let (section, field) = key.split_once('.').expect("dotted");
            let err =
                Config::from_toml(&format!("[{section}]\n{field} = {value}\n")).expect_err(value);
            assert!(
                matches!(&err, ConfigError::Invalid { key: k, .. } if k == key),
                "{key} = {value}: {err}"
            );
            assert!(
                err.to_string().starts_with(&format!("invalid `{key}`: ")),
                "{err}"
            );
        }
        // Not a number at all is still figment's own message, naming the key.
        let err = Config::from_toml("[store]\nttl_secs = \"soon\"\n").unwrap_err();
        assert!(err.to_string().contains("ttl_secs"), "{err}");
    }

    #[test]
    fn a_blank_admin_token_is_refused_not_taken_for_auth() {
        for token in ["\"\"", "\"   \""] {
            let err = Config::from_toml(&format!("[admin]\ntoken = {token}\n")).expect_err(token);
            assert!(
                matches!(&err, ConfigError::Invalid { key, .. } if key == "admin.token"),
                "{err}"
            );
        }
        let c = Config::from_toml("[admin]\ntoken = \"s3cret\"\n").expect("a real token");
        assert_eq!(c.admin.token.as_deref(), Some("s3cret"));
    }

    #[test]
    fn prices_must_be_finite_and_not_negative_and_name_no_other_key() {
        for (price, key) in [
            ("{ input = -1.0, output = 1.0 }", "input"),
            ("{ input = 1.0, output = nan }", "output"),
            (
                "{ input = 1.0, output = 1.0, cache_read = inf }",
                "cache_read",
            ),
            (
                "{ input = 1.0, output = 1.0, cache_write = -0.5 }",
                "cache_write",
            ),
        ] {
            let err = Config::from_toml(&format!(
                "[models.\"m\"]\ncontext_window = 1000\nprice = {price}\n"
            ))
            .expect_err(price);
            let want = format!("models.\"m\".price.{key}");
            assert!(
                matches!(&err, ConfigError::Invalid { key: k, .. } if *k == want),
                "{price}: {err}"
            );
        }
        assert!(Config::from_toml(
            "[models.\"m\"]\ncontext_window = 1000\nprice = { input = 1.0, output = 1.0, cached = 0.1 }\n"
        )
        .is_err());
        let free = Config::from_toml(
            "[models.\"m\"]\ncontext_window = 1000\nprice = { input = 0.0, output = 0.0 }\n",
        )
        .expect("a free model is a price");
        assert!(free.models["m"].price.is_some());
    }

    #[test]
    fn durations_print_as_the_seconds_they_were_written_as() {
        let c = Config::from_toml("[upstream]\nconnect_timeout_secs = 3.5\n").expect("valid");
        let printed = c.to_toml();
        assert!(printed.contains("connect_timeout_secs = 3.5"), "{printed}");
        assert!(printed.contains("ttl_secs = 86400.0"), "{printed}");
        assert_eq!(Config::from_toml(&printed).expect("reloads"), c);
    }

    #[test]
    fn a_routes_compaction_settings_override_the_sections_and_nothing_else() {
        let c = Config::from_toml(
            "[compaction]\nmax_messages = 40\nstrategy = \"hybrid\"\n\
             [[routes]]\nprefix = \"/a\"\nbase_url = \"http://a:1\"\n\
             compaction = { strategy = \"mask\", sample_ratio = 0.5, enabled = false }\n\
             [[routes]]\nprefix = \"/b\"\nbase_url = \"http://b:1\"\n",
        )
        .expect("config");
        let a = c.for_route(0).compaction;
        assert_eq!(a.strategy, Strategy::Mask);
        assert_eq!(a.sample_ratio, 0.5);
        assert!(!a.enabled);
        assert_eq!(a.max_messages, 40, "inherited");
        assert!(c.routes[1].compaction.is_empty());
        assert_eq!(c.for_route(1).compaction, c.compaction);
        assert!(c.for_route(0).routes.is_empty());
        // Only the settings that make sense per route exist there.
        let err = Config::from_toml(
            "[[routes]]\nprefix = \"/a\"\nbase_url = \"http://a:1\"\n\
             compaction = { calibration = false }\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("calibration"), "{err}");
        let err = Config::from_toml(
            "[[routes]]\nprefix = \"/a\"\nbase_url = \"http://a:1\"\n\
             compaction = { min_preserve_tokens = 9000, max_preserve_tokens = 10 }\n",
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("routes[0].compaction.min_preserve_tokens"),
            "{err}"
        );
    }

    #[test]
    fn routes_default_to_stripping_their_prefix_and_user_models_override() {
        let c = Config::from_toml(
            "[[routes]]\nprefix = \"/anthropic\"\nbase_url = \"https://api.anthropic.com\"\n\
             [models.\"gpt-4o*\"]\ncontext_window = 1000\n",
        )
        .expect("valid");
        assert!(c.routes[0].strip_prefix);
        assert_eq!(c.models["gpt-4o*"].context_window, 1000);
    }

    #[test]
    fn a_redis_store_needs_a_redis_url_and_a_usable_prefix() {
        for (toml, key) in [
            (
                "[store]\nbackend = \"redis\"\nredis_url = \"http://db:6379\"\n",
                "store.redis_url",
            ),
            (
                "[store]\nbackend = \"redis\"\nredis_url = \"redis://:pw@\"\n",
                "store.redis_url",
            ),
            ("[store]\nkey_prefix = \"\"\n", "store.key_prefix"),
            ("[store]\nkey_prefix = \"a{b}\"\n", "store.key_prefix"),
            ("[store]\nbackend = \"postgres\"\n", "store.backend"),
        ] {
            let err = Config::from_toml(toml).expect_err(toml).to_string();
            assert!(err.contains(key), "{toml}: {err}");
            assert!(
                !err.contains("pw"),
                "the URL's password is never repeated: {err}"
            );
        }
        let c =
            Config::from_toml("[store]\nbackend = \"redis\"\nredis_url = \"rediss://db:6380/1\"\n")
                .expect("valid");
        assert_eq!(c.store.backend, StoreBackend::Redis);
    }

    #[test]
    fn redaction_hides_secrets() {
        let c = Config::from_toml(
            "[admin]\ntoken = \"hunter2\"\n[summarizer.exec]\ncommand = \"x\"\nenv = { KEY = \"sk-1\" }\n\
             [store]\nbackend = \"redis\"\nredis_url = \"redis://:pw-redis@db:6379/2\"\n",
        )
        .expect("valid");
        let shown = c.redacted().to_toml();
        assert!(
            !shown.contains("hunter2") && !shown.contains("sk-1") && !shown.contains("pw-redis"),
            "{shown}"
        );
        assert!(shown.contains(REDACTED));
    }
}

#[cfg(test)]
mod reread {
    use super::*;

    fn reread(text: &str) -> Result<Reread, ConfigError> {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("compactor.toml");
        std::fs::write(&path, text).expect("write");
        Config::reread(Some(&path))
    }

    #[test]
    fn a_file_that_sets_nothing_is_refused() {
        for text in [
            "",
            "  \n\t\n",
            "# compactor\n\n# [upstream]\n# base_url = \"http://x\"\n",
            "[server]\n[admin]\n# token = \"t\"\n",
            "[summarizer.openai]\n",
        ] {
            let err = reread(text).expect_err(text);
            assert!(matches!(err, ConfigError::Blank(_)), "{text:?}: {err}");
            assert!(err.to_string().contains("sets nothing"), "{err}");
        }
        // At start-up an empty file is the defaults.
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("empty.toml");
        std::fs::write(&path, "").expect("write");
        assert_eq!(
            Config::load(Some(&path)).expect("defaults"),
            Config::from_toml("").expect("defaults")
        );
    }

    #[test]
    fn a_file_cut_off_mid_value_is_refused() {
        let full =
            "[admin]\ntoken = \"secret-token\"\n[upstream]\nbase_url = \"http://127.0.0.1:9\"\n";
        for cut in [full.len() - 5, full.len() - 40, 12, 25] {
            let err = reread(&full[..cut]).expect_err(&full[..cut]);
            assert!(matches!(err, ConfigError::Syntax { .. }), "{err}");
            assert!(!err.to_string().contains("secret-t"), "{err}");
        }
        let err = reread(&full[..25]).expect_err("cut in the token");
        assert!(
            matches!(err, ConfigError::Syntax { line: 2, .. }),
            "{err:?}"
        );
    }

    #[test]
    fn the_reread_file_is_loaded_and_says_whether_it_names_the_upstream() {
        let r = reread("[compaction]\nmax_messages = 9\n").expect("valid");
        assert_eq!(r.config.compaction.max_messages, 9);
        assert!(!r.upstream_written);
        let r = reread("[upstream]\nbase_url = \"https://api.openai.com\"\n").expect("valid");
        assert!(r.upstream_written, "named, even as the default");
        let err = reread("[compaction]\nbogus = 1\n").expect_err("unknown key");
        assert!(err.to_string().contains("bogus"), "{err}");
    }
}

#[cfg(test)]
mod documented_defaults {
    use super::*;

    /// The shipped `config/compactor.toml` documents the defaults: loading it must change
    /// nothing, so a default edited in code but not in the file (or vice versa) fails here.
    #[test]
    fn shipped_config_file_equals_the_built_in_defaults() {
        let shipped = Config::from_toml(include_str!("../config/compactor.toml")).expect("valid");
        assert_eq!(shipped, Config::from_toml("").expect("defaults"));
    }
}
