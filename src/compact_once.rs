//! `compactor compact`: one pass of the compaction engine over one request body, in any of the
//! three dialects, as the `summarize` strategy runs it on a first request of a conversation (no
//! session memory, no background summary, no masking of old tool outputs whatever
//! `compaction.strategy` says): it shows what a summary does to a request, which under `mask`
//! or `hybrid` is not always what the proxy forwards. The command line prints
//! [`CompactReport::forward`] on stdout and [`CompactReport::notes`] on stderr; this module
//! owns everything between reading the body and printing.

use std::fmt::Write as _;
use std::sync::Arc;

use compactor_plugin_api::Caller;

use crate::compaction::prompt::OUTPUT_CHARS_READ;
use crate::compaction::{Attempts, CompactionInput};
use crate::config::Config;
use crate::dialect::DialectKind;
use crate::error::Error;
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use crate::replay::DEFAULT_SUMMARIZER;

/// What one pass decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompactStatus {
    /// Nothing triggered: `forward` is the original body.
    Unchanged,
    /// A compaction happened: `forward` is the rewritten body.
    Compacted,
    /// A compaction was due but did not happen: `forward` is the original body.
    Failed,
}

/// The result of `compactor compact`.
#[derive(Debug)]
pub struct CompactReport {
    /// The rewritten body (the original when nothing was compacted).
    pub forward: Vec<u8>,
    /// Human-readable lines: model and limits, trigger, token estimates, boundary, summary.
    pub notes: String,
    /// What happened.
    pub status: CompactStatus,
}

/// Runs the engine once over `body` read as `dialect`, summarising with the `summarizer`
/// backend (default [`DEFAULT_SUMMARIZER`], local: a first try needs no network), without the
/// configured fallbacks.
///
/// The whole body must be one compactor understands, even when nothing triggers (an error
/// names the dialect). Summarizers that call a provider get no caller credentials here: they
/// need their `api_key_env`.
pub async fn compact(
    config: &Config,
    dialect: DialectKind,
    summarizer: Option<&str>,
    body: &[u8],
) -> Result<CompactReport, Error> {
    let mut config = config.clone();
    config.summarizer.backend = summarizer.unwrap_or(DEFAULT_SUMMARIZER).to_string();
    config.summarizer.fallback.clear();
    let config = &config;
    let metrics = Arc::new(Metrics::new()?);
    let summarizer = crate::summarizer::build(config, metrics.clone())?;
    let pipeline = Pipeline::new(config, summarizer, metrics);
    let engine = pipeline.engine();
    let name = match dialect {
        DialectKind::ChatCompletions => "a Chat Completions",
        DialectKind::Messages => "an Anthropic Messages",
        DialectKind::Responses => "a Responses",
        DialectKind::Gemini => "a Gemini",
    };
    let not_understood =
        |e| Error::BadRequestBody(format!("not {name} request compactor can read: {e}"));

    let scan = dialect
        .scan(body, engine.estimator())
        .map_err(not_understood)?;
    let limits = engine.limits(scan.model.as_deref(), scan.requested_output);
    let transcript = scan
        .transcript_cutting_outputs(limits.opening_budget, OUTPUT_CHARS_READ)
        .map_err(not_understood)?;
    let mut notes = String::new();
    let _ = writeln!(
        notes,
        "model: {} (context window {}, {} reserved for output)",
        scan.model.as_deref().unwrap_or("(none)"),
        limits.context_window,
        limits.reserved_output
    );
    let _ = writeln!(
        notes,
        "messages: {} (max_messages {})",
        scan.len(),
        limits.max_messages
    );
    let trigger = if config.compaction.enabled {
        limits.check(scan.len(), scan.tokens)
    } else {
        None
    };
    let unchanged = |mut notes: String, status, why: &str| {
        let _ = writeln!(
            notes,
            "tokens: {} estimated (threshold {})",
            scan.tokens, limits.token_threshold
        );
        notes.push_str(why);
        CompactReport {
            forward: body.to_vec(),
            notes,
            status,
        }
    };
    let Some(trigger) = trigger else {
        let why = if config.compaction.enabled {
            ""
        } else {
            " (compaction.enabled = false)"
        };
        let _ = writeln!(notes, "trigger: no trigger{why}");
        return Ok(unchanged(notes, CompactStatus::Unchanged, ""));
    };
    let _ = writeln!(notes, "trigger: {}", trigger.label());

    let caller = Caller {
        upstream_base_url: config.upstream.base_url.clone(),
        api_prefix: "/v1".into(),
        credentials: Vec::new(),
        api: dialect.api(),
    };
    let compacted = engine
        .compact(CompactionInput {
            transcript: &transcript,
            model: scan.model.as_deref(),
            limits,
            fixed_tokens: scan.fixed_tokens,
            prior: None,
            instructions: None,
            caller: &caller,
            attempts: &Attempts::per_request(),
            smallest_tail: false,
            in_conversation: None,
        })
        .await;
    let compaction = match compacted {
        Ok(c) => c,
        Err(e) => {
            let why = format!(
                "compaction failed ({}): {e}; printing the original request unchanged\n",
                e.outcome().label()
            );
            return Ok(unchanged(notes, CompactStatus::Failed, &why));
        }
    };
    let forward = match scan.rewrite(
        compaction.head,
        compaction.boundary,
        &compaction.summary_message,
    ) {
        Ok(forward) => forward,
        Err(e) => {
            let why = format!("rewriting failed: {e}; printing the original request unchanged\n");
            return Ok(unchanged(notes, CompactStatus::Failed, &why));
        }
    };
    let result = &compaction.result;
    let n = scan.len();
    let _ = writeln!(
        notes,
        "tokens: {} -> {} estimated (threshold {})",
        result.pre_tokens, result.post_tokens, limits.token_threshold
    );
    let _ = writeln!(
        notes,
        "boundary: {} messages compacted, {} kept ({} head + {} tail), \
         {} summarizer attempt(s)",
        compaction.boundary.saturating_sub(compaction.head),
        compaction.head + n.saturating_sub(compaction.boundary),
        compaction.head,
        n.saturating_sub(compaction.boundary),
        compaction.attempts
    );
    let _ = writeln!(notes, "summary:\n{}", result.summary);
    Ok(CompactReport {
        forward,
        notes,
        status: CompactStatus::Compacted,
    })
}
