//! Fuzz tests of the request side: every dialect's scan, neutral form and rewrite, and the
//! whole request flow ([`Pipeline::process`]), under generated and mutated bodies.
//!
//! Inputs, per dialect: real-shaped requests from the property-test generators (Claude Code
//! style Messages with cached system blocks, signed thinking, tool loops and server tools;
//! Codex style Responses with encrypted reasoning, function and custom tool calls, `store:
//! false`; Chat Completions with parallel tool calls), put through up to four mutations
//! (`testing::fuzz`: byte flips, truncation, inserted bytes and invalid UTF-8, elements deleted
//! or repeated, values replaced by arbitrary JSON or by raw text no `Value` holds, types
//! changed, a BOM, trailing garbage); request-shaped bodies whose conversation is arbitrary
//! JSON; arbitrary JSON; arbitrary bytes. A body with no mutation is valid for its API.
//!
//! What must hold, besides "no panic":
//! - a scan's messages are JSON slices of the body, in order; its neutral form and head are
//!   built or refused, never a panic;
//! - a rewrite at any plan (`head <= boundary <= len`) is refused or splices: every byte
//!   outside the conversation's messages is copied, a JSON body stays JSON with every other
//!   top-level field byte-identical, and the rewrite scans again as the kept messages around
//!   the summary;
//! - through the pipeline (tiny limits, so most conversations compact, and each rewritten body
//!   sent again, so stored summaries are spliced in too): a body that does not scan is
//!   forwarded unchanged, a rewritten one keeps the splice invariants above and, when the body
//!   was valid for its API, stays valid; the panic guard in `handle` is never reached
//!   (`compactor_compactions_total{trigger="none",outcome="panic"}` stays 0, as a caught panic
//!   would otherwise pass silently).
//!
//! `COMPACTOR_FUZZ_CASES` sets the number of cases of each property (docs/fuzzing.md).

use std::cell::Cell;
use std::ops::Range;

use proptest::prelude::*;
use proptest::strategy::BoxedStrategy;
use proptest::test_runner::{TestCaseError, TestRunner};
use serde::de::IgnoredAny;
use serde_json::{json, Value};

use super::dialect_props::{
    valid_anthropic_request, valid_gemini_request, valid_responses_request,
};
use super::props::valid_request;
use super::Outcome;
use crate::dialect::json::OrderedObject;
use crate::dialect::{DialectKind, Scan};
use crate::estimate::LazyEstimator;
use crate::testing::fuzz::{self, mutate, mutations, pick};
use crate::testing::{caller, compactor, config, ensure, valid_for_provider, FakeSummarizer};
use crate::transcript::Role;

/// Cases of each dialect's property in a default (CI) run.
const SHORT_RUN: u32 = 64;

/// Limits small enough that nearly every conversation of four messages or more compacts.
const TINY: &str = "[compaction]\nmax_messages = 3\nmin_preserve_tokens = 1\n\
                    max_preserve_tokens = 40\n";

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// The top-level field holding the conversation.
fn conversation_key(dialect: DialectKind) -> &'static str {
    dialect.conversation_field()
}

/// A body to fuzz with, and whether it is valid for its API as generated.
#[derive(Debug, Clone)]
struct Input {
    body: Vec<u8>,
    pristine: bool,
}

/// Real-shaped requests of `dialect`, valid for its API.
fn real(dialect: DialectKind) -> BoxedStrategy<Vec<u8>> {
    match dialect {
        DialectKind::ChatCompletions => valid_request().boxed(),
        DialectKind::Messages => valid_anthropic_request().boxed(),
        DialectKind::Responses => valid_responses_request().boxed(),
        DialectKind::Gemini => valid_gemini_request().boxed(),
    }
}

/// A request of `dialect` whose conversation (a list, or for Responses any value) and one
/// other field are arbitrary JSON.
fn shaped(dialect: DialectKind) -> impl Strategy<Value = Vec<u8>> {
    let conversation = prop_oneof![
        3 => proptest::collection::vec(fuzz::json(), 0..12).prop_map(Value::Array),
        1 => "[a-z \"\\\\é]{0,20}".prop_map(Value::from),
        1 => fuzz::json(),
    ];
    (conversation, fuzz::json(), any::<bool>()).prop_map(move |(list, extra, first)| {
        let key = conversation_key(dialect);
        let body = if first {
            json!({key: list, "model": "gpt-4o", "max_tokens": 100, "x": extra})
        } else {
            json!({"model": "claude-test", "x": extra, key: list})
        };
        body.to_string().into_bytes()
    })
}

/// Every kind of input for `dialect` (see the module documentation).
fn input(dialect: DialectKind) -> impl Strategy<Value = Input> {
    fn unknown(body: Vec<u8>) -> Input {
        Input {
            body,
            pristine: false,
        }
    }
    prop_oneof![
        4 => (real(dialect), mutations(1, 4)).prop_map(|(body, ms)| unknown(mutate(&body, &ms))),
        2 => real(dialect).prop_map(|body| Input {
            body,
            pristine: true,
        }),
        2 => (shaped(dialect), mutations(0, 2)).prop_map(|(body, ms)| unknown(mutate(&body, &ms))),
        1 => fuzz::json().prop_map(|v| unknown(v.to_string().into_bytes())),
        1 => fuzz::bytes(256).prop_map(unknown),
    ]
}

/// A summary with what JSON must escape.
fn summary() -> impl Strategy<Value = String> {
    "S[a-z é\"\\\\\n\t\u{0}\u{1f}\u{2028}🦀]{0,40}"
}

/// The byte range of `part` inside `whole`, when it is a slice of it.
fn span(whole: &[u8], part: &str) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (end <= whole.len()).then_some(start..end)
}

fn is_json(bytes: &[u8]) -> bool {
    serde_json::from_slice::<IgnoredAny>(bytes).is_ok()
}

/// Responses: `input` is one string (its one message follows the key, not a `[`).
fn string_input(scan: &Scan<'_>) -> bool {
    let body = scan.body();
    scan.dialect() == DialectKind::Responses
        && scan.messages.len() == 1
        && span(body, scan.messages[0]).is_some_and(|r| {
            body[..r.start]
                .iter()
                .rev()
                .find(|b| !b.is_ascii_whitespace())
                == Some(&b':')
        })
}

/// A scan's messages are JSON slices of the body, in order and apart, each with its
/// estimate; building the neutral form never panics and agrees with the scan on the head.
fn check_scan(scan: &Scan<'_>) -> Result<(), TestCaseError> {
    let body = scan.body();
    ensure(
        scan.message_tokens.len() == scan.len(),
        "one estimate per message",
    )?;
    let sum = scan
        .message_tokens
        .iter()
        .fold(scan.fixed_tokens, |a, t| a.saturating_add(*t));
    ensure(scan.tokens == sum, "the total is fixed plus messages")?;
    let mut end = 0;
    for (i, m) in scan.messages.iter().enumerate() {
        let r = span(body, m).ok_or_else(|| fail(format!("message {i} is not in the body")))?;
        ensure(
            r.start >= end,
            format!("message {i} overlaps the one before"),
        )?;
        end = r.end;
        ensure(
            is_json(m.as_bytes()) && m.trim() == *m,
            format!("message {i} is not one JSON value: {m:?}"),
        )?;
    }
    // No opening kept, the opening kept whatever its size, and a budget in between.
    for budget in [0, scan.tokens / 4, usize::MAX] {
        let transcript = scan.transcript(budget);
        let head = scan.head_len(budget);
        if let (Ok(t), Ok(head)) = (&transcript, &head) {
            ensure(t.len() == scan.len(), "one neutral message per message")?;
            ensure(
                t.head_len() == *head,
                format!("the head of the scan and the transcript (opening budget {budget})"),
            )?;
        }
        if transcript.is_ok() {
            ensure(head.is_ok(), "a readable conversation has a head")?;
        }
    }
    Ok(())
}

/// A rewrite (or a body the pipeline forwards instead of `scan`'s) copies every byte outside
/// the conversation's messages; a JSON body stays JSON with the same top-level fields, every
/// one but the conversation byte-identical.
fn check_splice(scan: &Scan<'_>, out: &[u8]) -> Result<(), TestCaseError> {
    let body = scan.body();
    let (Some(first), Some(last)) = (scan.messages.first(), scan.messages.last()) else {
        return Err(fail("a rewrite of an empty conversation"));
    };
    let start = span(body, first).map_or(0, |r| r.start);
    let end = span(body, last).map_or(body.len(), |r| r.end);
    ensure(
        out.len() >= start + (body.len() - end)
            && out.starts_with(&body[..start])
            && out.ends_with(&body[end..]),
        "the bytes around the conversation are copied",
    )?;
    if !is_json(body) {
        return Ok(());
    }
    ensure(
        is_json(out),
        format!(
            "the rewrite of a JSON body is not JSON: {}",
            String::from_utf8_lossy(out)
        ),
    )?;
    let a: OrderedObject<'_> = serde_json::from_slice(body).map_err(fail)?;
    let b: OrderedObject<'_> = serde_json::from_slice(out).map_err(fail)?;
    ensure(
        a.0.len() == b.0.len(),
        "the same number of top-level fields",
    )?;
    let key = conversation_key(scan.dialect());
    for ((ka, va), (kb, vb)) in a.0.iter().zip(&b.0) {
        ensure(ka == kb, format!("top-level key order: {ka} vs {kb}"))?;
        if ka != key {
            ensure(
                va.get() == vb.get(),
                format!("top-level field {ka} changed"),
            )?;
        }
    }
    Ok(())
}

/// The text of the summary message a rewrite wrote, and whether it was merged into the first
/// kept message (Anthropic).
fn summary_of(dialect: DialectKind, message: &str) -> Option<(String, bool)> {
    let v: Value = serde_json::from_str(message).ok()?;
    if dialect == DialectKind::Gemini {
        // A user entry (a missing role is the user's) whose first part is the summary.
        let parts = v["parts"].as_array()?;
        let first = parts.first()?;
        let user = v.get("role").is_none_or(|r| r == "user");
        return user
            .then(|| {
                first["text"]
                    .as_str()
                    .map(|s| (s.to_string(), parts.len() > 1))
            })
            .flatten();
    }
    if v["role"] != "user" {
        return None;
    }
    match (dialect, &v["content"]) {
        (DialectKind::Responses, c) => (v["type"] == "message" && c[0]["type"] == "input_text")
            .then(|| c[0]["text"].as_str().map(|s| (s.to_string(), false)))
            .flatten(),
        (_, Value::String(s)) => Some((s.clone(), false)),
        (DialectKind::Messages, Value::Array(blocks)) => {
            let first = blocks.first()?;
            (first["type"] == "text")
                .then(|| first["text"].as_str().map(|s| (s.to_string(), true)))
                .flatten()
        }
        _ => None,
    }
}

/// `scan.rewrite(head, boundary, summary)` is refused or holds the splice invariants, and
/// the rewrite scans as the head, the summary, then the tail (Anthropic may merge the summary
/// into the tail's first message).
fn check_rewrite(
    scan: &Scan<'_>,
    head: usize,
    boundary: usize,
    summary: &str,
) -> Result<(), TestCaseError> {
    let len = scan.len();
    ensure(
        scan.rewrite(boundary + 1, boundary, summary).is_err()
            && scan.rewrite(0, len + 1, summary).is_err(),
        "a plan out of range is refused",
    )?;
    let Ok(out) = scan.rewrite(head, boundary, summary) else {
        return Ok(());
    };
    check_splice(scan, &out)?;
    let dialect = scan.dialect();
    let after = dialect
        .scan(&out, &LazyEstimator::default())
        .map_err(|e| fail(format!("the rewrite does not scan: {e}")))?;
    let at = |i: usize| after.messages.get(i).copied().unwrap_or_default();
    if string_input(scan) {
        // The string becomes a user message item wherever it is kept.
        let kept = head + (len - boundary);
        ensure(after.len() == kept + 1, "head, summary, tail items")?;
        let original: Value = serde_json::from_str(scan.messages[0]).map_err(fail)?;
        for i in (0..head).chain(head + 1..after.len()) {
            let item: Value = serde_json::from_str(at(i)).map_err(fail)?;
            ensure(
                item["role"] == "user" && item["content"] == original,
                "the string input kept as a user message",
            )?;
        }
        ensure(
            summary_of(dialect, at(head)).is_some_and(|(s, _)| s == summary),
            "the summary item",
        )?;
        return Ok(());
    }
    // Anthropic roles alternate: after a head ending on a user message the summary is a block
    // of that message, after its own blocks.
    let joined = matches!(dialect, DialectKind::Messages | DialectKind::Gemini)
        && head > 0
        && scan.message(head - 1).is_ok_and(|m| m.role == Role::User);
    let at_summary = if joined { head - 1 } else { head };
    let (text, merged) = if joined {
        joined_summary(dialect, scan.messages[head - 1], at(at_summary))
    } else {
        summary_of(dialect, at(head))
    }
    .ok_or_else(|| {
        fail(format!(
            "no summary message at {at_summary}: {:?}",
            after.messages.get(at_summary)
        ))
    })?;
    ensure(text == summary, "the summary message holds the summary")?;
    // A Gemini user entry right after the summary takes it in; when that entry has no parts,
    // the merged entry holds the summary alone, as an entry of its own would: tell by
    // whether the original entry still follows the summary.
    let merged = merged
        || (dialect == DialectKind::Gemini
            && scan.message(boundary).is_ok_and(|m| m.role == Role::User)
            && after.messages.get(at_summary + 1) != scan.messages.get(boundary));
    let tail = boundary + usize::from(merged);
    ensure(
        after.len() == at_summary + 1 + (len - tail.min(len)),
        format!(
            "{} messages after a rewrite of {len} at {head}..{boundary}",
            after.len()
        ),
    )?;
    ensure(
        after.messages[..at_summary] == scan.messages[..at_summary],
        "the head is copied",
    )?;
    ensure(
        after.messages[at_summary + 1..] == scan.messages[tail..],
        "the tail is copied",
    )?;
    Ok(())
}

/// The summary block of an Anthropic user message (a Gemini user entry's part) `message`
/// that is `original` with the summary joined after its blocks, and whether more blocks
/// follow it (the tail's first message merged in); `None` when `original`'s blocks are not
/// kept in front of it.
fn joined_summary(dialect: DialectKind, original: &str, message: &str) -> Option<(String, bool)> {
    let gemini = dialect == DialectKind::Gemini;
    let key = if gemini { "parts" } else { "content" };
    let blocks_of = |v: &Value| match &v[key] {
        Value::String(s) if s.is_empty() => Some(Vec::new()),
        Value::String(s) => Some(vec![json!({"type": "text", "text": s})]),
        Value::Array(blocks) => Some(blocks.clone()),
        Value::Null => Some(Vec::new()),
        _ => None,
    };
    let original = blocks_of(&serde_json::from_str(original).ok()?)?;
    let v: Value = serde_json::from_str(message).ok()?;
    let blocks = v[key].as_array()?;
    let k = original.len();
    let user = v["role"] == "user" || (gemini && v.get("role").is_none());
    if !user || blocks.len() <= k || blocks[..k] != original[..] {
        return None;
    }
    let summary = &blocks[k];
    (summary["type"] == "text" || (gemini && summary["text"].is_string()))
        .then(|| {
            summary["text"]
                .as_str()
                .map(|s| (s.to_string(), blocks.len() > k + 1))
        })
        .flatten()
}

/// Scans `body` in `dialect` and, when it scans, rewrites it at the plan `plan` picks.
fn check_dialect(
    dialect: DialectKind,
    body: &[u8],
    plan: (usize, usize),
    summary: &str,
) -> Result<(), TestCaseError> {
    let Ok(scan) = dialect.scan(body, &LazyEstimator::default()) else {
        return Ok(());
    };
    check_scan(&scan)?;
    let boundary = pick(plan.1, scan.len() + 1);
    let head = pick(plan.0, boundary + 1);
    check_rewrite(&scan, head, boundary, summary)
}

/// A forwarded body is valid for the API (a body that was valid before).
fn check_api(dialect: DialectKind, out: &[u8]) -> Result<(), TestCaseError> {
    valid_for_provider(dialect, out).map_err(|e| fail(format!("invalid for the API: {e}")))
}

/// How often each path was taken, so a run that never reaches them fails.
#[derive(Default)]
struct Tally {
    scanned: Cell<usize>,
    rewritten: Cell<usize>,
    reused: Cell<usize>,
    valid_checked: Cell<usize>,
}

fn bump(c: &Cell<usize>) {
    c.set(c.get() + 1);
}

/// One body through a fresh pipeline (then again, when it was rewritten, so the stored
/// summary is spliced in): see the module documentation for what must hold.
fn check_pipeline(
    rt: &tokio::runtime::Runtime,
    dialect: DialectKind,
    input: &Input,
    summary: &str,
    tally: &Tally,
) -> Result<(), TestCaseError> {
    let body = &input.body;
    let (c, metrics) = compactor(&config(TINY), FakeSummarizer::text(summary));
    let scan = dialect.scan(body, &LazyEstimator::default());
    if scan.is_ok() {
        bump(&tally.scanned);
    }
    if input.pristine {
        ensure(scan.is_ok(), "a body valid for its API does not scan")?;
    }
    for _ in 0..2 {
        let outcome = rt.block_on(c.process(dialect, body, &caller()));
        ensure(
            metrics.compactions_counted("none", "panic") == 0,
            "the pipeline panicked (caught by the guard in `handle`)",
        )?;
        let out = match outcome {
            Outcome::Unchanged => return Ok(()),
            // `hybrid` (the default) forwards the masked request when no summary can help
            // (here: a provider's sealed summary makes nearly all of it the head).
            Outcome::Masked { body: out, .. } => out,
            Outcome::Failed => {
                return ensure(
                    scan.is_ok(),
                    "a compaction failed on a body that does not scan",
                )
            }
            Outcome::Rewritten { body: out, .. } => {
                bump(&tally.rewritten);
                out
            }
            Outcome::Reused { body: out, .. } => {
                bump(&tally.reused);
                out
            }
        };
        let scan = scan
            .as_ref()
            .map_err(|e| fail(format!("a body that does not scan ({e}) was rewritten")))?;
        check_splice(scan, &out)?;
        if input.pristine {
            check_api(dialect, &out)?;
            bump(&tally.valid_checked);
        }
    }
    Ok(())
}

/// Runs the fuzz properties of `dialect`'s inputs: every dialect's scan and rewrite on each
/// input, and the pipeline in `dialect`.
fn fuzz_dialect(dialect: DialectKind) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let tally = Tally::default();
    let mut runner = TestRunner::new(fuzz::config(SHORT_RUN, file!()));
    let strategy = (input(dialect), any::<(usize, usize)>(), summary());
    let started = std::time::Instant::now();
    let result = runner.run(&strategy, |(input, plan, summary)| {
        for d in DialectKind::ALL {
            check_dialect(d, &input.body, plan, &summary)
                .map_err(|e| fail(format!("{d:?} scan/rewrite: {e}")))?;
        }
        check_pipeline(&rt, dialect, &input, &summary, &tally)
    });
    if let Err(e) = result {
        panic!("{dialect:?}: {e}");
    }
    let (s, r, u, v) = (
        tally.scanned.get(),
        tally.rewritten.get(),
        tally.reused.get(),
        tally.valid_checked.get(),
    );
    eprintln!(
        "{dialect:?}: {} cases in {:.1?}: {s} scanned, {r} rewritten, {u} reused, {v} checked valid",
        fuzz::cases(SHORT_RUN),
        started.elapsed()
    );
    // The fuzzing must reach the rewrite paths, not stop at the parsers.
    assert!(r > 0 && u > 0 && v > 0, "{dialect:?}: paths not reached");
}

/// Chat Completions inputs (and each through the other dialects' scans).
#[test]
fn chat_completions_parsers_and_pipeline_survive_fuzzing() {
    fuzz_dialect(DialectKind::ChatCompletions);
}

/// Anthropic Messages inputs (and each through the other dialects' scans).
#[test]
fn messages_parsers_and_pipeline_survive_fuzzing() {
    fuzz_dialect(DialectKind::Messages);
}

/// OpenAI Responses inputs (and each through the other dialects' scans).
#[test]
fn responses_parsers_and_pipeline_survive_fuzzing() {
    fuzz_dialect(DialectKind::Responses);
}

/// Google Gemini inputs (and each through the other dialects' scans).
#[test]
fn gemini_parsers_and_pipeline_survive_fuzzing() {
    fuzz_dialect(DialectKind::Gemini);
}
