//! Background summaries against a slow summarizer: how long the request that crosses the
//! trigger waits, with background summaries on (`compaction.background_ratio = 0.7`) and off,
//! beside every other request of the same conversation.
//!
//! An agent conversation grows by two messages per turn (`max_messages = 40`), the agent thinks
//! for 300 ms between requests, and the summarizer takes 1.5 s. Each request's time in the
//! pipeline (`Pipeline::handle`: scan, lookup, trigger, splice, and any wait for a summary) is
//! measured; the report gives medians and maxima of the requests that carried a new compaction
//! ("crossing") and of the rest.
//!
//! Run: `cargo bench --bench background` (about a minute).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use compactor::compaction::Attempts;
use compactor::config::Config;
use compactor::dialect::DialectKind;
use compactor::metrics::Metrics;
use compactor::pipeline::{Outcome, Pipeline, RequestContext};
use compactor_plugin_api::{
    BoxFuture, Caller, SummarizeError, Summarizer, Summary, SummaryRequest,
};
use serde_json::{json, Value};

const SUMMARY_TIME: Duration = Duration::from_millis(1_500);
const THINK_TIME: Duration = Duration::from_millis(300);
const TURNS: usize = 70;

/// A summarizer as slow as a real LLM call.
struct SlowSummarizer;

impl Summarizer for SlowSummarizer {
    fn name(&self) -> &str {
        "slow"
    }

    fn summarize<'a>(
        &'a self,
        _request: &'a SummaryRequest,
    ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
        Box::pin(async {
            tokio::time::sleep(SUMMARY_TIME).await;
            Summary::new("1. Primary Request and Intent: fix the bug.\n8. Current Work: tests.")
        })
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort();
    v[v.len() / 2]
}

/// Per-request pipeline times of one conversation: (crossing, others).
async fn run(background_ratio: f64) -> (Vec<Duration>, Vec<Duration>) {
    let config = Config::from_toml(&format!(
        "[compaction]\nmax_messages = 40\nmin_preserve_tokens = 20\nmax_preserve_tokens = 400\n\
         background_ratio = {background_ratio}\n"
    ))
    .expect("config");
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let pipeline = Arc::new(Pipeline::new(&config, Arc::new(SlowSummarizer), metrics));
    let caller = Arc::new(Caller {
        upstream_base_url: "http://127.0.0.1:9".into(),
        api_prefix: "/v1".into(),
        credentials: vec![("authorization".into(), "Bearer sk-bench".into())],
        api: DialectKind::ChatCompletions.api(),
    });
    let mut messages: Vec<Value> =
        vec![json!({"role": "system", "content": "You are a coding agent."})];
    let (mut crossing, mut others) = (Vec::new(), Vec::new());
    let mut last_num = 0;
    for turn in 0..TURNS {
        messages.push(
            json!({"role": "user", "content": format!("Step {turn}: {}", "go on ".repeat(40))}),
        );
        let body = Bytes::from(json!({"model": "gpt-4o", "messages": messages}).to_string());
        // One client request: its own budget of summarizer calls.
        let context = RequestContext {
            caller: &caller,
            session_header: None,
            long_context: false,
            attempts: &Attempts::per_request(),
            mode: None,
        };
        let started = Instant::now();
        let processed = pipeline
            .handle(DialectKind::ChatCompletions, &body, &context)
            .await;
        let took = started.elapsed();
        let num = match &processed.outcome {
            Outcome::Rewritten { result, .. } | Outcome::Reused { result, .. } => {
                result.compaction_num
            }
            _ => last_num,
        };
        if num > last_num {
            crossing.push(took);
            last_num = num;
        } else {
            others.push(took);
        }
        messages.push(json!({"role": "assistant", "content": format!("Done step {turn}.")}));
        tokio::time::sleep(THINK_TIME).await;
    }
    pipeline.background_idle().await;
    (crossing, others)
}

#[tokio::main]
async fn main() {
    println!(
        "slow summarizer {SUMMARY_TIME:?}, think time {THINK_TIME:?}, {TURNS} turns, max_messages 40"
    );
    println!(
        "{:<22} {:>9} {:>16} {:>14} {:>16} {:>14}",
        "background_ratio",
        "crossings",
        "crossing median",
        "crossing max",
        "others median",
        "others max"
    );
    for ratio in [0.0, 0.7] {
        let (crossing, others) = run(ratio).await;
        let max = |v: &[Duration]| v.iter().max().copied().unwrap_or_default();
        println!(
            "{:<22} {:>9} {:>16.2?} {:>14.2?} {:>16.2?} {:>14.2?}",
            ratio,
            crossing.len(),
            median(crossing.clone()),
            max(&crossing),
            median(others.clone()),
            max(&others),
        );
    }
}
