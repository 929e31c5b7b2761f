//! Engine benchmarks: parse + trigger check + rewrite of 100, 1,000 and 10,000-message
//! conversations (with a summarizer that answers instantly, each on a fresh compactor so every
//! iteration really compacts); the same conversations once a checkpoint exists (hash the
//! history, splice the stored summary), with the hashing alone beside it; and the no-compaction hot path for a ~500 KB request
//! side by side with a bare `serde_json::Value` parse + serialise of the same bytes; and the
//! token estimate alone over 200 KB of text, beside the bare character count.
//!
//! Run: `cargo bench --bench engine -- --warm-up-time 1 --measurement-time 3`

mod common;

use std::hint::black_box;
use std::sync::Arc;

use bytes::Bytes;
use common::InstantSummarizer;
use compactor::compaction::Attempts;
use compactor::config::Config;
use compactor::dialect::DialectKind;
use compactor::estimate::{count_chars, LazyEstimator};
use compactor::metrics::Metrics;
use compactor::pipeline::{Outcome, Pipeline, RequestContext};
use compactor::session::hash::{chain, TenantId};
use compactor_plugin_api::Caller;
use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use serde_json::{json, Value};

/// An agentic conversation: system, task, then rounds of assistant text, a tool call and its
/// output, with a user message every 10 rounds. `output` is the size of each tool output.
fn conversation(messages: usize, output: usize) -> Vec<Value> {
    let mut m = vec![
        json!({"role": "system", "content": "You are a coding agent. Use the tools."}),
        json!({"role": "user", "content": "Fix the failing test in src/parser.rs, then run the suite."}),
    ];
    let body: String = "fn parse(input: &str) -> Result<Ast, Error> { /* \"quoted\" é */ }\n"
        .chars()
        .cycle()
        .take(output)
        .collect();
    let mut i = 0;
    while m.len() < messages {
        let id = format!("call_{i}");
        m.push(json!({
            "role": "assistant",
            "content": format!("Step {i}: reading the next file."),
            "tool_calls": [{"id": id, "type": "function",
                "function": {"name": "bash", "arguments": json!({"command": format!("cat src/file_{i}.rs")}).to_string()}}]
        }));
        m.push(json!({"role": "tool", "tool_call_id": id, "content": body}));
        if i % 10 == 9 {
            m.push(json!({"role": "user", "content": format!("Keep going ({i}).")}));
        }
        i += 1;
    }
    m.truncate(messages);
    if m.last().is_some_and(|x| x["role"] == "assistant") {
        m.pop();
        m.push(json!({"role": "user", "content": "continue"}));
    }
    m
}

fn request(model: &str, messages: Vec<Value>) -> Vec<u8> {
    json!({
        "model": model,
        "stream": true,
        "tools": [{"type": "function", "function": {"name": "bash", "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}],
        "messages": messages,
        "stream_options": {"include_usage": true}
    })
    .to_string()
    .into_bytes()
}

fn fresh_compactor() -> Arc<Pipeline> {
    let config = Config::from_toml("").expect("default config");
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    Arc::new(Pipeline::new(&config, Arc::new(InstantSummarizer), metrics))
}

fn setup() -> (Arc<Pipeline>, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    (fresh_compactor(), rt)
}

fn compaction(c: &mut Criterion) {
    let (compactor, rt) = setup();
    let caller = Arc::new(Caller::default());
    let mut group = c.benchmark_group("compact");
    for n in [100usize, 1_000, 10_000] {
        let body = request("gpt-4o", conversation(n, 400));
        group.throughput(Throughput::Elements(n as u64));
        let outcome = rt.block_on(compactor.process(DialectKind::ChatCompletions, &body, &caller));
        assert!(
            matches!(outcome, Outcome::Rewritten { .. }),
            "{n} messages must compact"
        );
        group.bench_with_input(BenchmarkId::from_parameter(n), &body, |b, body| {
            b.iter_batched(
                fresh_compactor,
                |fresh| {
                    let out = rt.block_on(fresh.process(
                        DialectKind::ChatCompletions,
                        black_box(body),
                        &caller,
                    ));
                    (fresh, out)
                },
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();

    // The next request of the same conversation: hash its history, find the checkpoint the
    // compaction above stored, splice the summary in.
    let mut group = c.benchmark_group("reuse_checkpoint");
    for n in [100usize, 1_000, 10_000] {
        let body = Bytes::from(request("gpt-4o", conversation(n, 400)));
        let context = RequestContext {
            caller: &caller,
            session_header: None,
            long_context: false,
            attempts: &Attempts::per_request(),
            mode: None,
        };
        rt.block_on(compactor.handle(DialectKind::ChatCompletions, &body, &context));
        let again = rt.block_on(compactor.handle(DialectKind::ChatCompletions, &body, &context));
        assert!(
            matches!(again.outcome, Outcome::Reused { .. }),
            "{n} messages must reuse the checkpoint"
        );
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &body, |b, body| {
            b.iter(|| {
                black_box(rt.block_on(compactor.handle(
                    DialectKind::ChatCompletions,
                    black_box(body),
                    &context,
                )))
            })
        });
        // The share of that spent on canonical hashing of the history alone.
        let est = LazyEstimator::default();
        let scan = DialectKind::ChatCompletions
            .scan(&body, &est)
            .expect("scan");
        group.bench_with_input(
            BenchmarkId::new("chain_hash_only", n),
            &scan.messages,
            |b, raw| {
                b.iter(|| black_box(chain(&TenantId::ANONYMOUS, black_box(raw)).expect("chain")))
            },
        );
    }
    group.finish();
}

fn hot_path(c: &mut Criterion) {
    let (_, rt) = setup();
    // 70 messages stay below the background watermark (0.7 × max_messages), so this is the
    // plain path: scan, lookup, trigger, nothing to do.
    let config = Config::from_toml("[compaction]\nmax_messages = 200\n").expect("config");
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let compactor = Arc::new(Pipeline::new(&config, Arc::new(InstantSummarizer), metrics));
    let caller = Arc::new(Caller::default());
    // ~500 KB, 70 messages (under max_messages), for a 1M-token model: no compaction due.
    let body = request("gpt-4.1", conversation(70, 14_000));
    assert!(
        (450_000..600_000).contains(&body.len()),
        "{} bytes",
        body.len()
    );
    let outcome = rt.block_on(compactor.process(DialectKind::ChatCompletions, &body, &caller));
    assert!(matches!(outcome, Outcome::Unchanged));

    let mut group = c.benchmark_group("no_compaction_500kb");
    group.throughput(Throughput::Bytes(body.len() as u64));
    let shared = Bytes::from(body.clone());
    let context = RequestContext {
        caller: &caller,
        session_header: None,
        long_context: false,
        attempts: &Attempts::per_request(),
        mode: None,
    };
    group.bench_function("compactor_handle", |b| {
        b.iter(|| {
            black_box(rt.block_on(compactor.handle(
                DialectKind::ChatCompletions,
                black_box(&shared),
                &context,
            )))
        })
    });
    group.bench_function("scan_only", |b| {
        let est = LazyEstimator::default();
        b.iter(|| {
            black_box(
                DialectKind::ChatCompletions
                    .scan(black_box(&body), &est)
                    .expect("scan"),
            )
        })
    });
    group.bench_function("serde_value_roundtrip", |b| {
        b.iter(|| {
            let v: Value = serde_json::from_slice(black_box(&body)).expect("parse");
            black_box(serde_json::to_vec(&v).expect("serialise"))
        })
    });
    group.finish();
}

/// A small chat request (4 messages, ~1 KB) with a credential: the per-request cost of the chat
/// path (scan, session id, store, lookup, trigger, metrics) that every agent call pays.
fn small_request(c: &mut Criterion) {
    let (compactor, rt) = setup();
    let caller = Arc::new(Caller {
        credentials: vec![("authorization".into(), "Bearer sk-bench".into())],
        ..Caller::default()
    });
    let body = Bytes::from(request("gpt-4o-mini", conversation(4, 200)));
    let context = RequestContext {
        caller: &caller,
        session_header: None,
        long_context: false,
        attempts: &Attempts::per_request(),
        mode: None,
    };
    let mut group = c.benchmark_group("small_chat");
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("compactor_handle", |b| {
        b.iter(|| {
            black_box(rt.block_on(compactor.handle(
                DialectKind::ChatCompletions,
                black_box(&body),
                &context,
            )))
        })
    });
    group.finish();
}

/// A coding agent's request: a 24 KB opening (instructions and project files in the system
/// prompt and the first user message, as Claude Code and Codex send them), the model's first
/// reply and a few turns, well under the trigger. Every request of the session pays for its
/// session id, derived from the opening.
fn agent_request(c: &mut Criterion) {
    let (compactor, rt) = setup();
    let caller = Arc::new(Caller {
        credentials: vec![("authorization".into(), "Bearer sk-bench".into())],
        ..Caller::default()
    });
    let instructions = "Follow the project rules in CLAUDE.md. Keep changes small.\n".repeat(200);
    let mut messages = vec![
        json!({"role": "system", "content": instructions}),
        json!({"role": "user", "content": format!("<system-reminder>{}</system-reminder> Fix the parser.", "rule ".repeat(2_400))}),
    ];
    messages.extend(conversation(8, 300).into_iter().skip(2));
    let body = Bytes::from(request("gpt-4o", messages));
    let context = RequestContext {
        caller: &caller,
        session_header: None,
        long_context: false,
        attempts: &Attempts::per_request(),
        mode: None,
    };
    let mut group = c.benchmark_group("agent_request");
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("compactor_handle", |b| {
        b.iter(|| {
            black_box(rt.block_on(compactor.handle(
                DialectKind::ChatCompletions,
                black_box(&body),
                &context,
            )))
        })
    });
    group.finish();
}

/// The token estimate alone over ~200 KB of text, the size of a large request body: once pure
/// ASCII (prose, code and JSON tool output, the common case) and once with some accented and
/// CJK text mixed in (the non-ASCII path).
fn estimate(c: &mut Criterion) {
    let ascii_piece = "The parser reads the whole file before it checks anything. \
fn parse(input: &str) -> Result<Ast, Error> { let x = input.len() * 2; }\n\
{\"path\": \"src/lib.rs\", \"lines\": [12, 48], \"status\": \"ok\"}\n\
00000010: 4865 6c6c 6f2c 2077 6f72 6c64 210a 0000  Hello, world!...\n";
    let mixed_piece = "Café déjà vu, naïve résumé. 日本語のテキストと中文文本。 Привет, мир.\n";
    let ascii: String = ascii_piece.chars().cycle().take(200_000).collect();
    let mixed: String = ascii_piece
        .chars()
        .chain(mixed_piece.chars())
        .cycle()
        .take(200_000)
        .collect();
    let est = LazyEstimator::default();
    let mut group = c.benchmark_group("estimate_200kb");
    for (name, text) in [("ascii", &ascii), ("mixed", &mixed)] {
        group.throughput(Throughput::Bytes(text.len() as u64));
        group.bench_function(name, |b| b.iter(|| black_box(est.text(black_box(text)))));
        // The character count alone (the estimate before it weighed classes), for scale.
        group.bench_function(format!("{name}_count_chars"), |b| {
            b.iter(|| black_box(count_chars(black_box(text))))
        });
    }
    group.finish();
}

/// The load bench's 200 KB body: 769 short messages of plain ASCII text, no escapes.
fn plain_scan(c: &mut Criterion) {
    let lorem = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor ";
    let messages: Vec<Value> = (0..769)
        .map(|i| {
            let role = ["system", "user", "assistant"][if i == 0 { 0 } else { 1 + i % 2 }];
            json!({"role": role, "content": lorem.repeat(4)[..260].to_string()})
        })
        .collect();
    let body = json!({"model": "gpt-4o", "messages": messages}).to_string();
    let est = LazyEstimator::default();
    let mut group = c.benchmark_group("scan_plain_200kb");
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("scan_only", |b| {
        b.iter(|| black_box(DialectKind::ChatCompletions.scan(black_box(body.as_bytes()), &est)))
    });
    group.finish();
}

criterion_group!(
    benches,
    compaction,
    hot_path,
    small_request,
    agent_request,
    estimate,
    plain_scan
);
criterion_main!(benches);
