//! Test support: a scriptable fake summarizer and small request builders.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use compactor_plugin_api::{
    BoxFuture, Caller, SummarizeError, Summarizer, Summary, SummaryRequest,
};
use proptest::test_runner::TestCaseError;
use serde_json::{json, Value};

use crate::config::Config;
use crate::dialect::{DialectKind, Parsed};
use crate::estimate::LazyEstimator;
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;

pub(crate) mod fuzz;

/// What the fake answers.
#[derive(Debug, Clone)]
pub(crate) enum Reply {
    /// This summary.
    Text(String),
    /// A summary of whitespace (bypassing `Summary::new`, as a sloppy backend might).
    Blank,
    /// A transport error.
    Error,
    /// Never answers.
    Hang,
    /// Panics (a bug in a backend or in the engine).
    Panic,
    /// This summary, after this long (tokio's clock: paused in tests that pace a session).
    Slow(std::time::Duration, String),
    /// This summary, with what its model billed for it (as the `openai` and `anthropic`
    /// backends report it).
    Billed(String, compactor_plugin_api::SummaryUsage),
}

/// A summarizer that answers from a script (the last reply repeats) and records requests.
pub(crate) struct FakeSummarizer {
    replies: Mutex<VecDeque<Reply>>,
    last: Mutex<Reply>,
    pub(crate) requests: Mutex<Vec<SummaryRequest>>,
    /// What [`Summarizer::max_output_tokens`] reports, for every API.
    budget: Option<u32>,
}

impl FakeSummarizer {
    pub(crate) fn new(replies: Vec<Reply>) -> Arc<FakeSummarizer> {
        FakeSummarizer::scripted(replies, None)
    }

    /// A fake answering from `replies` that reports an output budget of `budget` tokens.
    pub(crate) fn scripted(replies: Vec<Reply>, budget: Option<u32>) -> Arc<FakeSummarizer> {
        let last = replies.last().cloned().unwrap_or(Reply::Error);
        Arc::new(FakeSummarizer {
            replies: Mutex::new(replies.into()),
            last: Mutex::new(last),
            requests: Mutex::new(Vec::new()),
            budget,
        })
    }

    pub(crate) fn text(summary: &str) -> Arc<FakeSummarizer> {
        FakeSummarizer::new(vec![Reply::Text(summary.into())])
    }

    pub(crate) fn requests(&self) -> Vec<SummaryRequest> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

impl Summarizer for FakeSummarizer {
    fn name(&self) -> &str {
        "fake"
    }

    fn max_output_tokens(&self, _api: compactor_plugin_api::Api) -> Option<u32> {
        self.budget
    }

    /// The fake stands for an LLM backend calling the caller's own model.
    fn reads_conversation(&self, _api: compactor_plugin_api::Api) -> bool {
        true
    }

    fn summarize<'a>(
        &'a self,
        request: &'a SummaryRequest,
    ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
        Box::pin(async move {
            if let Ok(mut r) = self.requests.lock() {
                r.push(request.clone());
            }
            let reply = {
                let next = self.replies.lock().ok().and_then(|mut q| q.pop_front());
                match next {
                    Some(r) => r,
                    None => self.last.lock().map(|l| l.clone()).unwrap_or(Reply::Error),
                }
            };
            match reply {
                Reply::Text(t) => Ok(Summary {
                    text: t,
                    usage: None,
                }),
                Reply::Blank => Ok(Summary {
                    text: " \n\t".into(),
                    usage: None,
                }),
                Reply::Error => Err(SummarizeError::Transport("connection refused".into())),
                Reply::Hang => std::future::pending().await,
                Reply::Panic => panic!("fake summarizer panics, as a bug would"),
                Reply::Billed(t, usage) => Ok(Summary {
                    text: t,
                    usage: Some(usage),
                }),
                Reply::Slow(after, t) => {
                    tokio::time::sleep(after).await;
                    Ok(Summary {
                        text: t,
                        usage: None,
                    })
                }
            }
        })
    }
}

/// Small limits so compaction fires on small requests (`tiny` has a 1,000-token window), and
/// summaries start ahead at 7 of the 10 messages.
pub(crate) const SMALL: &str = "[compaction]\nmax_messages = 10\nbackground_ratio = 0.7\n\
                                min_preserve_tokens = 20\n\
                                max_preserve_tokens = 60\n[models.tiny]\ncontext_window = 1000\n";

/// A system message, then `n` alternating user and assistant messages of about 12 tokens.
pub(crate) fn chat(n: usize) -> Vec<Value> {
    let mut m = vec![json!({"role": "system", "content": "You are helpful."})];
    for i in 0..n {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        m.push(json!({"role": role, "content": format!("message {i} {}", "x".repeat(40))}));
    }
    m
}

/// The `messages` array of a chat body.
pub(crate) fn messages_of(body: &[u8]) -> Vec<Value> {
    let v: Value = serde_json::from_slice(body).expect("valid JSON");
    v["messages"].as_array().cloned().expect("messages")
}

/// The default config with `toml` applied on top.
pub(crate) fn config(toml: &str) -> Config {
    match Config::from_toml(toml) {
        Ok(c) => c,
        Err(e) => panic!("test config: {e}"),
    }
}

/// A compactor over `summarizer` with its own metrics.
pub(crate) fn compactor(
    config: &Config,
    summarizer: Arc<FakeSummarizer>,
) -> (Arc<Pipeline>, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new().unwrap_or_else(|e| panic!("metrics: {e}")));
    (
        Arc::new(Pipeline::new(config, summarizer, metrics.clone())),
        metrics,
    )
}

pub(crate) fn caller() -> Arc<Caller> {
    Arc::default()
}

/// A chat request body of `model` with `messages`.
pub(crate) fn body(model: &str, messages: Vec<Value>) -> Vec<u8> {
    json!({"model": model, "messages": messages})
        .to_string()
        .into_bytes()
}

/// The value of `compactor_compactions_total{trigger,outcome}`.
pub(crate) fn compactions(metrics: &Metrics, trigger: &str, outcome: &str) -> u64 {
    metrics.compactions_counted(trigger, outcome)
}

/// Checks a request body of `dialect` against the rules its provider enforces
/// (`compactor_plugin_testing::rules`), the context window aside.
pub(crate) fn valid_for_provider(dialect: DialectKind, body: &[u8]) -> Result<(), String> {
    use compactor_plugin_testing::rules::{chat, gemini, messages, responses};
    let request: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let verdict = match dialect {
        DialectKind::ChatCompletions => chat::check_chat(&request, usize::MAX),
        DialectKind::Messages => messages::check_messages(&request, usize::MAX),
        DialectKind::Responses => responses::check_responses(&request, usize::MAX),
        DialectKind::Gemini => gemini::check_gemini(&request, usize::MAX),
    };
    verdict.map_err(|r| format!("{r:?}"))
}

/// Checks OpenAI Chat Completions' rules on `messages` alone: every `tool` message answers a
/// call of the assistant message before its run of tool messages, and every call is answered.
pub(crate) fn check_openai_pairing(messages: &[Value]) -> Result<(), String> {
    let request = json!({ "messages": messages });
    compactor_plugin_testing::rules::chat::check_chat(&request, usize::MAX)
        .map_err(|r| format!("{r:?}"))
}

/// A property-test assertion: fails the case with `what` unless `cond` holds.
pub(crate) fn ensure(cond: bool, what: impl Into<String>) -> Result<(), TestCaseError> {
    if cond {
        Ok(())
    } else {
        Err(TestCaseError::fail(what.into()))
    }
}

/// The scan's estimate adds up, and each message's estimate (counted off the wire) is what its
/// neutral parts hold.
pub(crate) fn check_estimates(
    parsed: &Parsed<'_>,
    est: &LazyEstimator,
) -> Result<(), TestCaseError> {
    let scan = &parsed.scan;
    let transcript = &parsed.transcript;
    ensure(
        scan.tokens == scan.fixed_tokens + transcript.tokens(0..transcript.len()),
        "the scan's total is its fixed tokens plus its messages'",
    )?;
    for m in &transcript.messages {
        ensure(
            est.counts(m.counts()) == m.tokens,
            format!("the scan's estimate of {m:?} counts what its neutral parts hold"),
        )?;
    }
    Ok(())
}

/// How an independent reading of a request sees one of its raw messages, for the head the
/// property tests expect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Said {
    /// By the client: a system, developer or user message that answers no tool call.
    Client,
    /// By the model.
    Model,
    /// A tool's answer.
    ToolAnswer,
}

/// The heads the property tests accept after `leading` system messages: first with the
/// opening (the client's messages before the model's first reply) when the model has replied
/// and the opening's estimate fits the opening budget of the limits the request was compacted
/// with, then without it (the engine compacts the opening when keeping it leaves no way under
/// the trigger).
pub(crate) fn expected_heads(
    said: &[Said],
    leading: usize,
    scan: &crate::dialect::Scan<'_>,
    opening_budget: usize,
) -> [usize; 2] {
    let with_opening = match said.iter().position(|s| *s != Said::Client) {
        Some(end)
            if said[end] == Said::Model
                && end >= leading
                && scan.tokens_of(leading..end) <= opening_budget =>
        {
            end
        }
        _ => leading,
    };
    [with_opening, leading]
}
