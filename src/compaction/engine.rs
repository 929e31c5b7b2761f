//! The engine: compacts a parsed transcript ([`Engine::compact`]).
//!
//! [`Engine::compact`] is one compaction over a neutral transcript (docs/architecture.md,
//! *Compaction rules*): find the preserve boundary, mask and truncate the turns before it,
//! render the prompt (fitted to the summarizer's window), call the summarizer under a timeout,
//! and price the result. It takes an optional [`Prior`] (summary, file lists and number of the
//! previous compaction of the same conversation) and optional focus instructions, so session
//! memory and manual compaction reuse it unchanged.
//!
//! Attempt limit (docs/architecture.md, *Attempt limit*): at most
//! [`MAX_ATTEMPTS_PER_REQUEST`] summarizer calls per request. When a rewrite would
//! still trip the trigger, the next attempt halves the preserve budget (below the configured
//! floor if need be; the boundary rules still apply) and summarises only the additional turns,
//! refining the previous attempt's summary; an attempt that would send the summarizer the same
//! slice as the previous one is not made. If the attempts run out, or a later attempt fails or
//! makes no progress, the best rewrite so far is forwarded: it is valid and strictly smaller
//! than the original, so it can only help. A rewrite that would not be smaller than the
//! original (estimated) is never forwarded.
//!
//! The person's latest own words (their text without the context their agent injected, see
//! [`own_words`]) are pinned verbatim at the end of every summary that covers the turn holding
//! them, and a summary that is blank once that pin is removed is a blank summary.
//!
//! Applying a compaction to a request (scan, checkpoint lookup, single flight, splice, store)
//! is the pipeline's job (`src/pipeline.rs`, a layer above); the engine never fails a request either: every problem is a
//! [`CompactError`], and the pipeline forwards the original bytes.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use compactor_plugin_api::{
    is_blank, split_user_text, Api, Caller, SummarizeError, Summarizer, SummaryRequest,
    SummaryUsage,
};

use super::boundary::{find_preserve_boundary_after, preserve_budget, TailLimits};
use super::files::FileTracker;
use super::mask_rule::PRESERVE_RECENT_OUTPUTS;
use super::models::ModelTable;
use super::prompt::{
    build_prompt, count_outputs, follow_up_prompt, summary_message, to_entries_masking,
    truncate_entries, PromptError, PromptInput, SUMMARY_INTRO,
};
use super::trigger::{CompactionOutcome, Limits};
use super::CompactionResult;
use crate::config::{CompactionConfig, Config};
use crate::estimate::LazyEstimator;
use crate::transcript::{Message, Part, Role, Transcript};

/// Most summarizer calls (compaction attempts) while handling one request; not the
/// per-session breaker (docs/architecture.md, *Attempt limit*).
pub const MAX_ATTEMPTS_PER_REQUEST: u32 = 3;

/// The summarizer calls one client request may still make, whatever path makes them: the
/// compaction before it is sent and the one after the provider refuses it for its length
/// draw on the same [`MAX_ATTEMPTS_PER_REQUEST`].
#[derive(Debug)]
pub struct Attempts(AtomicU32);

impl Attempts {
    /// A fresh budget of [`MAX_ATTEMPTS_PER_REQUEST`] calls.
    pub fn per_request() -> Attempts {
        Attempts(AtomicU32::new(MAX_ATTEMPTS_PER_REQUEST))
    }

    /// Takes one call from the budget; false when none is left.
    pub fn take(&self) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                left.checked_sub(1)
            })
            .is_ok()
    }

    /// Calls still allowed.
    pub fn left(&self) -> u32 {
        self.0.load(Ordering::Acquire)
    }
}

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
    /// The summarizer calls the request may still make; each attempt takes one.
    pub attempts: &'a Attempts,
    /// Keep the smallest tail (`min_preserve_tokens`) rather than the preserve budget: for a
    /// compaction made because it pays (`compaction.cost_trigger`), whose kept part is read
    /// again on every later request.
    pub smallest_tail: bool,
    /// Builds the summary request inside the conversation for the first attempt
    /// ([`SummaryRequest::in_conversation`]); `None` when there is no forwarded request to
    /// build it from.
    pub in_conversation: Option<InConversation<'a>>,
}

/// Builds [`SummaryRequest::in_conversation`] from the turn asking for the summary, the output
/// budget and the estimated tokens of the standalone prompt (to weigh one against the other);
/// `None` when the request cannot carry it or the standalone prompt costs less. The pipeline makes it: it knows the
/// request as the provider last received it and its wire format, which the engine does not.
#[derive(Clone, Copy)]
pub struct InConversation<'a>(pub &'a AskInConversation<'a>);

/// The function behind [`InConversation`]: `(turn, max_output, prompt_tokens) -> body`.
pub type AskInConversation<'a> = dyn Fn(&str, u32, usize) -> Option<Arc<[u8]>> + Sync + 'a;

impl std::fmt::Debug for InConversation<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InConversation")
    }
}

/// A compaction plan: replace `transcript[head..boundary]` by one user message.
#[derive(Debug, Clone, PartialEq)]
pub struct Compaction {
    /// Head messages kept verbatim (leading system/developer messages, and everything through a
    /// provider's sealed summary).
    pub head: usize,
    /// First message of the preserved tail.
    pub boundary: usize,
    /// Messages of the rewritten request: head, summary message, tail.
    pub messages: usize,
    /// The same as the message-count trigger counts them ([`Transcript::counted`]).
    pub counted: usize,
    /// The text of the user message that replaces the compacted turns.
    pub summary_message: String,
    /// What the compaction produced.
    pub result: CompactionResult,
    /// Summarizer calls made (1 to [`MAX_ATTEMPTS_PER_REQUEST`]).
    pub attempts: u32,
    /// What the summarizer's answers cost, as its backends reported it (one entry per answer
    /// that said, attempts whose summary was not used included).
    pub usage: Vec<SummaryUsage>,
}

/// Why a compaction did not happen.
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    /// No message lies between the kept head and the kept tail.
    #[error("nothing to compact")]
    NothingToCompact,
    /// The prompt cannot fit the summarizer's window.
    #[error(transparent)]
    Prompt(#[from] PromptError),
    /// The summarizer failed.
    #[error(transparent)]
    Summarizer(SummarizeError),
    /// The summarizer did not answer in time (compactor's own safety net).
    #[error("summarizer did not answer within {0:?}")]
    Timeout(Duration),
    /// The request already made every summarizer call it may ([`Attempts`]).
    #[error("the request already made {MAX_ATTEMPTS_PER_REQUEST} summarizer calls")]
    NoAttemptsLeft,
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
            CompactError::Summarizer(SummarizeError::Blank) => CompactionOutcome::Blank,
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
}

/// The output budget assumed for a backend that has none of its own (`extractive`, `exec`):
/// the default `max_tokens` of the LLM backends.
pub const DEFAULT_SUMMARY_TOKENS: u32 = 4_096;

impl Engine {
    /// Builds the engine from the configuration.
    ///
    /// The summarizer is already wrapped by the app with per-backend timeouts and the fallback
    /// chain; the engine's own safety-net timeout is `summarizer.timeout_secs` times the number
    /// of backends in that chain, so a primary that times out still leaves its fallbacks time.
    pub fn new(config: &Config, summarizer: Arc<dyn Summarizer>) -> Engine {
        let attempt_timeout = config.summarizer_timeout();
        let backends =
            u32::try_from(config.summarizer.fallback.len().saturating_add(1)).unwrap_or(u32::MAX);
        Engine {
            config: config.compaction.clone(),
            models: ModelTable::of(config),
            estimator: LazyEstimator::default(),
            summarizer,
            attempt_timeout,
            total_timeout: attempt_timeout.saturating_mul(backends),
        }
    }

    /// compactor's own bound on one summary, fallbacks included.
    pub fn summary_timeout(&self) -> Duration {
        self.total_timeout
    }

    /// The summarizer's name (its primary backend), for logs.
    pub fn summarizer_name(&self) -> &str {
        self.summarizer.name()
    }

    /// The token estimator.
    pub fn estimator(&self) -> &LazyEstimator {
        &self.estimator
    }

    /// The `[compaction]` settings the engine runs with.
    pub fn settings(&self) -> &CompactionConfig {
        &self.config
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

    /// The summarizer's budget for a request in `api` to a model with `window` tokens (the
    /// window its limits were made with, learned or from the table): (most prompt tokens, most
    /// output tokens). The summarizer is assumed to have the request model's window (it uses
    /// the request's model unless configured otherwise); the output budget is the one of the
    /// backend that will answer for `api` (`auto` picks by API, so an Anthropic request gets
    /// `summarizer.anthropic.max_tokens`), [`DEFAULT_SUMMARY_TOKENS`] for backends without
    /// one, capped at a quarter of that window: on a small model, a summary as long as half the
    /// window leaves too little room for the verbatim tail and the prompt.
    pub fn summarizer_budget(&self, window: usize, api: Api) -> (usize, u32) {
        let cap = u32::try_from(window / 4).unwrap_or(u32::MAX);
        let own = self
            .summarizer
            .max_output_tokens(api)
            .unwrap_or(DEFAULT_SUMMARY_TOKENS);
        let max_output = own.min(cap);
        (window.saturating_sub(max_output as usize), max_output)
    }

    /// The head this compaction keeps: the transcript's, its opening included, unless even
    /// the smallest tail an attempt may keep would leave the rewrite over the token trigger
    /// beside it (a long opening and a long last tool output in a small window). Then the
    /// opening is compacted like any turn, so the request fits. The choice travels with the
    /// stored summary (it records the head it follows), so the requests splicing it agree.
    fn head_for(
        &self,
        input: &CompactionInput<'_>,
        base_budget: usize,
        summary_reserve: usize,
        tail_cap: usize,
    ) -> usize {
        let t = input.transcript;
        let (head, base) = (t.head_len(), t.head_len_without_opening());
        if head == base {
            return head;
        }
        let smallest = TailLimits {
            budget: base_budget >> (MAX_ATTEMPTS_PER_REQUEST - 1),
            max_messages: tail_cap,
            turn_max_tokens: 0,
            turn_max_messages: 0,
        };
        let fits = find_preserve_boundary_after(t, head, &smallest).is_some_and(|b| {
            input
                .fixed_tokens
                .saturating_add(t.tokens(0..head))
                .saturating_add(summary_reserve)
                .saturating_add(t.tokens(b..t.len()))
                <= input.limits.token_threshold
        });
        if !fits {
            tracing::debug!(
                opening = head - base,
                "the opening cannot stay verbatim and fit the trigger; compacting it"
            );
        }
        if fits {
            head
        } else {
            base
        }
    }

    /// Compacts a transcript, within the per-request attempt limit.
    pub async fn compact(&self, input: CompactionInput<'_>) -> Result<Compaction, CompactError> {
        let t = input.transcript;
        let n = t.len();
        let limits = input.limits;
        let base_budget = if input.smallest_tail {
            self.config.min_preserve_tokens
        } else {
            preserve_budget(&self.config, limits.usable_window())
        };
        // Room the summary message may take: the summary's output budget plus its framing.
        let (_, max_output) =
            self.summarizer_budget(input.limits.summarizer_window, input.caller.api);
        let summary_reserve = (max_output as usize)
            .saturating_add(self.estimator.text(SUMMARY_INTRO))
            .saturating_add(64);
        let tail_cap = (limits.max_messages / 2).max(1);
        let head = self.head_for(&input, base_budget, summary_reserve, tail_cap);
        // What the request would carry without this compaction: the transcript plus the prior
        // compaction's summary message, which the session layer spliced out of `transcript`.
        let prior_message = input.prior.map_or(0, |p| {
            self.estimator.text(&summary_message(
                &p.summary,
                &p.read_files,
                &p.modified_files,
            ))
        });
        let pre = input
            .fixed_tokens
            .saturating_add(t.tokens(0..n))
            .saturating_add(prior_message);
        let head_tokens = t.tokens(0..head);
        let compaction_num = input
            .prior
            .map_or(1, |p| p.compaction_num.saturating_add(1));
        let others = input
            .fixed_tokens
            .saturating_add(head_tokens)
            .saturating_add(summary_reserve);
        // The latest user turn is kept verbatim only if the rewrite then lands at or below half
        // of each trigger, leaving the conversation room to grow before the next compaction;
        // the same goes for the number of messages the budget walk may keep.
        let turn_max_tokens = (limits.token_threshold / 2).saturating_sub(others);
        let turn_max_messages = (limits.max_messages / 2).saturating_sub(head + 1);

        let mut tracker = FileTracker::with_limit(self.config.max_tracked_files);
        if let Some(p) = input.prior {
            tracker = tracker.with_prior(&p.read_files, &p.modified_files);
        }
        let mut prior_summary: Option<String> = input.prior.map(|p| p.summary.clone());
        let mut done = head;
        // The slice the previous attempt summarised: sending it again would get the same
        // answer (or cost a second call for nothing).
        let mut tried: Option<(usize, usize)> = None;
        let mut best: Option<Compaction> = None;
        let mut failure: Option<CompactError> = None;
        let mut usage = Vec::new();

        for attempt in 1..=MAX_ATTEMPTS_PER_REQUEST {
            let tail = TailLimits {
                budget: base_budget >> (attempt - 1),
                max_messages: tail_cap,
                turn_max_tokens,
                turn_max_messages,
            };
            let Some(boundary) = find_preserve_boundary_after(t, head, &tail) else {
                break;
            };
            let Some(slice) = t.messages.get(done..boundary).filter(|s| !s.is_empty()) else {
                break; // no progress over the previous attempt
            };
            if tried == Some((done, boundary)) {
                break; // a smaller budget found the same boundary: the same slice again
            }
            if !input.attempts.take() {
                // An earlier compaction of this request spent the budget.
                failure = failure.or(Some(CompactError::NoAttemptsLeft));
                break;
            }
            tried = Some((done, boundary));
            slice.iter().for_each(|m| tracker.observe_message(m));
            let summary = match self
                .summarize(
                    slice,
                    prior_summary.as_deref(),
                    &tracker,
                    &input,
                    compaction_num,
                    done == head,
                )
                .await
            {
                Ok((s, spent)) => {
                    usage.extend(spent);
                    s
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            let kept = head + 1 + n.saturating_sub(boundary);
            let counted = t.counted(0..head) + 1 + t.counted(boundary..n);
            let price = |summary: String| {
                let message =
                    summary_message(&summary, tracker.read_files(), tracker.modified_files());
                let post = head_tokens
                    .saturating_add(input.fixed_tokens)
                    .saturating_add(self.estimator.text(&message))
                    .saturating_add(t.tokens(boundary..n));
                (summary, message, post)
            };
            // The person's latest words are pinned verbatim, always: a summary may paraphrase
            // everything else, never what they last asked. Only their own words are pinned;
            // the turn's injected context, tool outputs and images are what the summary
            // condenses.
            let to_beat = best.as_ref().map_or(pre, |c| c.result.post_tokens);
            let plain = strip_pinned(&summary);
            if is_blank(&plain) {
                // Nothing but a pinned copy of a user turn (or invisible characters).
                failure = Some(CompactError::Summarizer(SummarizeError::Blank));
                break;
            }
            // One exception: when the verbatim copy keeps the rewrite over the trigger (a long
            // task text beside a large tail), the provider may refuse the pinned request: the
            // summary's own copy (head and tail of the words, in "All user messages") stands
            // in, and the log says so. Shrinking the request comes before the copy.
            let pinned = price(pin_latest_user_words(
                plain.clone(),
                t,
                head,
                boundary,
                input.prior,
            ));
            let (summary, message, post) = if limits.check(counted, pinned.2).is_some() {
                let unpinned = price(plain);
                if unpinned.2 < pinned.2 {
                    tracing::warn!(
                        pinned = pinned.2,
                        unpinned = unpinned.2,
                        "the latest user words verbatim would keep the request over its limits; the summary's copy stands in"
                    );
                    unpinned
                } else {
                    pinned
                }
            } else {
                pinned
            };
            if post >= to_beat {
                if best.is_some() {
                    break; // no better than the previous attempt: keep that one
                }
                // Not smaller yet: the next attempt keeps a smaller tail.
                failure = Some(CompactError::NotSmaller { pre, post });
                continue;
            }
            failure = None;
            let still_over = limits.check(counted, post).is_some();
            best = Some(Compaction {
                head,
                boundary,
                messages: kept,
                counted,
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
                usage: Vec::new(),
            });
            if !still_over {
                break;
            }
            tracing::debug!(
                attempt,
                post,
                "compacted request still over the limit; retrying"
            );
            done = boundary;
            prior_summary = Some(summary);
        }
        match best {
            Some(c) => {
                if let Some(e) = failure {
                    tracing::warn!(error = %e, "a later compaction attempt failed; using the earlier one");
                }
                Ok(Compaction { usage, ..c })
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
        first: bool,
    ) -> Result<(String, Option<SummaryUsage>), CompactError> {
        // Old outputs are masked as they are converted, never copied only to be dropped.
        let masked = if self.config.mask_observations {
            count_outputs(slice).saturating_sub(PRESERVE_RECENT_OUTPUTS)
        } else {
            0
        };
        let mut entries = to_entries_masking(slice, masked);
        truncate_entries(&mut entries);
        let (max_prompt, max_output) =
            self.summarizer_budget(input.limits.summarizer_window, input.caller.api);
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
        // The first attempt may be asked inside the conversation (which then summarises all of
        // it, the tail kept verbatim after the summary included); a later one refines the
        // first attempt's summary, which the provider has not seen.
        // Only for a backend that sends it: building it copies the whole conversation.
        let asks_inside = first && self.summarizer.reads_conversation(input.caller.api);
        let in_conversation = input
            .in_conversation
            .filter(|_| asks_inside)
            .and_then(|ask| {
                let prompt_tokens = self.estimator.text(&built.prompt);
                (ask.0)(&follow_up_prompt(&prompt_input), max_output, prompt_tokens)
            });
        let request = SummaryRequest {
            in_conversation,
            prompt: built.prompt,
            prior_summary: prior_summary.map(str::to_string),
            entries: built.entries,
            read_files: tracker.read_files().to_vec(),
            modified_files: tracker.modified_files().to_vec(),
            instructions: input.instructions.map(str::to_string),
            compaction_num,
            model: input.model.map(str::to_string),
            max_output_tokens: max_output,
            timeout: self.attempt_timeout,
            caller: input.caller.clone(),
        };
        match tokio::time::timeout(self.total_timeout, self.summarizer.summarize(&request)).await {
            Err(_) => Err(CompactError::Timeout(self.total_timeout)),
            Ok(Err(e)) => Err(CompactError::Summarizer(e)),
            Ok(Ok(summary)) => {
                let text = summary.text.trim();
                if is_blank(text) {
                    // A backend that bypassed `Summary::new`: blank all the same.
                    Err(CompactError::Summarizer(SummarizeError::Blank))
                } else {
                    Ok((text.to_string(), summary.usage))
                }
            }
        }
    }
}

/// Opens the verbatim copy of the latest user turn inside a summary.
pub const LATEST_USER_OPEN: &str = "<latest-user-message>";
/// Closes it.
pub const LATEST_USER_CLOSE: &str = "</latest-user-message>";

/// `plain` (a summary without a pinned turn, see [`strip_pinned`]) with the person's latest
/// own words (see [`own_words`]) appended verbatim inside [`LATEST_USER_OPEN`] …
/// [`LATEST_USER_CLOSE`], when the user turn holding them falls among the compacted messages
/// (agents send one task and then hundreds of tool calls); when the conversation being
/// compacted has no such turn left (it was compacted earlier), with the copy in the prior
/// summary carried over. `plain` unchanged when those words are kept verbatim in the tail or
/// there are none.
fn pin_latest_user_words(
    plain: String,
    t: &Transcript,
    head: usize,
    boundary: usize,
    prior: Option<&Prior>,
) -> String {
    let latest = (head..t.len()).rev().find_map(|i| {
        let m = &t.messages[i];
        let words = (m.role == Role::User && !m.is_tool_answer())
            .then(|| own_words(m))
            .filter(|w| !w.is_empty())?;
        Some((i, words))
    });
    let text = match latest {
        Some((u, _)) if u >= boundary => return plain, // kept verbatim in the tail
        Some((_, words)) => words,
        None => match prior.and_then(|p| pinned_text(&p.summary)) {
            Some(carried) => carried.to_string(),
            None => return plain,
        },
    };
    format!(
        "{plain}\n\n{LATEST_USER_OPEN}\n{}\n{LATEST_USER_CLOSE}",
        text.trim()
    )
}

/// What the person wrote in a user message: the own words of its text parts (see
/// [`split_user_text`]), joined by blank lines; empty when it holds only injected context.
pub fn own_words(message: &Message) -> String {
    let mut out = String::new();
    for part in &message.parts {
        if let Part::Text(text) = part {
            let words = split_user_text(text).own_words;
            if !words.is_empty() {
                if !out.is_empty() {
                    out.push_str("\n\n");
                }
                out.push_str(&words);
            }
        }
    }
    out
}

/// The pinned user turn inside a summary, if any.
fn pinned_text(summary: &str) -> Option<&str> {
    let start = summary.find(LATEST_USER_OPEN)? + LATEST_USER_OPEN.len();
    let len = summary[start..].find(LATEST_USER_CLOSE)?;
    Some(summary[start..start + len].trim())
}

/// A summary without its pinned user turn.
fn strip_pinned(summary: &str) -> String {
    match (
        summary.find(LATEST_USER_OPEN),
        summary.find(LATEST_USER_CLOSE),
    ) {
        (Some(a), Some(b)) if b > a => {
            let mut s = summary[..a].trim_end().to_string();
            let rest = summary[b + LATEST_USER_CLOSE.len()..].trim();
            if !rest.is_empty() {
                s.push_str("\n\n");
                s.push_str(rest);
            }
            s
        }
        _ => summary.trim_end().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::mask_rule::MASKED_OUTPUT;
    use crate::testing::{caller, config, FakeSummarizer, Reply, SMALL};
    use crate::transcript::tests::{call, text};

    #[test]
    fn a_pinned_turn_echoed_by_the_summarizer_is_not_duplicated() {
        let echoed = format!("S.\n\n{LATEST_USER_OPEN}\nold\n{LATEST_USER_CLOSE}\n\nMore.");
        assert_eq!(strip_pinned(&echoed), "S.\n\nMore.");
        assert_eq!(pinned_text(&echoed), Some("old"));
        assert_eq!(strip_pinned("plain "), "plain");
    }

    #[test]
    fn attempt_limit_is_3() {
        assert_eq!(MAX_ATTEMPTS_PER_REQUEST, 3);
    }

    #[tokio::test]
    async fn the_safety_net_leaves_time_for_fallbacks() {
        let cfg = config("[summarizer]\ntimeout_secs = 2.0\nfallback = [\"extractive\"]\n");
        let engine = Engine::new(&cfg, FakeSummarizer::text("x"));
        assert_eq!(engine.attempt_timeout, Duration::from_secs(2));
        assert_eq!(engine.total_timeout, Duration::from_secs(4));
    }

    #[tokio::test]
    async fn the_same_slice_is_never_summarised_twice() {
        // With three messages the boundary can only fall on the last one, whatever the
        // budget: after a summary too long to help, a retry with a smaller budget would send
        // the summarizer the very same slice.
        let fake = FakeSummarizer::text(&"long ".repeat(2_000));
        let e = engine("", fake.clone());
        let t = Transcript::new(vec![
            text(Role::System, "sys"),
            text(Role::User, &"u".repeat(400)),
            text(Role::Assistant, "a"),
        ]);
        let limits = Limits {
            token_threshold: 10,
            ..e.limits(None, None)
        };
        let err = e
            .compact(CompactionInput {
                transcript: &t,
                model: None,
                limits,
                fixed_tokens: 0,
                prior: None,
                instructions: None,
                caller: &caller(),
                attempts: &Attempts::per_request(),
                smallest_tail: false,
                in_conversation: None,
            })
            .await
            .expect_err("the summary never makes the request smaller");
        assert!(matches!(err, CompactError::NotSmaller { .. }), "{err}");
        assert_eq!(fake.requests().len(), 1, "one call, not one per attempt");
    }

    fn engine(toml: &str, fake: Arc<FakeSummarizer>) -> Engine {
        Engine::new(&config(toml), fake)
    }

    /// An agentic run: one task, then `steps` tool exchanges of `size` chars of output each.
    fn agentic(steps: usize, size: usize) -> Transcript {
        let mut m = vec![text(Role::System, "sys"), text(Role::User, "fix the bug")];
        for i in 0..steps {
            let id = format!("call_{i}");
            m.push(Message::new(
                Role::Assistant,
                vec![call(
                    &id,
                    "bash",
                    &format!("{{\"command\":\"cat f{i}.rs\"}}"),
                )],
            ));
            let mut r = Message::tool_result(Some(id), format!("output {i} {}", "o".repeat(size)));
            r.tool_name = None;
            m.push(r);
        }
        let mut t = Transcript::new(m);
        t.resolve_tool_names();
        t
    }

    #[tokio::test]
    async fn breaker_retries_with_a_smaller_tail_at_most_three_times() {
        // Each step ~250 tokens; the summary answer is long enough that the first rewrite
        // stays over the threshold.
        let fake = FakeSummarizer::scripted(
            vec![
                Reply::Text("a".repeat(1_200)),
                Reply::Text("b".repeat(800)),
                Reply::Text("c".repeat(400)),
                Reply::Text("never asked".into()),
            ],
            Some(100),
        );
        let toml = "[compaction]\nmin_preserve_tokens = 10\nmax_preserve_tokens = 2000\n\
                    preserve_ratio = 1.0\n[models.tiny]\ncontext_window = 4000\n";
        let e = engine(toml, fake.clone());
        let t = agentic(20, 1_000);
        // Always over the threshold: every attempt that makes progress is followed by another.
        let limits = Limits {
            token_threshold: 10,
            ..e.limits(Some("tiny"), None)
        };
        // The pipeline's builder of the request inside the conversation, recording its turn.
        let turns = std::sync::Mutex::new(Vec::new());
        let ask = |turn: &str, max_output: u32, _: usize| {
            turns
                .lock()
                .expect("turns")
                .push((turn.to_string(), max_output));
            Some(Arc::from(&b"{\"messages\": []}"[..]))
        };
        let c = e
            .compact(CompactionInput {
                transcript: &t,
                model: Some("tiny"),
                limits,
                fixed_tokens: 0,
                prior: None,
                instructions: None,
                caller: &caller(),
                attempts: &Attempts::per_request(),
                smallest_tail: false,
                in_conversation: Some(InConversation(&ask)),
            })
            .await
            .expect("compacts");
        let requests = fake.requests();
        assert_eq!(c.attempts, MAX_ATTEMPTS_PER_REQUEST, "stops after three");
        assert_eq!(requests.len() as u32, c.attempts);
        assert!(
            c.result.summary.starts_with('c'),
            "the last refinement is used"
        );
        // Later attempts refine the earlier summary and only carry the additional turns.
        assert!(requests[1]
            .prompt
            .contains(&format!("<prior-summary>\n{}", "a".repeat(1_200))));
        // The task turn itself is not summarised again: it lives in the prior summary.
        let conversation = requests[1]
            .prompt
            .split("</prior-summary>")
            .nth(1)
            .expect("a prior summary");
        assert!(!conversation.contains("fix the bug"));
        // Only the first attempt is asked inside the conversation: the provider never saw the
        // summary a later one refines. Its turn asks without repeating the conversation.
        let inside: Vec<bool> = requests
            .iter()
            .map(|r| r.in_conversation.is_some())
            .collect();
        assert_eq!(inside, [true, false, false]);
        let turns = turns.lock().expect("turns");
        assert_eq!(turns.len(), 1);
        assert!(turns[0].0.contains("Summarize the conversation above"));
        assert!(!turns[0].0.contains("<conversation>") && !turns[0].0.contains("fix the bug"));
        assert_eq!(turns[0].1, requests[0].max_output_tokens);
        assert_eq!(c.head, 1);
        assert_eq!(t.messages[c.boundary].role, Role::Assistant);
    }

    #[tokio::test]
    async fn no_request_inside_the_conversation_is_built_for_a_backend_that_does_not_send_it() {
        // `extractive` writes from the turns themselves: copying and re-encoding the
        // conversation for it would be work for nothing.
        let summarizer = Arc::new(compactor_plugin_extractive::ExtractiveSummarizer::default());
        assert!(!summarizer.reads_conversation(Api::ChatCompletions));
        let e = Engine::new(&config(SMALL), summarizer);
        let t = agentic(20, 200);
        let asked = std::sync::atomic::AtomicUsize::new(0);
        let ask = |_: &str, _: u32, _: usize| {
            asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            None
        };
        let c = e
            .compact(CompactionInput {
                transcript: &t,
                model: Some("tiny"),
                limits: e.limits(Some("tiny"), None),
                fixed_tokens: 0,
                prior: None,
                instructions: None,
                caller: &caller(),
                attempts: &Attempts::per_request(),
                smallest_tail: false,
                in_conversation: Some(InConversation(&ask)),
            })
            .await;
        assert!(c.is_ok(), "{c:?}");
        assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn breaker_forwards_the_best_rewrite_when_a_retry_fails() {
        let fake = FakeSummarizer::scripted(
            vec![Reply::Text("a".repeat(2_000)), Reply::Error],
            Some(100),
        );
        let toml = "[compaction]\nmin_preserve_tokens = 10\nmax_preserve_tokens = 2000\n\
                    preserve_ratio = 1.0\n[models.tiny]\ncontext_window = 4000\n";
        let e = engine(toml, fake.clone());
        let t = agentic(20, 1_000);
        let c = e
            .compact(CompactionInput {
                transcript: &t,
                model: Some("tiny"),
                limits: Limits {
                    token_threshold: 10,
                    ..e.limits(Some("tiny"), None)
                },
                fixed_tokens: 0,
                prior: None,
                instructions: None,
                caller: &caller(),
                attempts: &Attempts::per_request(),
                smallest_tail: false,
                in_conversation: None,
            })
            .await
            .expect("the first attempt is kept");
        assert_eq!(c.attempts, 1);
        assert_eq!(fake.requests().len(), 2);
        assert!(c.result.post_tokens < c.result.pre_tokens);
    }

    #[tokio::test]
    async fn prior_state_instructions_and_masking_reach_the_summarizer() {
        let fake = FakeSummarizer::text("merged");
        let e = engine("[compaction]\nmax_preserve_tokens = 2000\n", fake.clone());
        let t = agentic(12, 100);
        let prior = Prior {
            summary: "earlier work".into(),
            read_files: vec!["old.rs".into()],
            modified_files: vec!["changed.rs".into()],
            compaction_num: 2,
        };
        let limits = Limits {
            context_window: 128_000,
            summarizer_window: 128_000,
            reserved_output: 0,
            token_threshold: 0,
            wait_threshold: 0,
            max_messages: 4,
            opening_budget: 0,
        };
        let c = e
            .compact(CompactionInput {
                transcript: &t,
                model: None,
                limits,
                fixed_tokens: 0,
                prior: Some(&prior),
                instructions: Some("focus on the parser"),
                caller: &caller(),
                attempts: &Attempts::per_request(),
                smallest_tail: false,
                in_conversation: None,
            })
            .await
            .expect("compacts");
        assert_eq!(c.result.compaction_num, 3);
        assert_eq!(
            c.result.read_files.last().map(String::as_str),
            Some("old.rs"),
            "the prior's files come after the ones read since"
        );
        assert!(c.result.read_files.contains(&"f0.rs".to_string()));
        assert_eq!(c.result.modified_files, vec!["changed.rs".to_string()]);
        let r = &fake.requests()[0];
        assert_eq!(r.compaction_num, 3);
        assert_eq!(r.prior_summary.as_deref(), Some("earlier work"));
        assert_eq!(r.instructions.as_deref(), Some("focus on the parser"));
        assert!(r
            .prompt
            .contains("<prior-summary>\nearlier work\n</prior-summary>"));
        assert!(r.prompt.contains("focus on the parser"));
        // Most recent first: the files read since, then the prior's.
        assert!(
            r.prompt.contains("f0.rs\nold.rs\n</read-files>"),
            "{}",
            r.prompt
        );
        let masked = r.prompt.matches(MASKED_OUTPUT).count();
        let results = r.prompt.matches("[tool_result: bash = ").count();
        assert_eq!(
            results - masked,
            PRESERVE_RECENT_OUTPUTS,
            "{masked} of {results} masked"
        );
        assert!(masked > 0);
        assert!(c.summary_message.contains("- changed.rs"));
    }

    #[tokio::test]
    async fn masking_can_be_switched_off() {
        let fake = FakeSummarizer::text("s");
        let e = engine("[compaction]\nmask_observations = false\n", fake.clone());
        let t = agentic(12, 100);
        let limits = Limits {
            context_window: 128_000,
            summarizer_window: 128_000,
            reserved_output: 0,
            token_threshold: 0,
            wait_threshold: 0,
            max_messages: 4,
            opening_budget: 0,
        };
        e.compact(CompactionInput {
            transcript: &t,
            model: None,
            limits,
            fixed_tokens: 0,
            prior: None,
            instructions: None,
            caller: &caller(),
            attempts: &Attempts::per_request(),
            smallest_tail: false,
            in_conversation: None,
        })
        .await
        .expect("compacts");
        assert!(!fake.requests()[0].prompt.contains(MASKED_OUTPUT));
    }

    #[tokio::test]
    async fn the_prompt_is_fitted_to_the_summarizers_window() {
        // The output budget is the answering backend's own (700 here).
        let fake = FakeSummarizer::scripted(vec![Reply::Text("s".into())], Some(700));
        let toml = "[models.small]\ncontext_window = 3000\n";
        let e = engine(toml, fake.clone());
        let t = agentic(40, 3_000);
        let limits = Limits {
            context_window: 3_000,
            summarizer_window: 3_000,
            reserved_output: 0,
            token_threshold: 0,
            wait_threshold: 0,
            max_messages: 4,
            opening_budget: 0,
        };
        e.compact(CompactionInput {
            transcript: &t,
            model: Some("small"),
            limits,
            fixed_tokens: 0,
            prior: None,
            instructions: None,
            caller: &caller(),
            attempts: &Attempts::per_request(),
            smallest_tail: false,
            in_conversation: None,
        })
        .await
        .expect("compacts");
        let r = &fake.requests()[0];
        assert!(e.estimator().text(&r.prompt) <= 2_300);
        assert!(r
            .prompt
            .contains("earlier turns omitted to fit the summarizer's context window"));
        assert_eq!(r.max_output_tokens, 700);
        // A backend without a budget of its own gets the default, capped at a quarter of the
        // window.
        let e = engine(toml, FakeSummarizer::text("s"));
        assert_eq!(
            e.summarizer_budget(e.models().context_window(Some("small")), Api::Messages),
            (2_250, 750)
        );
        assert_eq!(
            e.summarizer_budget(e.models().context_window(None), Api::ChatCompletions)
                .1,
            DEFAULT_SUMMARY_TOKENS
        );
    }
}
