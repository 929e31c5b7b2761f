//! Property tests of masking old observations in the forwarded request
//! (`compaction.strategy` `mask` and `hybrid`) in every dialect, through the whole request
//! flow, over the random conversations of the other property tests (parallel tool calls
//! answered in any order, tool errors, images in tool results, Anthropic thinking with
//! signatures, Responses reasoning items with encrypted content, vendor fields).
//!
//! - **Validity**: a masked request differs from the one received only in the values of the
//!   outputs it masks (every other byte, thinking signatures and encrypted reasoning included,
//!   is copied), stays valid for its provider, masks only outputs the rule allows, keeps the
//!   most recent ones verbatim, and is estimated smaller.
//! - **Cache stability**: replaying a conversation request by request, a request whose mask
//!   count is the previous request's forwards the previous forwarded conversation byte for
//!   byte before its new messages, so the prefix changes only at mask steps (at most one per
//!   `mask_block` outputs).
//! - **Hybrid's floor**: under `hybrid`, until a summary, a request never masks fewer outputs
//!   than the one before, and one that masks as many carries its forwarded prefix.
//! - **Replicas**: under `hybrid`, a second compactor sharing the session store forwards the
//!   same bytes for every request that needs no new summary: the mask state is a function of
//!   the request and the stored checkpoint.

use std::cell::Cell;
use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};

use super::{Outcome, Pipeline};
use crate::compaction::mask_rule::MaskRule;
use crate::config::Config;
use crate::dialect::{DialectKind, Scan};
use crate::estimate::LazyEstimator;
use crate::metrics::Metrics;
use crate::session::{MemoryStore, StoreLimits};
use crate::testing::{caller, compactor, config, ensure, valid_for_provider, FakeSummarizer};

use super::dialect_props::{
    valid_anthropic_request, valid_gemini_request, valid_responses_request,
};
use super::props::valid_request;

/// What marks a placeholder in a forwarded body.
const MARK: &str = "[output masked by compactor: ";

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"))
}

fn scan(dialect: DialectKind, body: &[u8]) -> Result<Scan<'_>, TestCaseError> {
    dialect.scan(body, &LazyEstimator::default()).map_err(fail)
}

/// Where `part` (a slice of `whole`) starts in it.
fn offset(whole: &[u8], part: &str) -> usize {
    part.as_ptr() as usize - whole.as_ptr() as usize
}

/// The request carrying the first `k` messages of `body` (every other byte as in `body`).
fn prefix(body: &[u8], s: &Scan<'_>, k: usize) -> Vec<u8> {
    let first = s.messages[0];
    let start = offset(body, first);
    let end_of = |m: &str| offset(body, m) + m.len();
    let kept_end = end_of(s.messages[k - 1]);
    let all_end = end_of(s.messages[s.len() - 1]);
    let mut out = body[..start].to_vec();
    out.extend_from_slice(&body[start..kept_end]);
    out.extend_from_slice(&body[all_end..]);
    out
}

/// The provider's rules for a request of `dialect`.
fn valid(dialect: DialectKind, body: &[u8]) -> Result<(), TestCaseError> {
    valid_for_provider(dialect, body).map_err(fail)
}

fn mask_config(strategy: &str, rule: MaskRule, extra: &str) -> Config {
    config(&format!(
        "[compaction]\nstrategy = \"{strategy}\"\nkeep_recent_outputs = {}\nmask_block = {}\n\
         background_ratio = 0\n{extra}",
        rule.keep_recent, rule.block
    ))
}

/// `out` is `body` with some output values replaced by placeholders and nothing else
/// changed; answers which outputs (by position among all outputs) were masked.
fn only_outputs_changed(
    dialect: DialectKind,
    body: &[u8],
    out: &[u8],
) -> Result<Vec<usize>, TestCaseError> {
    let (before, after) = (scan(dialect, body)?, scan(dialect, out)?);
    ensure(before.len() == after.len(), "same number of messages")?;
    let mut rebuilt = Vec::with_capacity(out.len());
    let mut at = 0usize;
    let mut masked = Vec::new();
    let mut position = 0usize;
    for i in 0..before.len() {
        let (old, new) = (
            before.outputs(i).map_err(fail)?,
            after.outputs(i).map_err(fail)?,
        );
        ensure(old.len() == new.len(), format!("message {i}: outputs"))?;
        for (o, n) in old.iter().zip(&new) {
            ensure(o.call_id == n.call_id, "call ids kept")?;
            if let (Some(ov), Some(nv)) = (o.value, n.value) {
                if ov != nv {
                    let text: String = serde_json::from_str(nv).map_err(fail)?;
                    ensure(text.starts_with(MARK), format!("changed output {nv}"))?;
                    ensure(nv.len() < ov.len(), "a placeholder is shorter")?;
                    masked.push(position);
                    let start = offset(body, ov);
                    rebuilt.extend_from_slice(&body[at..start]);
                    rebuilt.extend_from_slice(nv.as_bytes());
                    at = start + ov.len();
                }
            }
            position += 1;
        }
    }
    rebuilt.extend_from_slice(&body[at..]);
    ensure(
        rebuilt == out,
        "every byte but the masked outputs' values is kept",
    )?;
    Ok(masked)
}

/// The outputs of `s`, checking on the way that `Scan::outputs_bound` never says a message
/// holds fewer than it does (hybrid skips reading a request's outputs on its word).
fn outputs_of(s: &Scan<'_>) -> Result<usize, TestCaseError> {
    let mut n = 0;
    for i in 0..s.len() {
        let found = s.outputs(i).map_err(fail)?.len();
        prop_assert!(
            s.outputs_bound(i, false) >= found,
            "message {i}: {found} outputs"
        );
        n += found;
    }
    Ok(n)
}

fn rule() -> impl Strategy<Value = MaskRule> {
    (1usize..4, 1usize..5).prop_map(|(keep_recent, block)| MaskRule { keep_recent, block })
}

/// A valid request of any dialect.
fn request() -> impl Strategy<Value = (DialectKind, Vec<u8>)> {
    prop_oneof![
        valid_request().prop_map(|b| (DialectKind::ChatCompletions, b)),
        valid_anthropic_request().prop_map(|b| (DialectKind::Messages, b)),
        valid_responses_request().prop_map(|b| (DialectKind::Responses, b)),
        valid_gemini_request().prop_map(|b| (DialectKind::Gemini, b)),
    ]
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(96)
}

#[test]
fn masked_requests_change_only_old_outputs_and_stay_valid() {
    let rt = runtime();
    let masked_some: [Cell<usize>; DialectKind::COUNT] = std::array::from_fn(|_| Cell::new(0));
    let mut runner = TestRunner::new(ProptestConfig {
        cases: cases(),
        ..ProptestConfig::default()
    });
    let result = runner.run(&(request(), rule()), |((dialect, body), rule)| {
        let (c, metrics) = compactor(&mask_config("mask", rule, ""), FakeSummarizer::text("s"));
        let received = scan(dialect, &body)?;
        let total = outputs_of(&received)?;
        let outcome = rt.block_on(c.process(dialect, &body, &caller()));
        let (out, post) = match outcome {
            Outcome::Unchanged => return Ok(()),
            Outcome::Masked {
                body: out,
                pre_tokens,
                post_tokens,
                masked,
            } => {
                ensure(pre_tokens == received.tokens, "pre_tokens")?;
                ensure(masked > 0, "a masked body masks something")?;
                (out, post_tokens)
            }
            other => return Err(fail(format!("`mask` forwarded {other:?}"))),
        };
        let masked = only_outputs_changed(dialect, &body, &out)?;
        valid(dialect, &out)?;
        let allowed = rule.masked(total);
        ensure(
            masked.iter().all(|&p| p < allowed),
            format!("masked {masked:?} of {total}, rule allows the first {allowed}"),
        )?;
        ensure(
            total - allowed >= rule.keep_recent.min(total),
            "recent outputs kept",
        )?;
        let forwarded = scan(dialect, &out)?;
        ensure(post < received.tokens, "estimated smaller")?;
        // The estimate of the placeholders is computed, not re-scanned: rounding per message
        // and per output may differ by a token or two each.
        let slack = 2 * masked.len() + 2;
        ensure(
            forwarded.tokens.abs_diff(post) <= slack,
            format!("post_tokens {post} vs scan {}", forwarded.tokens),
        )?;
        ensure(
            metrics.masked_outputs_counted(dialect, crate::config::Strategy::Mask)
                == masked.len() as u64,
            "counted",
        )?;
        let counter = &masked_some[dialect.index()];
        counter.set(counter.get() + 1);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let masked_some = masked_some.map(Cell::into_inner);
    eprintln!("masked requests per dialect (in DialectKind::ALL's order): {masked_some:?}");
    assert!(
        masked_some.iter().all(|&n| n * 8 >= cases() as usize / 3),
        "too few masked requests: {masked_some:?}"
    );
}

/// Whether `now` carries every message of `before` byte for byte, and the same bytes before
/// them.
fn carries(before: &Scan<'_>, now: &Scan<'_>) -> bool {
    let (b, n) = (before.body(), now.body());
    let Some(last) = before.messages.last() else {
        return true;
    };
    let end = offset(b, last) + last.len();
    n.starts_with(&b[..end])
}

#[test]
fn masking_moves_in_blocks_and_keeps_the_prefix_between_steps() {
    let rt = runtime();
    let steps_seen = Cell::new(0usize);
    let mut runner = TestRunner::new(ProptestConfig {
        cases: cases() / 2,
        ..ProptestConfig::default()
    });
    let result = runner.run(&(request(), rule()), |((dialect, body), rule)| {
        let (c, _) = compactor(&mask_config("mask", rule, ""), FakeSummarizer::text("s"));
        let whole = scan(dialect, &body)?;
        let mut previous: Option<(Vec<u8>, usize)> = None;
        let mut changes = 0usize;
        for k in 1..=whole.len() {
            let request = prefix(&body, &whole, k);
            let sent = scan(dialect, &request)?;
            let step = rule.masked(outputs_of(&sent)?);
            let forwarded = match rt.block_on(c.process(dialect, &request, &caller())) {
                Outcome::Masked { body, .. } => body.to_vec(),
                Outcome::Unchanged => request.clone(),
                other => return Err(fail(format!("`mask` forwarded {other:?}"))),
            };
            if let Some((before, before_step)) = &previous {
                let (b, n) = (scan(dialect, before)?, scan(dialect, &forwarded)?);
                if *before_step == step {
                    ensure(
                        carries(&b, &n),
                        format!("step {k}: prefix changed between mask steps"),
                    )?;
                } else {
                    ensure(step > *before_step, "masking only moves forward")?;
                    changes += 1;
                    steps_seen.set(steps_seen.get() + 1);
                }
            }
            previous = Some((forwarded, step));
        }
        let total = outputs_of(&whole)?;
        ensure(
            changes <= total / rule.block,
            format!(
                "{changes} mask steps for {total} outputs, block {}",
                rule.block
            ),
        )?;
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    assert!(steps_seen.get() > 0, "no mask step was exercised");
}

#[test]
fn under_hybrid_the_mask_only_grows_and_the_prefix_holds_until_it_does() {
    let rt = runtime();
    let masked_seen = Cell::new(0usize);
    let mut runner = TestRunner::new(ProptestConfig {
        cases: cases() / 2,
        ..ProptestConfig::default()
    });
    let result = runner.run(&(request(), rule()), |((dialect, body), rule)| {
        let whole = scan(dialect, &body)?;
        // A window whose trigger the conversation crosses about halfway, whatever model it
        // names; the count trigger out of reach, so masking answers it as long as it can.
        let window = (whole.tokens * 3 / 5).max(200);
        let extra = format!(
            "max_messages = 100000\ndefault_context_window = {window}\n\
             [models.\"tiny\"]\ncontext_window = {window}\n\
             [models.\"claude-test\"]\ncontext_window = {window}\n\
             [models.\"gpt-test\"]\ncontext_window = {window}\n"
        );
        let (c, _) = compactor(
            &mask_config("hybrid", rule, &extra),
            FakeSummarizer::text("s"),
        );
        let mut previous: Option<(Vec<u8>, usize)> = None;
        for k in 1..=whole.len() {
            let request = prefix(&body, &whole, k);
            if valid(dialect, &request).is_err() {
                continue; // a cut in the middle of a tool loop is no request
            }
            let (forwarded, masked) = match rt.block_on(c.process(dialect, &request, &caller())) {
                Outcome::Masked { body, masked, .. } => (body.to_vec(), masked),
                Outcome::Unchanged => (request.clone(), 0),
                // A summary changes the prefix on purpose; what follows is another test's.
                _ => break,
            };
            if let Some((before, before_masked)) = &previous {
                ensure(
                    masked >= *before_masked,
                    format!("step {k}: {masked} outputs masked after {before_masked}"),
                )?;
                if masked == *before_masked {
                    let (b, n) = (scan(dialect, before)?, scan(dialect, &forwarded)?);
                    ensure(
                        carries(&b, &n),
                        format!("step {k}: prefix changed without a mask step"),
                    )?;
                }
            }
            masked_seen.set(masked_seen.get() + masked);
            previous = Some((forwarded, masked));
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    assert!(masked_seen.get() > 0, "no request was masked");
}

/// Two compactors sharing one session store.
fn replicas(config: &Config, summary: &str) -> [Arc<Pipeline>; 2] {
    let limits = StoreLimits {
        max_sessions: 1_000,
        max_bytes: 1 << 26,
        max_sessions_per_tenant: 1_000,
        ttl: std::time::Duration::from_secs(3_600),
    };
    let store = Arc::new(MemoryStore::new(limits));
    [0, 1].map(|_| {
        let metrics = Arc::new(Metrics::new().unwrap_or_else(|e| panic!("metrics: {e}")));
        Arc::new(Pipeline::with_store(
            config,
            FakeSummarizer::text(summary),
            metrics,
            store.clone(),
        ))
    })
}

/// Requests a pipeline found over their trigger and could not summarise (the summary failed,
/// or the conversation's breaker was open): `hybrid` masks every old output instead.
fn gave_up(p: &Pipeline) -> u64 {
    let mut n = 0;
    for t in ["messages", "tokens"] {
        for o in ["failed", "blank", "breaker"] {
            n += p.metrics.compactions_counted(t, o);
        }
    }
    n
}

fn body_of(outcome: &Outcome, received: &[u8]) -> Vec<u8> {
    match outcome {
        Outcome::Rewritten { body, .. }
        | Outcome::Reused { body, .. }
        | Outcome::Masked { body, .. } => body.to_vec(),
        Outcome::Unchanged | Outcome::Failed => received.to_vec(),
    }
}

#[test]
fn under_hybrid_replicas_forward_the_same_bytes_and_rewrites_stay_valid() {
    let rt = runtime();
    let compacted = Cell::new(0usize);
    let compared = Cell::new(0usize);
    let mut runner = TestRunner::new(ProptestConfig {
        cases: cases() / 2,
        ..ProptestConfig::default()
    });
    let small = "min_preserve_tokens = 50\nmax_preserve_tokens = 400\nmax_messages = 12\n\
                 [models.\"tiny\"]\ncontext_window = 2000\n[models.\"claude-test\"]\n\
                 context_window = 2000\n[models.\"gpt-test\"]\ncontext_window = 2000\n";
    let result = runner.run(&(request(), rule()), |((dialect, body), rule)| {
        let [a, b] = replicas(
            &mask_config("hybrid", rule, small),
            "Summary of the earlier turns.",
        );
        let whole = scan(dialect, &body)?;
        for k in 1..=whole.len() {
            let request = prefix(&body, &whole, k);
            // Only what an agent would send: a cut in the middle of a tool loop (calls not
            // answered yet) is no request.
            if valid(dialect, &request).is_err() {
                continue;
            }
            let gave_up_before = gave_up(&a) + gave_up(&b);
            let first = rt.block_on(a.process(dialect, &request, &caller()));
            let out = body_of(&first, &request);
            valid(dialect, &out)
                .map_err(|e| fail(format!("step {k}: {e}: {}", String::from_utf8_lossy(&out))))?;
            if matches!(first, Outcome::Rewritten { .. }) {
                compacted.set(compacted.get() + 1);
            }
            if matches!(first, Outcome::Failed) {
                continue; // the other replica would try again
            }
            let second = rt.block_on(b.process(dialect, &request, &caller()));
            if matches!(second, Outcome::Rewritten { .. } | Outcome::Failed) {
                continue; // still over the trigger: it compacts further
            }
            if gave_up(&a) + gave_up(&b) > gave_up_before {
                // Over the trigger with no summary to be had: what each replica masks instead
                // depends on which of them gave up.
                continue;
            }
            compared.set(compared.get() + 1);
            ensure(
                body_of(&second, &request) == out,
                format!("step {k}: replicas forward different bytes"),
            )?;
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let (compacted, compared) = (compacted.get(), compared.get());
    eprintln!("hybrid: {compacted} compactions, {compared} requests compared");
    assert!(compacted > 0 && compared > 0, "{compacted} / {compared}");
}
