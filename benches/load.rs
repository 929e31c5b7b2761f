//! Load benchmark: the same requests sent directly to a mock upstream and through compactor, in
//! one run, reporting p50/p99 latency, the latency compactor adds, and throughput.
//!
//! `cargo bench --bench load`. `LOAD_REQUESTS` (default 2000) sets the requests per cell for
//! small bodies; 200 KB cells use half of that. Everything runs in-process on 127.0.0.1.

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use serde_json::json;
use support::{full_body, upstream_toml, MockUpstream, Reply, TestClient, TestProxy};

/// One kind of request.
struct Workload {
    name: &'static str,
    path: &'static str,
    body: Bytes,
    sse: bool,
    /// Divides the request count (large bodies).
    divisor: usize,
}

struct Stats {
    p50: Duration,
    p99: Duration,
    rps: f64,
}

fn embeddings_body(size: usize) -> Bytes {
    let model = "text-embedding-3-small";
    let overhead = json!({"model": model, "input": ""}).to_string().len();
    let input: String = "lorem ipsum dolor sit amet "
        .chars()
        .cycle()
        .take(size.saturating_sub(overhead))
        .collect();
    Bytes::from(json!({"model": model, "input": input}).to_string())
}

fn chat_body(stream: bool) -> Bytes {
    Bytes::from(
        json!({
            "model": "gpt-4o-mini",
            "stream": stream,
            "messages": [
                {"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy? Answer in one word."}
            ]
        })
        .to_string(),
    )
}

fn sse_events() -> Vec<String> {
    let mut events: Vec<String> = (0..19)
        .map(|i| {
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {"content": format!("tok{i} ")}}]})
            .to_string()
        })
        .collect();
    events.push("[DONE]".into());
    events
}

async fn one_request(client: &TestClient, url: &str, body: &Bytes, sse: bool) -> Duration {
    let mut builder = Request::post(url).header("content-type", "application/json");
    if sse {
        builder = builder.header("x-bench-stream", "1");
    }
    let request = builder.body(full_body(body.clone())).expect("request");
    let started = Instant::now();
    let response = client
        .try_send(request)
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e:?}"));
    assert!(
        response.status().is_success(),
        "POST {url}: {}",
        response.status()
    );
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("response body")
        .to_bytes();
    let elapsed = started.elapsed();
    assert!(!bytes.is_empty());
    elapsed
}

async fn run_cell(
    client: &Arc<TestClient>,
    base: &str,
    workload: &Workload,
    concurrency: usize,
    requests: usize,
) -> Stats {
    let url = format!("{base}{}", workload.path);
    // Warm-up: open the pooled connections.
    let mut warm = Vec::new();
    for _ in 0..concurrency {
        let (client, url, body) = (client.clone(), url.clone(), workload.body.clone());
        let sse = workload.sse;
        warm.push(tokio::spawn(async move {
            for _ in 0..3 {
                one_request(&client, &url, &body, sse).await;
            }
        }));
    }
    for w in warm {
        w.await.expect("warm-up task");
    }

    let per_worker = requests.div_ceil(concurrency);
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (client, url, body) = (client.clone(), url.clone(), workload.body.clone());
        let sse = workload.sse;
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(per_worker);
            for _ in 0..per_worker {
                latencies.push(one_request(&client, &url, &body, sse).await);
            }
            latencies
        }));
    }
    let mut latencies = Vec::with_capacity(per_worker * concurrency);
    for w in workers {
        latencies.extend(w.await.expect("worker task"));
    }
    let wall = started.elapsed();
    latencies.sort();
    let pick = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    Stats {
        p50: pick(0.50),
        p99: pick(0.99),
        rps: latencies.len() as f64 / wall.as_secs_f64(),
    }
}

fn us(d: Duration) -> String {
    format!("{:.0}µs", d.as_secs_f64() * 1e6)
}

async fn bench(default_requests: usize) {
    let requests: usize = std::env::var("LOAD_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_requests)
        .max(8);

    let mock = MockUpstream::start().await;
    mock.set_recording(false);
    let events = sse_events();
    let json_reply = json!({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Rome."},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42}
    });
    mock.set_handler(move |req| {
        if req.header("x-bench-stream").is_some() {
            Reply::sse(&events)
        } else {
            Reply::json(200, &json_reply)
        }
    });
    let proxy = TestProxy::start(&upstream_toml(&mock.url())).await;
    let direct = mock.url();
    let proxied = proxy.url("");
    let client = Arc::new(TestClient::http1());

    let small = embeddings_body(1024);
    let large = embeddings_body(200 * 1024);
    let workloads = [
        ("embeddings 1KB", "/v1/embeddings", small.clone(), 1),
        ("embeddings 200KB", "/v1/embeddings", large.clone(), 2),
        ("chat small", "/v1/chat/completions", chat_body(false), 1),
    ]
    .into_iter()
    .flat_map(|(name, path, body, divisor)| {
        [false, true].into_iter().map(move |sse| Workload {
            name,
            path,
            body: if sse && path.ends_with("/completions") {
                chat_body(true)
            } else {
                body.clone()
            },
            sse,
            divisor,
        })
    })
    .collect::<Vec<_>>();

    println!(
        "compactor load bench: {requests} requests per small cell (LOAD_REQUESTS), \
         200 KB cells {}; latency = send → full response body",
        requests / 2
    );
    println!(
        "{:<18} {:<5} {:>4} | {:>9} {:>9} | {:>9} {:>9} | {:>9} | {:>9} {:>9}",
        "workload",
        "resp",
        "conc",
        "dir p50",
        "dir p99",
        "prx p50",
        "prx p99",
        "added p50",
        "dir rps",
        "prx rps"
    );
    println!("{}", "-".repeat(112));
    let total = Instant::now();
    for workload in &workloads {
        for concurrency in [1usize, 32] {
            let n = (requests / workload.divisor).max(concurrency);
            let d = run_cell(&client, &direct, workload, concurrency, n).await;
            let p = run_cell(&client, &proxied, workload, concurrency, n).await;
            let added = p.p50.as_secs_f64() - d.p50.as_secs_f64();
            println!(
                "{:<18} {:<5} {:>4} | {:>9} {:>9} | {:>9} {:>9} | {:>8.0}µs | {:>9.0} {:>9.0}",
                workload.name,
                if workload.sse { "sse" } else { "json" },
                concurrency,
                us(d.p50),
                us(d.p99),
                us(p.p50),
                us(p.p99),
                added * 1e6,
                d.rps,
                p.rps
            );
        }
    }
    println!("total {:.1}s", total.elapsed().as_secs_f64());
    proxy.shutdown().await;
}

fn main() {
    // `cargo bench` passes `--bench`; without it (`cargo test --benches`, `--all-targets`) this
    // is a quick smoke run so test suites stay fast.
    let full = std::env::args().any(|a| a == "--bench");
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(bench(if full { 2000 } else { 32 }));
}
