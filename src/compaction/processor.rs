//! The processor: compacts a parsed transcript ([`Engine::compact`]) and handles one request
//! end to end ([`Compactor::process`]).
//!
//! [`Engine::compact`] is the seed's `Processor.Compact` over a neutral transcript: find the
//! preserve boundary, mask and truncate the turns before it, render the prompt (fitted to the
//! summarizer's window), call the summarizer under a timeout, and price the result. It takes
//! an optional [`Prior`] (summary, file lists and number of the previous compaction of the same
//! conversation) and optional focus instructions, so session memory and manual compaction
//! reuse it unchanged.
//!
//! Circuit breaker (seed §5.2): at most [`COMPACTION_CIRCUIT_BREAKER_THRESHOLD`] summarizer
//! calls per request. When a rewrite would still trip the trigger, the next attempt halves the
//! preserve budget (below the configured floor if need be; the boundary rules still apply) and
//! summarises only the additional turns, refining the previous attempt's summary. If the
//! attempts run out, or a later attempt fails or makes no progress, the best rewrite so far is
//! forwarded: it is valid and strictly smaller than the original, so it can only help. A
//! rewrite that would not be smaller than the original (estimated) is never forwarded.
//!
//! [`Compactor::process`] is the request-level glue: peek (cheap, no re-serialisation), record
//! the estimate, check the trigger, and only then parse fully, compact and rewrite. It never
//! fails and never panics by design: every problem becomes [`Outcome::Unchanged`] or
//! [`Outcome::Failed`] and the proxy forwards the original bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use compactor_plugin_api::{Caller, SummarizeError, Summarizer, SummaryRequest};

use super::boundary::{find_preserve_boundary, preserve_budget, TailLimits};
use super::estimate::LazyEstimator;
use super::files::FileTracker;
use super::mask::{mask_observations, PRESERVE_RECENT_OUTPUTS};
use super::models::ModelTable;
use super::prompt::{
    build_prompt, summary_message, to_entries, truncate_entries, PromptError, PromptInput,
    SUMMARY_INTRO,
};
use super::transcript::{Message, Transcript};
use super::trigger::{CompactionOutcome, Limits, Trigger};
use super::{CompactionResult, Outcome};
use crate::config::{CompactionConfig, Config};
use crate::dialect::chat::{self, ChatError};
use crate::dialect::DialectKind;
use crate::metrics::Metrics;

/// The seed's `compactionCircuitBreakerThreshold`: most compaction attempts per request.
pub const COMPACTION_CIRCUIT_BREAKER_THRESHOLD: u32 = 3;

/// What a previous compaction of the same conversation left behind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prior {
    /// Its summary, refined by the next compaction.
    pub summary: String,
    /// Files read up to then.
    pub read_files: Vec<String>,
    /// Files modified up to then.
    pub modified_files: Vec<String>,
    /// Its 1-based number; the next compaction is this plus one.
    pub compaction_num: u32,
}

/// One compaction to perform.
#[derive(Debug, Clone, Copy)]
pub struct CompactionInput<'a> {
    /// The conversation (with any prior summary already spliced out of it).
    pub transcript: &'a Transcript,
    /// The request's model (for the summarizer's window).
    pub model: Option<&'a str>,
    /// The limits the result should get under.
    pub limits: Limits,
    /// Estimated tokens outside the messages (tool definitions).
    pub fixed_tokens: usize,
    /// The previous compaction of this conversation, if any.
    pub prior: Option<&'a Prior>,
    /// Focus instructions of a manual compaction.
    pub instructions: Option<&'a str>,
    /// Destination and credentials, for summarizers that call the caller's provider.
    pub caller: &'a Caller,
}

/// A compaction plan: replace `transcript[head..boundary]` by one user message.
#[derive(Debug, Clone, PartialEq)]
pub struct Compaction {
    /// Leading system/developer messages kept verbatim.
    pub head: usize,
    /// First message of the preserved tail.
    pub boundary: usize,
    /// The text of the user message that replaces the compacted turns.
    pub summary_message: String,
    /// What the compaction produced.
    pub result: CompactionResult,
    /// Summarizer calls made (1 to [`COMPACTION_CIRCUIT_BREAKER_THRESHOLD`]).
    pub attempts: u32,
}

/// Why a compaction did not happen.
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    /// No message lies between the kept head and the kept tail.
    #[error("nothing to compact")]
    NothingToCompact,
    /// The body could not be read or rewritten by its dialect.
    #[error(transparent)]
    Dialect(#[from] ChatError),
    /// The prompt cannot fit the summarizer's window.
    #[error(transparent)]
    Prompt(#[from] PromptError),
    /// The summarizer failed.
    #[error(transparent)]
    Summarizer(SummarizeError),
    /// The summarizer did not answer in time (compactor's own safety net).
    #[error("summarizer did not answer within {0:?}")]
    Timeout(Duration),
    /// The summary was empty or whitespace.
    #[error("summarizer returned a blank summary")]
    Blank,
    /// The rewrite would not be smaller than the original.
    #[error("compacted request ({post} tokens) would not be smaller than the original ({pre})")]
    NotSmaller {
        /// Estimated tokens before.
        pre: usize,
        /// Estimated tokens after.
        post: usize,
    },
}

impl CompactError {
    /// The `outcome` label this failure is counted under.
    pub fn outcome(&self) -> CompactionOutcome {
        match self {
            CompactError::Blank | CompactError::Summarizer(SummarizeError::Blank) => {
                CompactionOutcome::Blank
            }
            _ => CompactionOutcome::Failed,
        }
    }
}

/// The compaction engine: configuration, models table, estimator and summarizer.
pub struct Engine {
    config: CompactionConfig,
    models: ModelTable,
    estimator: LazyEstimator,
    summarizer: Arc<dyn Summarizer>,
    /// Per-attempt timeout handed to backends.
    attempt_timeout: Duration,
    /// compactor's own bound on one summary (all backends of the fallback chain).
    total_timeout: Duration,
    summary_max_tokens: u32,
}

impl Engine {
    /// Builds the engine from the configuration.
    ///
    /// The summarizer is already wrapped by the app with per-backend timeouts and the fallback
    /// chain; the engine's own safety-net timeout is `summarizer.timeout_secs` times the number
    /// of backends in that chain, so a primary that times out still leaves its fallbacks time.
    pub fn new(config: &Config, summarizer: Arc<dyn Summarizer>) -> Engine {
        let attempt_timeout = config.summarizer_timeout();
        let backends = u32::try_from(config.summarizer.fallback.len().saturating_add(1))
            .unwrap_or(u32::MAX);
        Engine {
            config: config.compaction.clone(),
            models: ModelTable::new(&config.models, config.compaction.default_context_window),
            estimator: LazyEstimator::default(),
            summarizer,
            attempt_timeout,
            total_timeout: attempt_timeout.saturating_mul(backends),
            summary_max_tokens: config.summarizer.openai.max_tokens,
        }
    }

    /// The token estimator.
    pub fn estimator(&self) -> &LazyEstimator {
        &self.estimator
    }

    /// The models table.
    pub fn models(&self) -> &ModelTable {
        &self.models
    }

    /// The limits of a request for `model` reserving `requested_output` output tokens.
    pub fn limits(&self, model: Option<&str>, requested_output: Option<usize>) -> Limits {
        Limits::new(
            &self.config,
            self.models.context_window(model),
            requested_output,
        )
    }

    /// Compacts a transcript: the seed's `Processor.Compact`, with the circuit breaker.
    pub async fn compact(&self, input: CompactionInput<'_>) -> Result<Compaction, CompactError> {
        let t = input.transcript;
        let n = t.len();
        let head = t.head_len();
        let pre = input.fixed_tokens.saturating_add(t.tokens(0..n));
        let head_tokens = t.tokens(0..head);
        let compaction_num = input
            .prior
            .map_or(1, |p| p.compaction_num.saturating_add(1));
        let limits = input.limits;
        let base_budget = preserve_budget(&self.config, limits.usable_window());
        // Room the summary message may take: the summary's output budget plus its framing.
        let summary_reserve = (self.summary_max_tokens as usize)
            .saturating_add(self.estimator.text(SUMMARY_INTRO))
            .saturating_add(64);
        let others = input
            .fixed_tokens
            .saturating_add(head_tokens)
            .saturating_add(summary_reserve);
        let turn_max_tokens = limits.token_threshold.saturating_sub(others).saturating_sub(1);
        let turn_max_messages = limits.max_messages.saturating_sub(head + 1);
        // Leave the conversation room to grow before the message trigger fires again.
        let tail_cap = (limits.max_messages / 2).max(1);

        let mut tracker = match input.prior {
            Some(p) => FileTracker::with_prior(&p.read_files, &p.modified_files),
            None => FileTracker::new(),
        };
        let mut prior_summary: Option<String> = input.prior.map(|p| p.summary.clone());
        let mut done = head;
        let mut best: Option<Compaction> = None;
        let mut failure: Option<CompactError> = None;

        for attempt in 1..=COMPACTION_CIRCUIT_BREAKER_THRESHOLD {
            let tail = TailLimits {
                budget: base_budget >> (attempt - 1),
                max_messages: tail_cap,
                turn_max_tokens,
                turn_max_messages,
            };
            let Some(boundary) = find_preserve_boundary(t, &tail) else {
                break;
            };
            let Some(slice) = t.messages.get(done..boundary).filter(|s| !s.is_empty()) else {
                break; // no progress over the previous attempt
            };
            slice.iter().for_each(|m| tracker.observe_message(m));
            let summary = match self
                .summarize(slice, prior_summary.as_deref(), &tracker, &input, compaction_num)
                .await
            {
                Ok(s) => s,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            let message = summary_message(&summary, tracker.read_files(), tracker.modified_files());
            let post = head_tokens
                .saturating_add(input.fixed_tokens)
                .saturating_add(self.estimator.text(&message))
                .saturating_add(t.tokens(boundary..n));
            let to_beat = best.as_ref().map_or(pre, |c| c.result.post_tokens);
            if post >= to_beat {
                if best.is_none() {
                    failure = Some(CompactError::NotSmaller { pre, post });
                }
                break;
            }
            let still_over = limits.check(head + 1 + (n - boundary), post).is_some();
            best = Some(Compaction {
                head,
                boundary,
                summary_message: message,
                result: CompactionResult {
                    summary: summary.clone(),
                    read_files: tracker.read_files().to_vec(),
                    modified_files: tracker.modified_files().to_vec(),
                    pre_tokens: pre,
                    post_tokens: post,
                    compaction_num,
                },
                attempts: attempt,
            });
            if !still_over {
                break;
            }
            tracing::debug!(attempt, post, "compacted request still over the limit; retrying");
            done = boundary;
            prior_summary = Some(summary);
        }
        match best {
            Some(c) => {
                if let Some(e) = failure {
                    tracing::warn!(error = %e, "a later compaction attempt failed; using the earlier one");
                }
                Ok(c)
            }
            None => Err(failure.unwrap_or(CompactError::NothingToCompact)),
        }
    }

    async fn summarize(
        &self,
        slice: &[Message],
        prior_summary: Option<&str>,
        tracker: &FileTracker,
        input: &CompactionInput<'_>,
        compaction_num: u32,
    ) -> Result<String, CompactError> {
        let mut entries = to_entries(slice);
        if self.config.mask_observations {
            mask_observations(&mut entries, PRESERVE_RECENT_OUTPUTS);
        }
        truncate_entries(&mut entries);
        let window = self.models.context_window(input.model);
        let max_prompt = window.saturating_sub(self.summary_max_tokens as usize);
        let prompt_input = PromptInput {
            prior_summary,
            read_files: tracker.read_files(),
            modified_files: tracker.modified_files(),
            instructions: input.instructions,
        };
        let built = build_prompt(&prompt_input, entries, max_prompt, &self.estimator)?;
        if built.omitted > 0 {
            tracing::debug!(
                omitted = built.omitted,
                "oldest turns left out of the compaction prompt to fit the summarizer"
            );
        }
        let request = SummaryRequest {
            prompt: built.prompt,
            prior_summary: prior_summary.map(str::to_string),
            entries: built.entries,
            read_files: tracker.read_files().to_vec(),
            modified_files: tracker.modified_files().to_vec(),
            instructions: input.instructions.map(str::to_string),
            compaction_num,
            model: input.model.map(str::to_string),
            max_output_tokens: self.summary_max_tokens,
            timeout: self.attempt_timeout,
            caller: input.caller.clone(),
        };
        match tokio::time::timeout(self.total_timeout, self.summarizer.summarize(&request)).await {
            Err(_) => Err(CompactError::Timeout(self.total_timeout)),
            Ok(Err(e)) => Err(CompactError::Summarizer(e)),
            Ok(Ok(summary)) => {
                let text = summary.text.trim();
                if text.is_empty() {
                    Err(CompactError::Blank)
                } else {
                    Ok(text.to_string())
                }
            }
        }
    }
}

/// The request-level entry point the proxy calls.
pub struct Compactor {
    engine: Engine,
    metrics: Arc<Metrics>,
    enabled: bool,
}

impl Compactor {
    /// Builds the compactor; cheap, and all a test needs is a config, a summarizer and a
    /// metrics registry.
    pub fn new(config: &Config, summarizer: Arc<dyn Summarizer>, metrics: Arc<Metrics>) -> Self {
        Compactor {
            engine: Engine::new(config, summarizer),
            metrics,
            enabled: config.compaction.enabled,
        }
    }

    /// The engine, for callers that compact parsed transcripts themselves (sessions, admin).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Decides what to forward for one chat request. Never fails: on any problem the
    /// original bytes go upstream ([`Outcome::Unchanged`] when no compaction was due,
    /// [`Outcome::Failed`] when it was due but did not happen).
    pub async fn process(&self, dialect: DialectKind, body: &[u8], caller: &Caller) -> Outcome {
        if !self.enabled {
            return Outcome::Unchanged;
        }
        match dialect {
            DialectKind::ChatCompletions => self.process_chat(body, caller).await,
            // Their dialects come with later issues; until then they pass through.
            DialectKind::Messages | DialectKind::Responses => Outcome::Unchanged,
        }
    }

    async fn process_chat(&self, body: &[u8], caller: &Caller) -> Outcome {
        let peek = match chat::peek(body, self.engine.estimator()) {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(error = %e, "chat body not understood; forwarding unchanged");
                return Outcome::Unchanged;
            }
        };
        self.metrics
            .request_tokens_estimated
            .observe(peek.tokens as f64);
        let limits = self
            .engine
            .limits(peek.model.as_deref(), peek.requested_output);
        let Some(trigger) = limits.check(peek.message_count, peek.tokens) else {
            return Outcome::Unchanged;
        };
        let started = Instant::now();
        let compacted = self.compact_chat(body, caller, limits).await;
        self.metrics
            .compaction_duration
            .observe(started.elapsed().as_secs_f64());
        match compacted {
            Ok((body, compaction)) => {
                self.record(trigger, CompactionOutcome::Compacted);
                let result = compaction.result;
                let saved = result.pre_tokens.saturating_sub(result.post_tokens);
                self.metrics
                    .tokens_saved
                    .inc_by(u64::try_from(saved).unwrap_or(u64::MAX));
                tracing::info!(
                    trigger = trigger.label(),
                    pre_tokens = result.pre_tokens,
                    post_tokens = result.post_tokens,
                    compacted_messages = compaction.boundary - compaction.head,
                    kept_messages = peek.message_count - compaction.boundary,
                    attempts = compaction.attempts,
                    "request compacted"
                );
                Outcome::Rewritten {
                    body: bytes::Bytes::from(body),
                    result,
                    trigger,
                }
            }
            Err(e) => {
                let outcome = e.outcome();
                self.record(trigger, outcome);
                tracing::warn!(
                    trigger = trigger.label(),
                    outcome = outcome.label(),
                    error = %e,
                    "compaction failed; forwarding the original request"
                );
                Outcome::Failed
            }
        }
    }

    async fn compact_chat(
        &self,
        body: &[u8],
        caller: &Caller,
        limits: Limits,
    ) -> Result<(Vec<u8>, Compaction), CompactError> {
        let request = chat::parse_with(body, self.engine.estimator())?;
        let compaction = self
            .engine
            .compact(CompactionInput {
                transcript: &request.transcript,
                model: request.model.as_deref(),
                limits,
                fixed_tokens: request.fixed_tokens,
                prior: None,
                instructions: None,
                caller,
            })
            .await?;
        let body = request.rewrite(
            compaction.head,
            compaction.boundary,
            &compaction.summary_message,
        )?;
        Ok((body, compaction))
    }

    fn record(&self, trigger: Trigger, outcome: CompactionOutcome) {
        self.metrics
            .compactions
            .with_label_values(&[trigger.label(), outcome.label()])
            .inc();
    }
}
