//! The reuse path (a request whose history matches a checkpoint) with the memory store and
//! with the Redis store on this machine: what Redis adds to a request.
//!
//! One conversation of 60 messages (9 KB, then 280 KB) is compacted once per store (an instant summarizer), then the
//! same request is sent through `Pipeline::handle` again and again, alternating between the two
//! pipelines so machine noise hits both alike. Each request's time in the pipeline (scan,
//! lookup, splice, trigger) is measured; the report gives medians and the 90th percentile, and
//! the difference of the medians is what the Redis store adds (one round trip: the lookup
//! script probes the covered prefix lengths itself; the latest request is written off the
//! path).
//!
//! Starts its own `redis-server` on a free port (Debian's package:
//! `scripts/redis-server-install`). Run: `cargo bench --bench store` (a few seconds).

mod common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::InstantSummarizer;
use compactor::compaction::Attempts;
use compactor::config::Config;
use compactor::dialect::DialectKind;
use compactor::metrics::Metrics;
use compactor::pipeline::{Outcome, Pipeline, RequestContext};
use compactor_plugin_api::Caller;
use serde_json::{json, Value};

const ROUNDS: usize = 3_000;
const MESSAGES: usize = 60;

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// Starts `redis-server` on `port` and waits until it accepts connections.
fn start_redis(port: u16) -> std::process::Child {
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server (Debian's package; scripts/redis-server-install)");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn pipeline(store: &str) -> Arc<Pipeline> {
    let config = Config::from_toml(&format!(
        "[compaction]\nmax_messages = 40\nmin_preserve_tokens = 20\nmax_preserve_tokens = 400\n\
         background_ratio = 0\n{store}"
    ))
    .expect("config");
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    Arc::new(Pipeline::new(&config, Arc::new(InstantSummarizer), metrics))
}

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

/// A 60-message conversation whose user turns repeat "go on " `filler` times, ending with a
/// user turn.
fn conversation(filler: usize) -> Bytes {
    let mut messages: Vec<Value> =
        vec![json!({"role": "system", "content": "You are a coding agent."})];
    for turn in 0..MESSAGES / 2 {
        messages.push(
            json!({"role": "user", "content": format!("Step {turn}: {}", "go on ".repeat(filler))}),
        );
        messages.push(json!({"role": "assistant", "content": format!("Done step {turn}.")}));
    }
    messages.push(json!({"role": "user", "content": "Next."}));
    Bytes::from(json!({"model": "gpt-4o", "messages": messages}).to_string())
}

/// Compacts `body` once per store, then times the reuse path; prints and returns the medians.
async fn measure(
    stores: &[(&str, Arc<Pipeline>)],
    body: &Bytes,
    context: &RequestContext<'_>,
) -> Vec<Duration> {
    for (name, pipeline) in stores {
        let attempts = Attempts::per_request();
        let fresh = RequestContext {
            attempts: &attempts,
            ..*context
        };
        let first = pipeline
            .handle(DialectKind::ChatCompletions, body, &fresh)
            .await;
        assert!(
            matches!(first.outcome, Outcome::Rewritten { .. }),
            "{name}: the first request compacts"
        );
        let again = pipeline
            .handle(DialectKind::ChatCompletions, body, context)
            .await;
        assert!(
            matches!(again.outcome, Outcome::Reused { .. }),
            "{name}: the same request reuses the checkpoint"
        );
    }
    let mut times: Vec<Vec<Duration>> = stores.iter().map(|_| Vec::with_capacity(ROUNDS)).collect();
    for _ in 0..ROUNDS {
        for (i, (_, pipeline)) in stores.iter().enumerate() {
            let started = Instant::now();
            let processed = pipeline
                .handle(DialectKind::ChatCompletions, body, context)
                .await;
            times[i].push(started.elapsed());
            assert!(matches!(processed.outcome, Outcome::Reused { .. }));
        }
    }
    println!(
        "reuse path, {MESSAGES}-message request ({} KB), {ROUNDS} requests per store",
        body.len() / 1024
    );
    println!("{:<8} {:>10} {:>10}", "store", "p50", "p90");
    let mut medians = Vec::new();
    for ((name, _), t) in stores.iter().zip(times.iter_mut()) {
        let p50 = percentile(t, 0.5);
        println!("{name:<8} {p50:>10.1?} {:>10.1?}", percentile(t, 0.9));
        medians.push(p50);
    }
    medians
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let port = free_port();
    let mut redis = start_redis(port);
    let stores = [
        ("memory", pipeline("")),
        (
            "redis",
            pipeline(&format!(
                "[store]\nbackend = \"redis\"\nredis_url = \"redis://127.0.0.1:{port}\"\n"
            )),
        ),
    ];
    let caller = Arc::new(Caller {
        upstream_base_url: "http://127.0.0.1:9".into(),
        api_prefix: "/v1".into(),
        credentials: vec![("authorization".into(), "Bearer sk-bench".into())],
        api: DialectKind::ChatCompletions.api(),
    });
    let context = RequestContext {
        caller: &caller,
        session_header: None,
        long_context: false,
        attempts: &Attempts::per_request(),
        mode: None,
    };
    for filler in [40, 800] {
        let body = conversation(filler);
        let medians = measure(&stores, &body, &context).await;
        println!(
            "redis adds {:.1?} at the median\n",
            medians[1].saturating_sub(medians[0])
        );
    }
    let _ = redis.kill();
    let _ = redis.wait();
}
