//! Offline replay of recorded conversations through the real compactor (`compactor replay`):
//! how a user tunes `max_messages`, `trigger_ratio` and the preserve sizes before deploying.
//!
//! [`load()`] reads a recording. A JSON transcript (a `messages` array in Chat Completions or
//! Anthropic Messages shape, an `input` array for Responses, or a bare array of messages) is
//! cut into the requests an agent sends while producing it: the request before each assistant
//! turn carries every message before that turn, and a last request carries the whole history
//! when it does not end with an assistant turn ([`step_ends`]). Every other top-level field of
//! the file travels with each request; `model` defaults per dialect when absent. A JSONL file
//! (`.jsonl`/`.ndjson`, or any file whose lines are JSON objects) holds complete requests, one
//! per line, replayed as recorded. [`detect`] tells the dialect of a body from its shape alone.
//!
//! A [`Replayer`] feeds every request of a recording, in order, to a fresh [`Pipeline`] built
//! from the configuration as the proxy builds it (models table, thresholds, session memory and
//! checkpoints), with the `extractive` summarizer unless told otherwise, wrapped in a
//! [`CountingSummarizer`]. Each step yields a [`StepRow`]: messages, estimated tokens received
//! and forwarded, compactions and summarizer calls so far, old tool outputs masked, and
//! whether the forwarded prefix is the previous request's ([`prefix_stable`]: what a
//! provider's prompt cache needs). [`FileReport::render`] prints the table and a summary line;
//! [`svg::render`] draws the chart; [`comparison`] sets the totals of one recording replayed
//! with several `compaction.strategy` values side by side. Dialects the engine does not compact
//! pass through unchanged, as in the proxy.

mod load;
pub mod own;
pub mod probes;
pub mod svg;

pub use load::{detect, load, step_ends, Format, Recording, Step};
pub use probes::{Category, ProbeScore, Tally};

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use compactor_plugin_api::{
    BoxFuture, Caller, SummarizeError, Summarizer, Summary, SummaryRequest,
};

use crate::compaction::{Attempts, CompactionOutcome, Limits, Trigger};
use crate::config::{Config, ConfigError, Price, Strategy};
use crate::cost::cached_prefix;
use crate::dialect::DialectKind;
use crate::estimate::LazyEstimator;
use crate::metrics::Metrics;
use crate::pipeline::{Outcome, Pipeline, RequestContext};
use crate::summarizer::{self, BuildError};

/// The summarizer backend used unless `--summarizer` names another: local, deterministic and
/// free.
pub const DEFAULT_SUMMARIZER: &str = "extractive";

/// The model of a Chat Completions or Responses transcript that names none.
pub const DEFAULT_OPENAI_MODEL: &str = "gpt-4o";

/// The model of an Anthropic Messages transcript that names none.
pub const DEFAULT_ANTHROPIC_MODEL: &str = "claude-sonnet-4-5";

/// The model a Gemini transcript without one is replayed as (its requests name none: the
/// model is in a Gemini request's path).
pub const DEFAULT_GEMINI_MODEL: &str = "gemini-2.5-pro";

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The recording could not be read.
    #[error("cannot read {}: {error}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What the system said.
        error: std::io::Error,
    },
    /// The recording is not JSON.
    #[error("{}: not JSON: {error}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        error: serde_json::Error,
    },
    /// One line of a JSONL recording is not JSON.
    #[error("{} line {line}: not JSON: {error}", path.display())]
    JsonLine {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The parser's message.
        error: serde_json::Error,
    },
    /// The recording is JSON but not a conversation compactor knows.
    #[error("{}: {reason}", path.display())]
    Shape {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The summarizer backend cannot be built.
    #[error(transparent)]
    Summarizer(#[from] BuildError),
    /// The metrics registry could not be built.
    #[error("building the metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// A summarizer that counts the calls made to the one it wraps, and what each would cost an
/// LLM backend: its standalone prompt, and for a call offered inside the conversation
/// ([`SummaryRequest::in_conversation`]) that request, split into what the provider's prompt
/// cache would serve after the request it last received ([`CountingSummarizer::provider_saw`])
/// and what it would not.
pub struct CountingSummarizer {
    inner: Arc<dyn Summarizer>,
    calls: AtomicUsize,
    tokens: Mutex<SummarizerTokens>,
    /// The request the provider received last (its prompt cache).
    last_forwarded: Mutex<Option<bytes::Bytes>>,
}

/// Estimated tokens of a replay's summarizer calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SummarizerTokens {
    /// Every call's standalone prompt (all new input).
    pub prompt: usize,
    /// Of those, the prompts of the calls that could be asked inside the conversation.
    pub prompt_offered_inside: usize,
    /// Those calls asked inside the conversation: what the prompt cache would not serve.
    pub inside_new: usize,
    /// ... and what it would serve.
    pub inside_cached: usize,
    /// The summaries (output).
    pub summary: usize,
}

impl SummarizerTokens {
    /// What the calls cost at `price`, in USD: asked inside the conversation where they could
    /// be (`inside`: as `auto` and the LLM backends calling the caller's own model do), else
    /// with the standalone prompt. New input is written to the cache on Anthropic Messages
    /// (`anthropic`), as for the requests.
    pub fn usd(&self, price: &Price, inside: bool, anthropic: bool) -> f64 {
        let new = if anthropic {
            price.cache_write()
        } else {
            price.input
        };
        let input = if inside {
            (self.prompt - self.prompt_offered_inside) as f64 * price.input
                + self.inside_new as f64 * new
                + self.inside_cached as f64 * price.cache_read()
        } else {
            self.prompt as f64 * price.input
        };
        (input + self.summary as f64 * price.output) / 1e6
    }
}

impl CountingSummarizer {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Summarizer>) -> Self {
        CountingSummarizer {
            inner,
            calls: AtomicUsize::new(0),
            tokens: Mutex::default(),
            last_forwarded: Mutex::default(),
        }
    }

    /// Calls so far (successful or not).
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }

    /// Estimated tokens of the calls so far.
    pub fn tokens(&self) -> SummarizerTokens {
        *lock(&self.tokens)
    }

    /// Tells the summarizer which request the provider received last (`None`: none yet).
    pub fn provider_saw(&self, body: Option<bytes::Bytes>) {
        *lock(&self.last_forwarded) = body;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Summarizer for CountingSummarizer {
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// The replay prices the summaries as `auto` would ask them
    /// ([`FileReport::summarizer_cost_as_llm`]), so it is given the request inside the
    /// conversation whatever backend writes them.
    fn reads_conversation(&self, _api: compactor_plugin_api::Api) -> bool {
        true
    }

    fn summarize<'a>(
        &'a self,
        request: &'a SummaryRequest,
    ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let estimator = LazyEstimator::default();
        let prompt = estimator.text(&request.prompt);
        let inside = request.in_conversation.as_deref().and_then(|body| {
            let dialect = DialectKind::of_api(request.caller.api);
            let seen = lock(&self.last_forwarded).clone();
            cached_inside(dialect, seen.as_deref(), body, &estimator)
        });
        {
            let mut t = lock(&self.tokens);
            t.prompt += prompt;
            if let Some((all, cached)) = inside {
                t.prompt_offered_inside += prompt;
                t.inside_new += all - cached;
                t.inside_cached += cached;
            }
        }
        Box::pin(async move {
            let summary = self.inner.summarize(request).await?;
            lock(&self.tokens).summary += estimator.text(&summary.text);
            Ok(summary)
        })
    }
}

/// A summary request asked inside the conversation (`now`): its estimated tokens, and of them
/// what the provider's prompt cache would serve after it received `before`. Providers render
/// the tools and system prompt, then the messages in order; the cache serves the part of that
/// rendering the two requests share (the same tools and system, then every message up to the
/// first that differs), in the provider's steps ([`cached_prefix`]). `None` when `now` is not
/// a request of its dialect.
fn cached_inside(
    dialect: DialectKind,
    before: Option<&[u8]>,
    now: &[u8],
    estimator: &LazyEstimator,
) -> Option<(usize, usize)> {
    let asked = dialect.scan(now, estimator).ok()?;
    let Some(seen) = before.and_then(|b| dialect.scan(b, estimator).ok()) else {
        return Some((asked.tokens, 0));
    };
    if seen.fixed_tokens != asked.fixed_tokens {
        return Some((asked.tokens, 0));
    }
    let shared = seen
        .messages
        .iter()
        .zip(&asked.messages)
        .take_while(|(a, b)| a == b)
        .count();
    let cached = asked.fixed_tokens + asked.tokens_of(0..shared);
    Some((asked.tokens, cached_prefix(cached).min(asked.tokens)))
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Forwarded as received: no trigger, no stored summary.
    Unchanged,
    /// A body the engine does not read (a dialect it does not compact): passed through.
    PassedThrough,
    /// A new compaction; the forwarded request carries its summary.
    Compacted {
        /// 1-based compaction number within the conversation.
        num: u32,
        /// Which trigger fired.
        trigger: Trigger,
        /// Messages forwarded.
        forwarded_messages: usize,
    },
    /// A stored summary spliced in, no summarizer call.
    Reused {
        /// The number of the compaction whose summary was spliced in.
        num: u32,
        /// Messages forwarded.
        forwarded_messages: usize,
    },
    /// A compaction was due but did not happen; forwarded unchanged.
    Failed,
    /// No summary; old tool outputs masked.
    Masked,
}

impl StepRow {
    /// The outcome column.
    pub fn describe(&self) -> String {
        let missed = match self.missed {
            None => "",
            Some(Missed::Failed) => " (new compaction failed)",
            Some(Missed::Breaker) => " (compaction due, breaker open)",
        };
        let background = if self.background {
            ", summary made in the background"
        } else {
            ""
        };
        let masked = match self.masked {
            0 => String::new(),
            n => format!(", {n} outputs masked"),
        };
        let described = match &self.event {
            Event::Unchanged => format!("unchanged{missed}{background}"),
            Event::Masked => format!("outputs masked{missed}{background}"),
            Event::PassedThrough => "passed through (dialect not compacted)".into(),
            Event::Compacted {
                num,
                trigger,
                forwarded_messages,
            } => format!(
                "compacted #{num} ({}), {forwarded_messages} messages forwarded",
                trigger.label()
            ),
            Event::Reused {
                num,
                forwarded_messages,
            } => format!(
                "summary #{num} reused{missed}, {forwarded_messages} messages forwarded{background}"
            ),
            Event::Failed => "compaction failed, forwarded unchanged".into(),
        };
        match &self.event {
            Event::Masked => format!("{} {described}", self.masked),
            _ => format!("{described}{masked}"),
        }
    }
}

/// A compaction that was due at a step but did not happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missed {
    /// It ran and failed: summarizer error or timeout, blank summary, a rewrite that would not
    /// be smaller, or nothing that could be compacted (not every cause calls the summarizer).
    Failed,
    /// The session's breaker was open after repeated failures (no summarizer call).
    Breaker,
}

/// One row of the replay table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRow {
    /// 1-based step number.
    pub step: usize,
    /// Messages (or input items) in the request as received.
    pub messages: usize,
    /// Estimated input tokens received.
    pub received: usize,
    /// Estimated input tokens forwarded.
    pub forwarded: usize,
    /// Compactions so far, this step included.
    pub compactions: usize,
    /// Summarizer calls so far, this step included.
    pub summarizer_calls: usize,
    /// What happened.
    pub event: Event,
    /// A compaction that was due but did not happen, if any.
    pub missed: Option<Missed>,
    /// Whether this step started a summary made in the background (awaited before the next
    /// step, as an agent's think time would).
    pub background: bool,
    /// Tool outputs masked in the forwarded request.
    pub masked: usize,
    /// Whether the forwarded request starts with the previous step's forwarded request less
    /// its last message ([`prefix_stable`]); `None` for the first step.
    pub prefix_stable: Option<bool>,
    /// Of `forwarded`, the tokens a provider's prompt cache would serve ([`cached_tokens`]).
    pub cached: usize,
    /// Of `received`, the tokens the prompt cache would serve without compactor.
    pub received_cached: usize,
}

/// The replay of one recording.
#[derive(Debug, Clone)]
pub struct FileReport {
    /// The file, as given.
    pub name: String,
    /// Transcript or requests.
    pub format: Format,
    /// The dialect label (`mixed` when requests differ).
    pub dialect: String,
    /// The model of the last request.
    pub model: Option<String>,
    /// The summarizer backend.
    pub summarizer: String,
    /// The limits of the last request (its model and reserved output).
    pub limits: Limits,
    /// The `compaction.strategy` it ran with.
    pub strategy: Strategy,
    /// The price of the last request's model, when the models table names one.
    pub price: Option<Price>,
    /// Estimated tokens of the summarizer's calls.
    pub summarizer_tokens: SummarizerTokens,
    /// Whether the summarizer backend asks inside the conversation where it can (`auto`, and
    /// `openai`/`anthropic` calling the caller's own upstream and model).
    pub summarizer_inside: bool,
    /// What the summarizer's calls are priced at: `None` for a local backend (`extractive`,
    /// `exec`), `Some(None)` for a model with no price.
    pub summarizer_price: Option<Option<Price>>,
    /// One row per request.
    pub rows: Vec<StepRow>,
    /// What the compactions kept of what they touched, per category ([`probes`]).
    pub probes: ProbeScore,
}

/// The table's column headers, in order.
pub const COLUMNS: [&str; 7] = [
    "step",
    "messages",
    "tokens_received",
    "tokens_forwarded",
    "compactions",
    "summarizer_calls",
    "outcome",
];

impl FileReport {
    /// Compactions over the whole replay.
    pub fn compactions(&self) -> usize {
        self.rows.last().map_or(0, |r| r.compactions)
    }

    /// Summarizer calls over the whole replay.
    pub fn summarizer_calls(&self) -> usize {
        self.rows.last().map_or(0, |r| r.summarizer_calls)
    }

    /// Steps where a due compaction ran and failed.
    pub fn failed_compactions(&self) -> usize {
        self.rows
            .iter()
            .filter(|r| r.missed == Some(Missed::Failed))
            .count()
    }

    /// Estimated tokens forwarded over the whole replay.
    pub fn tokens_forwarded(&self) -> usize {
        self.rows
            .iter()
            .fold(0usize, |acc, r| acc.saturating_add(r.forwarded))
    }

    /// Steps whose forwarded prefix was the previous step's, and steps that had a previous
    /// step.
    pub fn prefix_stable(&self) -> (usize, usize) {
        let compared = self.rows.iter().filter_map(|r| r.prefix_stable);
        compared.fold((0, 0), |(stable, all), s| {
            (stable + usize::from(s), all + 1)
        })
    }

    /// What the requests' input would cost at `price` with the prompt cache modelled
    /// ([`StepRow::cached`]), in USD: `(with compactor, without)`. The part not read from the
    /// cache is priced as input, or, for Anthropic Messages, as a cache write: Claude Code
    /// marks its latest message as a cache breakpoint, so what is new is written.
    pub fn input_cost(&self, price: &Price) -> (f64, f64) {
        let uncached = if self.dialect == DialectKind::Messages.label() {
            price.cache_write()
        } else {
            price.input
        };
        let cost = |tokens: usize, cached: usize| {
            (tokens.saturating_sub(cached) as f64 * uncached + cached as f64 * price.cache_read())
                / 1_000_000.0
        };
        self.rows.iter().fold((0.0, 0.0), |(with, without), r| {
            (
                with + cost(r.forwarded, r.cached),
                without + cost(r.received, r.received_cached),
            )
        })
    }

    /// What the summarizer's calls cost in USD: `Some(0.0)` for a local backend, `None` when
    /// its model has no price.
    pub fn summarizer_cost(&self) -> Option<f64> {
        match self.summarizer_price {
            None => Some(0.0),
            Some(None) => None,
            Some(Some(p)) => Some(self.summarizer_tokens.usd(
                &p,
                self.summarizer_inside,
                self.dialect == DialectKind::Messages.label(),
            )),
        }
    }

    /// What the summarizer's calls would cost made by the conversation's model at `price`,
    /// as `auto` makes them (inside the conversation where they can be, read from the prompt
    /// cache): for comparing a local backend with an agent that summarises with its own
    /// model. A priced LLM backend's own cost otherwise.
    pub fn summarizer_cost_as_llm(&self, price: &Price) -> f64 {
        match self.summarizer_cost() {
            Some(usd) if self.summarizer_price.is_some() => usd,
            _ => self.summarizer_tokens.usd(
                price,
                true,
                self.dialect == DialectKind::Messages.label(),
            ),
        }
    }

    /// The same session compacted by the agent itself ([`own`]).
    pub fn own_compaction(&self, price: &Price) -> own::OwnCompaction {
        let received: Vec<usize> = self.rows.iter().map(|r| r.received).collect();
        own::own_compaction(
            &received,
            self.limits.usable_window(),
            price,
            self.dialect == DialectKind::Messages.label(),
        )
    }

    /// Of the forwarded tokens, the share the prompt cache would serve.
    pub fn cached_share(&self) -> f64 {
        let (cached, all) = self
            .rows
            .iter()
            .fold((0, 0), |(c, a), r| (c + r.cached, a + r.forwarded));
        if all == 0 {
            0.0
        } else {
            cached as f64 / all as f64
        }
    }

    /// The first step whose request, as received, is over the model's window less the
    /// reserved output: where the conversation would have been refused without compaction.
    pub fn over_window_at(&self) -> Option<usize> {
        let usable = self.limits.usable_window();
        self.rows
            .iter()
            .find(|r| r.received > usable)
            .map(|r| r.step)
    }

    /// The largest request received, in estimated tokens.
    pub fn peak_received(&self) -> usize {
        self.rows.iter().map(|r| r.received).max().unwrap_or(0)
    }

    /// The largest request forwarded, in estimated tokens.
    pub fn peak_forwarded(&self) -> usize {
        self.rows.iter().map(|r| r.forwarded).max().unwrap_or(0)
    }

    /// `== <file> (<dialect> <format>, model ..., N steps, summarizer ...)`.
    pub fn heading(&self) -> String {
        format!(
            "== {} ({} {}, model {}, {} steps, summarizer {})",
            self.name,
            self.dialect,
            self.format.label(),
            self.model.as_deref().unwrap_or("(none)"),
            self.rows.len(),
            self.summarizer
        )
    }

    /// The per-step table: a header line and one line per step, columns as [`COLUMNS`]
    /// (numbers right-aligned, the outcome last), separated by two spaces.
    pub fn table(&self) -> String {
        let cells: Vec<[String; 7]> = self
            .rows
            .iter()
            .map(|r| {
                [
                    r.step.to_string(),
                    r.messages.to_string(),
                    r.received.to_string(),
                    r.forwarded.to_string(),
                    r.compactions.to_string(),
                    r.summarizer_calls.to_string(),
                    r.describe(),
                ]
            })
            .collect();
        let mut widths = COLUMNS.map(str::len);
        for row in &cells {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.len());
            }
        }
        let mut out = String::new();
        let mut line = |cells: [&str; 7]| {
            let numbers: Vec<String> = cells[..6]
                .iter()
                .zip(widths)
                .map(|(c, w)| format!("{c:>w$}"))
                .collect();
            let _ = writeln!(out, "{}  {}", numbers.join("  "), cells[6]);
        };
        line(COLUMNS);
        for row in &cells {
            line(row.each_ref().map(String::as_str));
        }
        out
    }

    /// `summary: ...`: totals, peaks and the thresholds the replay ran against.
    pub fn summary(&self) -> String {
        let (stable, compared) = self.prefix_stable();
        format!(
            "summary: {} steps, {} compactions, {} summarizer calls, {} failed compactions, peak \
             tokens received {} vs forwarded {}, token threshold {} for {} (context window {}, \
             {} reserved for output), max_messages {}, strategy {}, {} tokens forwarded in all, \
             prefix stable on {stable} of {compared} requests",
            self.rows.len(),
            self.compactions(),
            self.summarizer_calls(),
            self.failed_compactions(),
            self.peak_received(),
            self.peak_forwarded(),
            self.limits.token_threshold,
            self.model.as_deref().unwrap_or("(no model)"),
            self.limits.context_window,
            self.limits.reserved_output,
            self.limits.max_messages,
            self.strategy.label(),
            self.tokens_forwarded(),
        )
    }

    /// Heading, table and summary line.
    pub fn render(&self) -> String {
        format!("{}\n{}{}\n", self.heading(), self.table(), self.summary())
    }
}

/// Replays recordings through a compactor built from one configuration.
pub struct Replayer {
    config: Config,
}

impl Replayer {
    /// `config` with its summarizer replaced by `summarizer` (default [`DEFAULT_SUMMARIZER`])
    /// and no fallback, so the replay measures that one backend; fails now on an unknown or
    /// misconfigured backend.
    pub fn new(mut config: Config, summarizer: Option<&str>) -> Result<Replayer, ReplayError> {
        config.summarizer.backend = summarizer.unwrap_or(DEFAULT_SUMMARIZER).to_string();
        config.summarizer.fallback.clear();
        config.validate()?;
        summarizer::build(&config, Arc::new(Metrics::new()?))?;
        Ok(Replayer { config })
    }

    /// The same replayer with `compaction.strategy` set to `strategy`.
    pub fn with_strategy(mut self, strategy: Strategy) -> Replayer {
        self.config.compaction.strategy = strategy;
        self
    }

    /// The configuration replays run with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Replays one recording, in order, through a fresh compactor (its own session memory).
    pub async fn run(&self, recording: &Recording) -> Result<FileReport, ReplayError> {
        let metrics = Arc::new(Metrics::new()?);
        let counting = Arc::new(CountingSummarizer::new(summarizer::build(
            &self.config,
            metrics.clone(),
        )?));
        // Each background summary is awaited before the next request (below): summaries are
        // instant here, and nothing needs to start earlier.
        let compactor = Arc::new(
            Pipeline::new(&self.config, counting.clone(), metrics.clone()).without_pacing(),
        );
        let estimator = compactor.engine().estimator();
        let mut rows = Vec::with_capacity(recording.steps.len());
        let mut compactions = 0;
        let mut last = (None, None);
        let mut previous: Option<(DialectKind, bytes::Bytes)> = None;
        let mut previous_received: Option<&bytes::Bytes> = None;
        let mut prober =
            probes::Prober::new(self.config.compaction.observation_regex().ok().flatten());
        let mut probe_score = ProbeScore::default();
        for (i, step) in recording.steps.iter().enumerate() {
            let scan = step.dialect.scan(&step.body, estimator).ok();
            let understood = scan.is_some();
            let received = match &scan {
                Some(s) => s.tokens,
                // Not readable by its dialect: the raw body's estimate.
                None => estimator.text(&String::from_utf8_lossy(&step.body)),
            };
            last = match scan {
                Some(s) => (s.model.or_else(|| step.model.clone()), s.requested_output),
                None => (step.model.clone(), step.requested_output),
            };
            // No credentials: a summarizer calling the provider needs its `api_key_env`.
            let caller = Arc::new(Caller {
                upstream_base_url: self.config.upstream.base_url.clone(),
                api_prefix: match (step.dialect, &step.model) {
                    (DialectKind::Gemini, Some(model)) => format!("/v1beta/models/{model}"),
                    _ => "/v1".into(),
                },
                credentials: Vec::new(),
                api: step.dialect.api(),
            });
            let context = RequestContext {
                caller: &caller,
                session_header: None,
                long_context: false,
                attempts: &Attempts::per_request(),
                mode: None,
            };
            let before = automatic_counts(&metrics);
            let masked_before = masked_counted(&metrics);
            counting.provider_saw(previous.as_ref().map(|(_, body)| body.clone()));
            let processed = compactor.handle(step.dialect, &step.body, &context).await;
            // An agent thinks longer than a summary takes: a background summary started by
            // this request is done before the next one (and the replay is deterministic).
            compactor.background_idle().await;
            let after = automatic_counts(&metrics);
            let made = usize::try_from(after.2.saturating_sub(before.2)).unwrap_or(usize::MAX);
            compactions += made;
            let missed = if after.0 > before.0 {
                Some(Missed::Failed)
            } else if after.1 > before.1 {
                Some(Missed::Breaker)
            } else {
                None
            };
            let forwarded = processed.estimate.as_ref().map_or(received, |e| e.tokens);
            let body = match &processed.outcome {
                Outcome::Rewritten { body, .. }
                | Outcome::Reused { body, .. }
                | Outcome::Masked { body, .. } => body.clone(),
                Outcome::Unchanged | Outcome::Failed => step.body.clone(),
            };
            let prefix = previous.as_ref().map(|(dialect, before)| {
                *dialect == step.dialect && prefix_stable(step.dialect, before, &body)
            });
            let masked_now = masked_counted(&metrics).saturating_sub(masked_before);
            let cached =
                cached_tokens(previous.as_ref().map(|(_, b)| b.as_ref()), &body, forwarded);
            let received_cached =
                cached_tokens(previous_received.map(|b| b.as_ref()), &step.body, received);
            previous_received = Some(&step.body);
            probe_score.add(&prober.score(step.dialect, &step.body, &body));
            let event = match &processed.outcome {
                Outcome::Unchanged if !understood => Event::PassedThrough,
                Outcome::Unchanged => Event::Unchanged,
                Outcome::Failed => Event::Failed,
                Outcome::Rewritten {
                    body,
                    result,
                    trigger,
                } => Event::Compacted {
                    num: result.compaction_num,
                    trigger: *trigger,
                    forwarded_messages: messages_in(step.dialect, body),
                },
                Outcome::Reused { body, result } => Event::Reused {
                    num: result.compaction_num,
                    forwarded_messages: messages_in(step.dialect, body),
                },
                Outcome::Masked { .. } => Event::Masked,
            };
            previous = Some((step.dialect, body));
            rows.push(StepRow {
                step: i + 1,
                messages: step.messages,
                received,
                forwarded,
                compactions,
                summarizer_calls: counting.calls(),
                background: made > usize::from(matches!(event, Event::Compacted { .. })),
                event,
                missed,
                masked: usize::try_from(masked_now).unwrap_or(usize::MAX),
                prefix_stable: prefix,
                cached,
                received_cached,
            });
        }
        let (model, requested_output) = last;
        let limits = compactor
            .engine()
            .limits(model.as_deref(), requested_output);
        let price = model
            .as_deref()
            .and_then(|m| compactor.engine().models().price(m));
        let s = &self.config.summarizer;
        let summarizer_model = match s.backend.as_str() {
            "openai" => s.openai.model.clone().or_else(|| model.clone()),
            "anthropic" => s.anthropic.model.clone().or_else(|| model.clone()),
            "auto" => model.clone(),
            _ => None,
        };
        let summarizer_inside = match s.backend.as_str() {
            "openai" => s.openai.model.is_none() && s.openai.base_url.is_none(),
            "anthropic" => s.anthropic.model.is_none() && s.anthropic.base_url.is_none(),
            other => other == "auto",
        };
        let summarizer_price = match s.backend.as_str() {
            "extractive" | "exec" => None,
            _ => Some(
                summarizer_model
                    .as_deref()
                    .and_then(|m| compactor.engine().models().price(m)),
            ),
        };
        let mut dialects = recording.steps.iter().map(|s| s.dialect.label());
        let first = dialects.next().unwrap_or("none");
        let dialect = if dialects.all(|d| d == first) {
            first
        } else {
            "mixed"
        };
        Ok(FileReport {
            name: recording.path.display().to_string(),
            format: recording.format,
            dialect: dialect.to_string(),
            model,
            summarizer: self.config.summarizer.backend.clone(),
            limits,
            strategy: self.config.compaction.strategy,
            price,
            summarizer_tokens: counting.tokens(),
            summarizer_inside,
            summarizer_price,
            rows,
            probes: probe_score,
        })
    }
}

/// Of a request of `tokens` estimated tokens whose body is `now`, the tokens a prompt cache
/// would serve after `before` was sent: the bytes the two bodies share from the start, as a
/// share of the request's tokens, as the provider caches it ([`cached_prefix`]: OpenAI's
/// automatic prefix caching). Nothing for a first request.
pub fn cached_tokens(before: Option<&[u8]>, now: &[u8], tokens: usize) -> usize {
    let Some(before) = before else {
        return 0;
    };
    let shared = before.iter().zip(now).take_while(|(a, b)| a == b).count();
    if now.is_empty() {
        return 0;
    }
    // `as` saturates; the share is at most 1.
    cached_prefix((tokens as f64 * shared as f64 / now.len() as f64) as usize)
}

/// Whether the forwarded body `now` starts with what `before` (the previous forwarded body of
/// the same conversation) carried up to the end of its next-to-last message: its top-level
/// fields before the conversation and every message but its last, byte for byte. That is the
/// prefix a provider's prompt cache can reuse; the last message is left out because an agent
/// may rewrite it (Anthropic merges a trailing user text into the next tool results). A body
/// its dialect cannot read compares whole.
pub fn prefix_stable(dialect: DialectKind, before: &[u8], now: &[u8]) -> bool {
    let estimator = LazyEstimator::default();
    let Ok(scan) = dialect.scan(before, &estimator) else {
        return now == before;
    };
    let end = match scan.len() {
        0 => return now.starts_with(before),
        1 => scan.messages[0].as_ptr() as usize - before.as_ptr() as usize,
        n => {
            let last_kept = scan.messages[n - 2];
            last_kept.as_ptr() as usize - before.as_ptr() as usize + last_kept.len()
        }
    };
    before
        .get(..end)
        .is_some_and(|prefix| now.starts_with(prefix))
}

/// `compactor_masked_outputs_total` over every dialect and strategy.
fn masked_counted(metrics: &Metrics) -> u64 {
    [
        DialectKind::ChatCompletions,
        DialectKind::Messages,
        DialectKind::Responses,
    ]
    .iter()
    .flat_map(|d| Strategy::ALL.map(|s| (*d, s)))
    .map(|(d, s)| metrics.masked_outputs_counted(d, s))
    .sum()
}

/// The totals of recordings replayed with several strategies, one line per (file, strategy):
/// summarizer calls, estimated tokens forwarded over all steps, and the share of requests whose
/// forwarded prefix was the previous request's ([`prefix_stable`]).
pub fn comparison(reports: &[FileReport]) -> String {
    let mut out = String::from("== strategies\n");
    let header = [
        "file",
        "strategy",
        "summarizer_calls",
        "tokens_forwarded",
        "outputs_masked",
        "prefix_stable",
    ];
    let rows: Vec<[String; 6]> = reports
        .iter()
        .map(|r| {
            let (stable, compared) = r.prefix_stable();
            let share = if compared == 0 {
                "-".to_string()
            } else {
                format!(
                    "{stable}/{compared} ({:.0}%)",
                    100.0 * stable as f64 / compared as f64
                )
            };
            let name = file_name(&r.name);
            [
                name,
                r.strategy.label().to_string(),
                r.summarizer_calls().to_string(),
                r.tokens_forwarded().to_string(),
                r.rows
                    .iter()
                    .map(|row| row.masked)
                    .sum::<usize>()
                    .to_string(),
                share,
            ]
        })
        .collect();
    write_table(&mut out, &header, &rows, 2);
    out
}

/// Writes `header` and `rows` to `out` in columns two spaces apart, each as wide as its widest
/// cell: the first `left` columns (names) aligned left, the rest (figures) right.
fn write_table<R: AsRef<[String]>>(out: &mut String, header: &[&str], rows: &[R], left: usize) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row.as_ref()) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let padded: Vec<String> = cells
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, &w))| {
                if i < left {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        let _ = writeln!(out, "{}", padded.join("  ").trim_end());
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.as_ref().iter().map(String::as_str));
    }
}

/// Messages in a forwarded body (0 when its dialect cannot read it).
/// `== cost`: for each report whose model has a price, what its requests' input costs with the
/// prompt cache modelled, against the same requests unchanged (no compaction), and where those
/// would first have been over the window. `None` when no report is priced.
pub fn costs(reports: &[FileReport]) -> Option<String> {
    let priced: Vec<(&FileReport, Price)> = reports
        .iter()
        .filter_map(|r| r.price.map(|p| (r, p)))
        .collect();
    let (first, price) = priced.first()?;
    let mut out = format!(
        "== cost (input side, USD; prompt cache modelled; {} at ${} input, ${} cached per million)\n",
        first.model.as_deref().unwrap_or("(none)"),
        price.input,
        price.cache_read()
    );
    let header = [
        "file",
        "strategy",
        "cached",
        "requests",
        "summarizer",
        "no_compaction",
        "ratio",
        "over_window_at",
        "summarizer_llm",
        "agent_own",
        "vs_own",
    ];
    let rows: Vec<[String; 11]> = priced
        .iter()
        .map(|(r, price)| {
            let (requests, without) = r.input_cost(price);
            let summarizer = r.summarizer_cost();
            let own = r.own_compaction(price);
            let llm = r.summarizer_cost_as_llm(price);
            let ratio = match summarizer {
                Some(s) if without > 0.0 => format!("{:.0}%", 100.0 * (requests + s) / without),
                _ => "-".into(),
            };
            [
                file_name(&r.name),
                r.strategy.label().to_string(),
                format!("{:.0}%", 100.0 * r.cached_share()),
                format!("{requests:.4}"),
                match (r.summarizer_price, summarizer) {
                    (None, _) => "local".into(),
                    (Some(_), Some(s)) => format!("{s:.4}"),
                    (Some(_), None) => "unpriced".into(),
                },
                format!("{without:.4}"),
                ratio,
                r.over_window_at()
                    .map_or("-".to_string(), |s| format!("step {s}")),
                format!("{llm:.4}"),
                if own.over_window {
                    "over_window".into()
                } else {
                    format!("{:.4}", own.usd)
                },
                if own.usd > 0.0 && !own.over_window {
                    format!("{:.0}%", 100.0 * (requests + llm) / own.usd)
                } else {
                    "-".into()
                },
            ]
        })
        .collect();
    write_table(&mut out, &header, &rows, 2);
    Some(out)
}

/// `== probes`: for each report, of the probes its compactions touched, the share still in
/// the forwarded request, per category and in all ([`probes`]: `kept/total (share)`, `-`
/// when none was touched).
pub fn probe_table(reports: &[FileReport]) -> String {
    let mut out =
        String::from("== probes (kept of what compaction touched, counted per request)\n");
    let mut header = vec!["file", "strategy", "summarizer"];
    header.extend(Category::ALL.map(Category::label));
    header.push("all");
    let rows: Vec<Vec<String>> = reports
        .iter()
        .map(|r| {
            let mut row = vec![
                file_name(&r.name),
                r.strategy.label().to_string(),
                r.summarizer.clone(),
            ];
            row.extend(Category::ALL.map(|c| r.probes.get(c).cell()));
            row.push(r.probes.all().cell());
            row
        })
        .collect();
    write_table(&mut out, &header, &rows, 3);
    out
}

/// The replay's totals as JSON (`--json OUT`): per report the file, strategy, summarizer,
/// steps, compactions, summarizer calls, tokens forwarded, `probes`, per category (and
/// `all`) the probes `kept` of the `total` its compactions touched, and, when its model has a
/// price, `cost`: the `== cost` table's figures in USD (`null` where unpriced) with the
/// summarizer's estimated tokens split as [`SummarizerTokens`] splits them.
pub fn to_json(reports: &[FileReport]) -> serde_json::Value {
    let tally = |t: Tally| serde_json::json!({"kept": t.kept, "total": t.total});
    let reports: Vec<serde_json::Value> = reports
        .iter()
        .map(|r| {
            let mut probes = serde_json::Map::new();
            for c in Category::ALL {
                probes.insert(c.label().to_string(), tally(r.probes.get(c)));
            }
            probes.insert("all".to_string(), tally(r.probes.all()));
            let cost = r.price.map(|price| {
                let (requests, without) = r.input_cost(&price);
                let own = r.own_compaction(&price);
                let t = r.summarizer_tokens;
                serde_json::json!({
                    "requests_usd": requests,
                    "summarizer_usd": r.summarizer_cost(),
                    "summarizer_as_llm_usd": r.summarizer_cost_as_llm(&price),
                    "no_compaction_usd": without,
                    "agent_own_usd": (!own.over_window).then_some(own.usd),
                    "agent_own_compactions": own.compactions,
                    "cached_share": r.cached_share(),
                    "summarizer_tokens": {
                        "prompt": t.prompt,
                        "prompt_offered_inside": t.prompt_offered_inside,
                        "inside_new": t.inside_new,
                        "inside_cached": t.inside_cached,
                        "summary": t.summary,
                    },
                })
            });
            serde_json::json!({
                "file": r.name,
                "strategy": r.strategy.label(),
                "summarizer": r.summarizer,
                "steps": r.rows.len(),
                "compactions": r.compactions(),
                "summarizer_calls": r.summarizer_calls(),
                "tokens_forwarded": r.tokens_forwarded(),
                "probes": probes,
                "cost": cost,
            })
        })
        .collect();
    serde_json::json!({ "reports": reports })
}

/// The last component of a path, for a table.
fn file_name(name: &str) -> String {
    std::path::Path::new(name)
        .file_name()
        .map_or(name.to_string(), |n| n.to_string_lossy().into_owned())
}

fn messages_in(dialect: DialectKind, body: &[u8]) -> usize {
    dialect
        .scan(body, &LazyEstimator::default())
        .map_or(0, |s| s.len())
}

/// Automatic compactions counted so far that failed (`failed`, `blank`), that the breaker
/// skipped, and that were made (on the request path or in the background).
fn automatic_counts(metrics: &Metrics) -> (u64, u64, u64) {
    let count = |outcomes: &[&str]| -> u64 {
        [Trigger::Messages, Trigger::Tokens]
            .iter()
            .flat_map(|t| outcomes.iter().map(move |o| (t.label(), *o)))
            .map(|(t, o)| metrics.compactions_counted(t, o))
            .sum()
    };
    (
        count(&[
            CompactionOutcome::Failed.label(),
            CompactionOutcome::Blank.label(),
        ]),
        count(&[CompactionOutcome::Breaker.label()]),
        count(&[CompactionOutcome::Compacted.label()]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn temp_file(name: &str, contents: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(name);
        std::fs::write(&path, contents).expect("write");
        (dir, path)
    }

    fn row(step: usize, event: Event) -> StepRow {
        StepRow {
            step,
            messages: step * 2,
            received: step * 1000,
            forwarded: step * 500,
            compactions: step / 2,
            summarizer_calls: step / 2,
            event,
            missed: None,
            background: false,
            masked: 0,
            prefix_stable: None,
            cached: 0,
            received_cached: 0,
        }
    }

    #[test]
    fn the_table_has_one_aligned_row_per_step_with_every_column() {
        let report = FileReport {
            name: "t.json".into(),
            format: Format::Transcript,
            dialect: "chat_completions".into(),
            model: Some("gpt-4o".into()),
            summarizer: "extractive".into(),
            strategy: Strategy::Summarize,
            price: None,
            summarizer_tokens: SummarizerTokens::default(),
            summarizer_inside: false,
            summarizer_price: None,
            limits: Limits {
                context_window: 128_000,
                summarizer_window: 128_000,
                reserved_output: 0,
                token_threshold: 108_800,
                wait_threshold: 108_800,
                max_messages: 10,
                opening_budget: 36_266,
            },
            rows: vec![
                row(1, Event::Unchanged),
                row(
                    2,
                    Event::Compacted {
                        num: 1,
                        trigger: Trigger::Messages,
                        forwarded_messages: 5,
                    },
                ),
                StepRow {
                    missed: Some(Missed::Failed),
                    ..row(
                        12,
                        Event::Reused {
                            num: 1,
                            forwarded_messages: 7,
                        },
                    )
                },
            ],
            probes: ProbeScore::default(),
        };
        let table = report.table();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4, "{table}");
        assert_eq!(
            lines[0].split_whitespace().collect::<Vec<_>>(),
            COLUMNS.to_vec()
        );
        let numbers: Vec<Vec<usize>> = lines[1..]
            .iter()
            .map(|l| {
                l.split_whitespace()
                    .take(6)
                    .map(|c| c.parse().expect("numeric column"))
                    .collect()
            })
            .collect();
        assert_eq!(numbers[0], vec![1, 2, 1000, 500, 0, 0]);
        assert_eq!(numbers[2], vec![12, 24, 12000, 6000, 6, 6]);
        assert!(lines[2].ends_with("compacted #1 (messages), 5 messages forwarded"));
        assert!(
            lines[3].ends_with("summary #1 reused (new compaction failed), 7 messages forwarded")
        );
        // Right-aligned: every row's numbers end where the header's do.
        let end = lines[0].find("summarizer_calls").expect("header") + "summarizer_calls".len();
        for l in &lines[1..] {
            assert_eq!(&l[end..end + 2], "  ", "{l}");
            assert_ne!(&l[end - 1..end], " ", "{l}");
        }
        let summary = report.summary();
        for part in [
            "3 steps",
            "6 compactions",
            "6 summarizer calls",
            "1 failed compactions",
            "peak tokens received 12000 vs forwarded 6000",
            "token threshold 108800 for gpt-4o",
            "max_messages 10",
        ] {
            assert!(summary.contains(part), "{part} missing from {summary}");
        }
    }

    fn chat_transcript(turns: usize) -> Value {
        let mut messages = vec![json!({"role": "system", "content": "You are a coding agent."})];
        for i in 0..turns {
            messages.push(json!({"role": "user", "content":
                format!("Step {i}: please look at src/file_{i}.rs and explain it in detail. {}", "x ".repeat(1000))}));
            messages.push(json!({"role": "assistant", "content":
                format!("The file {i} does things. {}", "y ".repeat(1000))}));
        }
        json!({"model": "gpt-4o", "messages": messages})
    }

    #[tokio::test]
    async fn a_replay_compacts_once_per_compaction_and_reuses_between() {
        let config = Config::from_toml(
            "[compaction]\nmax_messages = 8\nbackground_ratio = 0\nmin_preserve_tokens = 50\nmax_preserve_tokens = 300\n",
        )
        .expect("config");
        let replayer = Replayer::new(config, None).expect("replayer");
        assert_eq!(replayer.config().summarizer.backend, DEFAULT_SUMMARIZER);
        let (_dir, path) = temp_file("t.json", &chat_transcript(20).to_string());
        let report = replayer
            .run(&load(&path).expect("loads"))
            .await
            .expect("runs");

        assert_eq!(report.rows.len(), 20);
        assert_eq!(report.limits.max_messages, 8);
        assert!(report.compactions() >= 2, "{}", report.render());
        assert_eq!(report.summarizer_calls(), report.compactions());
        for r in &report.rows {
            assert!(r.forwarded <= r.received, "{r:?}");
            match &r.event {
                Event::Compacted {
                    forwarded_messages, ..
                }
                | Event::Reused {
                    forwarded_messages, ..
                } => {
                    assert!(r.forwarded < r.received, "{r:?}");
                    assert!(*forwarded_messages < r.messages, "{r:?}");
                }
                Event::Unchanged => assert_eq!(r.forwarded, r.received),
                other => panic!("unexpected {other:?}"),
            }
        }
        // Between two compactions the stored summary is reused, never recomputed.
        assert!(report
            .rows
            .iter()
            .any(|r| matches!(r.event, Event::Reused { .. })));

        let chart = svg::render(std::slice::from_ref(&report));
        assert_eq!(
            chart.matches("class=\"compaction\"").count(),
            report.compactions()
        );
    }

    #[tokio::test]
    async fn an_unknown_summarizer_is_refused_and_other_dialects_pass_through() {
        let err = Replayer::new(Config::default(), Some("nope"))
            .err()
            .expect("unknown backend");
        assert!(err.to_string().contains("nope"), "{err}");

        // Whatever the engine makes of Responses, a request under every threshold is forwarded
        // as received.
        let (_dir, path) = temp_file(
            "r.json",
            &json!({"input": [{"role": "user", "content": "hi"}]}).to_string(),
        );
        let replayer = Replayer::new(Config::default(), None).expect("replayer");
        let report = replayer
            .run(&load(&path).expect("loads"))
            .await
            .expect("runs");
        assert_eq!(report.dialect, "responses");
        assert_eq!(report.rows.len(), 1);
        assert_eq!(report.rows[0].forwarded, report.rows[0].received);
        assert!(report.rows[0].received > 0);
        assert_eq!(report.compactions(), 0);
    }

    #[test]
    fn a_summary_asked_inside_reads_what_the_last_request_shares_from_the_cache() {
        let est = LazyEstimator::default();
        let turn = |i: usize| serde_json::json!({"role": "user", "content": format!("turn {i} {}", "word ".repeat(300))});
        let tools = serde_json::json!([{"type": "function", "function": {"name": "bash"}}]);
        let request = |n: usize, tools: &Value| {
            let messages: Vec<Value> = (0..n).map(turn).collect();
            serde_json::to_vec(
                &serde_json::json!({"model": "m", "tools": tools, "messages": messages}),
            )
            .expect("json")
        };
        let before = request(6, &tools);
        let (asked, _) = DialectKind::ChatCompletions
            .ask_for_summary(
                &request(8, &tools),
                "Summarize the conversation above.",
                500,
            )
            .expect("asks");
        let scan = DialectKind::ChatCompletions
            .scan(&asked, &est)
            .expect("scan");
        let seen = DialectKind::ChatCompletions
            .scan(&before, &est)
            .expect("scan");
        let (all, cached) =
            cached_inside(DialectKind::ChatCompletions, Some(&before), &asked, &est)
                .expect("reads");
        assert_eq!(all, scan.tokens);
        // The tools and the six messages the provider saw; not the two since nor the turn.
        assert_eq!(cached, cached_prefix(seen.tokens));
        assert!(cached > 0 && cached < all);
        // Nothing seen, other tools: nothing cached.
        assert_eq!(
            cached_inside(DialectKind::ChatCompletions, None, &asked, &est),
            Some((all, 0))
        );
        let other = request(
            6,
            &serde_json::json!([{"type": "function", "function": {"name": "python_exec"}}]),
        );
        assert_eq!(
            cached_inside(DialectKind::ChatCompletions, Some(&other), &asked, &est),
            Some((all, 0))
        );
        assert_eq!(
            cached_inside(DialectKind::ChatCompletions, Some(&before), b"{", &est),
            None
        );
    }

    #[test]
    fn a_cached_prefix_is_the_shared_bytes_share_in_steps_from_the_minimum() {
        let before = b"aaaaaaaaaa";
        // 8 of 10 bytes shared: 80% of 10,000 tokens, in 128-token steps.
        assert_eq!(cached_tokens(Some(before), b"aaaaaaaabb", 10_000), 7_936);
        assert_eq!(
            cached_tokens(None, b"aaaaaaaabb", 10_000),
            0,
            "a first request"
        );
        // Under the minimum nothing is cached.
        assert_eq!(cached_tokens(Some(before), b"aaaaaaaabb", 1_200), 0);
        assert_eq!(cached_tokens(Some(before), before, 1_024), 1_024);
        assert_eq!(
            cached_tokens(Some(b"b"), before, 50_000),
            0,
            "nothing shared"
        );
    }

    #[test]
    fn input_cost_prices_cached_and_new_tokens_and_anthropic_writes_the_new() {
        let price = Price {
            input: 2.0,
            output: 8.0,
            cache_read: Some(0.5),
            cache_write: Some(2.5),
        };
        let mut first = row(1, Event::Unchanged);
        first.received = 10_000;
        first.forwarded = 10_000;
        let mut second = row(2, Event::Unchanged);
        second.received = 20_000;
        second.received_cached = 9_984;
        second.forwarded = 8_000;
        second.cached = 0;
        let mut report = FileReport {
            name: "t.json".into(),
            format: Format::Transcript,
            dialect: "chat_completions".into(),
            model: Some("m".into()),
            summarizer: "extractive".into(),
            strategy: Strategy::Summarize,
            price: Some(price),
            summarizer_tokens: SummarizerTokens {
                prompt: 3_000,
                summary: 500,
                ..SummarizerTokens::default()
            },
            summarizer_inside: false,
            summarizer_price: None,
            limits: Limits::new(&crate::config::CompactionConfig::default(), 16_000, None),
            rows: vec![first, second],
            probes: ProbeScore::default(),
        };
        let (with, without) = report.input_cost(&price);
        assert!((with - 18_000.0 * 2e-6).abs() < 1e-12, "{with}");
        let baseline = 10_000.0 * 2e-6 + 10_016.0 * 2e-6 + 9_984.0 * 0.5e-6;
        assert!((without - baseline).abs() < 1e-12, "{without}");
        assert_eq!(report.over_window_at(), Some(2));
        assert_eq!(report.summarizer_cost(), Some(0.0), "local");
        report.summarizer_price = Some(Some(price));
        let s = report.summarizer_cost().expect("priced");
        assert!((s - (3_000.0 * 2e-6 + 500.0 * 8e-6)).abs() < 1e-12);
        // Asked inside the conversation where it could be: of the 3,000 prompt tokens, 2,000
        // were such calls, whose requests held 10,000 tokens, 9,000 of them cached.
        report.summarizer_tokens.prompt_offered_inside = 2_000;
        report.summarizer_tokens.inside_new = 1_000;
        report.summarizer_tokens.inside_cached = 9_000;
        let standalone = 3_000.0 * 2e-6 + 500.0 * 8e-6;
        assert!((report.summarizer_cost().expect("priced") - standalone).abs() < 1e-12);
        report.summarizer_inside = true;
        let inside = 1_000.0 * 2e-6 + 1_000.0 * 2e-6 + 9_000.0 * 0.5e-6 + 500.0 * 8e-6;
        let s = report.summarizer_cost().expect("priced");
        assert!((s - inside).abs() < 1e-12, "{s} vs {inside}");
        // A local backend priced as the conversation's model is priced as `auto` asks.
        report.summarizer_price = None;
        assert!((report.summarizer_cost_as_llm(&price) - inside).abs() < 1e-12);
        report.summarizer_price = Some(None);
        assert_eq!(report.summarizer_cost(), None, "a model with no price");
        // Anthropic Messages: what is not read from the cache is written to it.
        report.dialect = "messages".into();
        let (with, _) = report.input_cost(&price);
        assert!((with - 18_000.0 * 2.5e-6).abs() < 1e-12, "{with}");
        let costs = costs(std::slice::from_ref(&report)).expect("priced");
        assert!(costs.contains("unpriced"), "{costs}");
    }
}
