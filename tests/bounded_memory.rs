//! Bounded memory, through the real proxy: a chat body the buffer budget
//! (`server.max_buffered_bytes`) cannot hold is streamed upstream byte for byte, uncompacted,
//! never refused, and counted; one that fits waits for room others hold; a chunked body over
//! `server.max_body_bytes` gets 413 whatever else is going on; the compactor process's peak RSS stays under a documented
//! bound while 32 clients send 1 MB chat bodies at once, and a body being summarised is held
//! about once; large bodies whose buffers are reused reach the provider byte for byte.

mod support;

use bytes::Bytes;
use http::Request;
use serde_json::{json, Value};
use support::{channel_body, upstream_toml, Binary, MockUpstream, Reply, TestClient, TestProxy};

/// A conversation of `n` messages of `size` characters each.
fn conversation(n: usize, size: usize) -> Vec<u8> {
    let mut messages = vec![json!({"role": "system", "content": "You are a careful assistant."})];
    for i in 1..n {
        let role = if i % 2 == 1 { "user" } else { "assistant" };
        let text: String = format!("turn {i} ").chars().cycle().take(size).collect();
        messages.push(json!({"role": role, "content": text}));
    }
    json!({"model": "gpt-4o", "messages": messages})
        .to_string()
        .into_bytes()
}

async fn answering_mock() -> MockUpstream {
    let mock = MockUpstream::start().await;
    mock.set_handler(|_| {
        Reply::json(
            200,
            &json!({"id": "c", "object": "chat.completion", "choices": [{"index": 0,
                "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}),
        )
    });
    mock
}

#[tokio::test]
async fn a_body_beyond_the_buffer_budget_is_streamed_uncompacted() {
    let mock = answering_mock().await;
    let proxy = TestProxy::start(&format!(
        "{}[server]\nmax_buffered_bytes = 4096\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let client = TestClient::http1();
    let url = proxy.url("/v1/chat/completions");
    let headers = [("content-type", "application/json")];

    // Within the budget: read and inspected (its estimate is reported).
    let small = conversation(12, 100);
    assert!(small.len() < 4096);
    let got = client
        .exchange("POST", &url, &headers, Bytes::from(small.clone()))
        .await;
    assert_eq!(got.status, 200);
    assert!(got.header("x-compactor-tokens-before").is_some());

    // Declared beyond the budget: streamed through as sent.
    let large = conversation(12, 1_000);
    assert!(large.len() > 4096);
    let got = client
        .exchange("POST", &url, &headers, Bytes::from(large.clone()))
        .await;
    assert_eq!(got.status, 200, "never refused");
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    assert_eq!(
        got.header("x-compactor-tokens-before"),
        None,
        "not inspected"
    );
    assert_eq!(mock.last_request().body, large, "byte for byte");

    // Chunked, the budget running out mid-body: what was read and the rest, in order.
    let (tx, body) = channel_body();
    let request = Request::post(&url)
        .header("content-type", "application/json")
        .body(body)
        .expect("request");
    let sending = tokio::spawn(async move {
        for chunk in large.chunks(3_000) {
            assert!(tx.send(Bytes::copy_from_slice(chunk)).await, "body open");
        }
        large
    });
    let response = client.send(request).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-compactor-compacted"], "false");
    let sent = sending.await.expect("sender");
    assert_eq!(mock.last_request().body, sent, "byte for byte");

    assert_eq!(
        proxy
            .metric("compactor_unbuffered_requests_total", &[])
            .await,
        Some(2.0)
    );
}

/// A request that fits the budget waits for room others hold instead of going through
/// uncompacted: a client declaring most of the budget holds it while it sends, another
/// client's body waits, and is read and inspected once the first is done.
#[tokio::test]
async fn a_body_that_fits_waits_for_the_budget_others_hold() {
    let mock = answering_mock().await;
    let proxy = TestProxy::start(&format!(
        "{}[server]\nmax_buffered_bytes = 4096\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let url = proxy.url("/v1/chat/completions");

    let first = conversation(5, 600);
    assert!(first.len() > 2048 && first.len() < 4096);
    let (tx, body) = channel_body();
    let request = Request::post(&url)
        .header("content-type", "application/json")
        .header("content-length", first.len().to_string())
        .body(body)
        .expect("request");
    let slow = tokio::spawn(async move { TestClient::http1().try_send(request).await });
    assert!(
        tx.send(Bytes::copy_from_slice(&first[..10])).await,
        "body open"
    );
    proxy
        .wait_metric("compactor_in_flight_requests", &[], 1.0)
        .await;

    // Does not fit beside the first, fits the budget.
    let other = conversation(6, 300);
    assert!(other.len() > 4096 - first.len() && other.len() < 4096);
    let sending = {
        let url = url.clone();
        let other = other.clone();
        tokio::spawn(async move {
            TestClient::http1()
                .exchange(
                    "POST",
                    &url,
                    &[("content-type", "application/json")],
                    Bytes::from(other),
                )
                .await
        })
    };
    proxy
        .wait_metric("compactor_in_flight_requests", &[], 2.0)
        .await;
    // The first finishes; its room goes to the waiting request.
    assert!(tx.send(Bytes::copy_from_slice(&first[10..])).await);
    drop(tx);
    let answered = slow.await.expect("task").expect("answered");
    assert_eq!(answered.status(), 200);
    assert_eq!(
        answered
            .headers()
            .get("x-compactor-tokens-before")
            .map(|v| v.is_empty()),
        Some(false),
        "the first was read whole and inspected"
    );
    let got = sending.await.expect("task");
    assert_eq!(got.status, 200);
    assert!(
        got.header("x-compactor-tokens-before").is_some(),
        "the second too, after waiting"
    );
    assert_eq!(mock.last_request().body, other);
    assert_eq!(
        proxy
            .metric("compactor_unbuffered_requests_total", &[])
            .await,
        Some(0.0)
    );
    proxy.shutdown().await;
}

/// A chunked body over `server.max_body_bytes` is answered 413 whatever the budget holds for
/// others: read whole when its room is free, streamed (and cut off at the limit) when it is
/// not.
#[tokio::test]
async fn a_chunked_body_over_the_limit_gets_413_whatever_other_traffic_does() {
    let mock = answering_mock().await;
    // The budget is smaller than the body limit: a chunked body can hold at most the budget,
    // and goes on streaming past it.
    let proxy = TestProxy::start(&format!(
        "{}[server]\nmax_buffered_bytes = 4096\nmax_body_bytes = 16384\nclient_timeout_secs = 1\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let url = proxy.url("/v1/chat/completions");
    let chunked_over_limit = || async {
        let (tx, body) = channel_body();
        let request = Request::post(&url)
            .header("content-type", "application/json")
            .body(body)
            .expect("request");
        let sending = tokio::spawn(async move { TestClient::http1().try_send(request).await });
        let big = conversation(40, 1_000);
        assert!(big.len() > 16384);
        for chunk in big.chunks(1024) {
            if !tx.send(Bytes::copy_from_slice(chunk)).await {
                break; // the proxy stopped reading: answered already
            }
        }
        drop(tx);
        sending.await.expect("task").expect("answered").status()
    };
    // Alone.
    assert_eq!(chunked_over_limit().await, 413);
    // While another request holds part of the budget (the chunked one waits for it, then
    // streams: its answer is the same).
    let (tx, body) = channel_body();
    let request = Request::post(&url)
        .header("content-type", "application/json")
        .header("content-length", "3000")
        .body(body)
        .expect("request");
    let holder = tokio::spawn(async move { TestClient::http1().try_send(request).await });
    assert!(tx.send(Bytes::from_static(b"{\"model\":")).await);
    proxy
        .wait_metric("compactor_in_flight_requests", &[], 1.0)
        .await;
    assert_eq!(chunked_over_limit().await, 413);
    holder.abort();
    drop(tx);
    proxy.shutdown().await;
}

/// Peak resident memory of a process (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kb * 1024
}

/// The documented bound (README, *Limits on a shared host*): with `max_buffered_bytes = 8 MiB`, 32
/// clients sending 1 MB chat bodies at once keep compactor's peak RSS under this.
const RSS_BOUND: u64 = 64 * 1024 * 1024;

/// The compactor binary in front of `mock`, summarising with the extractive backend, with
/// `settings` (TOML, continuing the `[server]` table) beside; the directory holds its config.
async fn serve_extractive(mock: &MockUpstream, settings: &str) -> (tempfile::TempDir, Binary) {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("compactor.toml");
    std::fs::write(
        &config,
        format!(
            "{}[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             {settings}[summarizer]\nbackend = \"extractive\"\n",
            upstream_toml(&mock.url())
        ),
    )
    .expect("config");
    let binary = Binary::serve_with_log(&config, dir.path(), "info").await;
    (dir, binary)
}

#[tokio::test]
async fn peak_rss_stays_bounded_while_32_clients_send_1_mb_bodies() {
    let mock = answering_mock().await;
    mock.set_recording(false);
    let (_dir, binary) = serve_extractive(
        &mock,
        "max_buffered_bytes = 8388608\n[compaction]\nmax_messages = 40\nbackground_ratio = 0\n",
    )
    .await;
    let baseline = peak_rss(binary.pid);
    let url = format!("http://{}/v1/chat/completions", binary.proxy);
    // 60 messages of ~17 KB: about 1 MB, over max_messages (compacted when buffered).
    let body = Bytes::from(conversation(60, 17_000));
    assert!(body.len() > 1_000_000 && body.len() < 1_100_000);
    for _round in 0..3 {
        let clients: Vec<_> = (0..32)
            .map(|_| {
                let url = url.clone();
                let body = body.clone();
                tokio::spawn(async move {
                    TestClient::http1()
                        .exchange("POST", &url, &[("content-type", "application/json")], body)
                        .await
                })
            })
            .collect();
        for client in clients {
            let got = client.await.expect("client");
            assert_eq!(got.status, 200, "{:?}", String::from_utf8_lossy(&got.body));
            let v: Value = serde_json::from_slice(&got.body).expect("JSON");
            assert_eq!(v["choices"][0]["message"]["content"], "ok");
        }
    }
    let peak = peak_rss(binary.pid);
    eprintln!(
        "peak RSS {:.1} MB (baseline {:.1} MB)",
        peak as f64 / 1e6,
        baseline as f64 / 1e6
    );
    assert!(
        peak < RSS_BOUND,
        "peak RSS {peak} bytes over the documented {RSS_BOUND}"
    );
}

/// An agent conversation of about `target` bytes: a task, then tool calls with 64 KB outputs
/// of log lines (escaped line breaks, as agents send them).
fn agent_conversation(target: usize) -> Vec<u8> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. Use the tools."}),
        json!({"role": "user", "content": "Make the test suite pass."}),
    ];
    let mut size = 0;
    let mut step = 0;
    while size < target {
        let call = format!("call_{step}");
        let output: String = (0..)
            .map(|n| format!("[{step}:{n:06}] src/module_{}.rs: check passed\n", n % 97))
            .take_while({
                let mut len = 0;
                move |line| {
                    len += line.len();
                    len <= 64 * 1024
                }
            })
            .collect();
        size += output.len() + 200;
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": call,
            "type": "function", "function": {"name": "bash",
            "arguments": format!("{{\"cmd\": \"cargo test step{step}\"}}")}}]}),
        );
        messages.push(json!({"role": "tool", "tool_call_id": call, "content": output}));
        step += 1;
    }
    messages.push(json!({"role": "user", "content": "Go on."}));
    json!({"model": "gpt-4o", "messages": messages})
        .to_string()
        .into_bytes()
}

/// A body being summarised is held about once, not twice (README, *Memory*): the transcript a
/// compaction reads keeps of each tool output only what the summarizer's prompt shows, so the
/// outputs (most of an agent's request) are not copied beside the body's own bytes.
#[tokio::test]
async fn a_body_being_summarised_is_held_about_once() {
    let mock = answering_mock().await;
    mock.set_recording(false);
    let (_dir, binary) = serve_extractive(
        &mock,
        "[compaction]\nmax_messages = 100\nbackground_ratio = 0\n",
    )
    .await;
    let baseline = peak_rss(binary.pid);
    let body = Bytes::from(agent_conversation(16 << 20));
    let got = TestClient::http1()
        .exchange(
            "POST",
            &format!("http://{}/v1/chat/completions", binary.proxy),
            &[("content-type", "application/json")],
            body.clone(),
        )
        .await;
    assert_eq!(got.status, 200, "{:?}", String::from_utf8_lossy(&got.body));
    assert_eq!(
        got.headers
            .get("x-compactor-compacted")
            .and_then(|v| v.to_str().ok()),
        Some("true"),
        "the request was summarised"
    );
    let held = peak_rss(binary.pid).saturating_sub(baseline) as f64 / body.len() as f64;
    eprintln!(
        "a {} byte body summarised: peak RSS {held:.2} × the body over the idle process",
        body.len()
    );
    // 1.3 × measured; 2.3 × (2.05–2.10 × in release) while every output was copied into the
    // transcript.
    assert!(held < 1.6, "a summarised body held {held:.2} times over");
}

/// Large bodies of one conversation, one after another, each reaching the provider byte for
/// byte: their buffers are freed as the next requests replace them (in the session store and
/// the scan memo) and handed to later bodies of their size (`src/proxy/body_pool.rs`), shorter
/// ones included, so a buffer reused with anything of its last body left would show here.
#[tokio::test]
async fn large_bodies_of_a_conversation_reach_the_provider_byte_for_byte() {
    let mock = answering_mock().await;
    let proxy = TestProxy::start(&format!(
        "{}[compaction]\nmax_messages = 100000\n[models.\"wide\"]\ncontext_window = 100000000\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let history: Vec<Value> = (0..2_000)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": format!("turn {i}: ").repeat(60)})
        })
        .collect();
    // All within one size class (2–2.25 MiB): each buffer fits every later body.
    for (n, len) in [
        2_300_000, 2_150_000, 2_350_000, 2_120_000, 2_300_000, 2_200_000,
    ]
    .into_iter()
    .enumerate()
    {
        let mut messages = history.clone();
        messages.push(json!({"role": "user", "content": ""}));
        let mut body = json!({"model": "wide", "messages": messages}).to_string();
        let pad = len - body.len();
        let last: String = format!("{n}").repeat(pad);
        let mut messages = history.clone();
        messages.push(json!({"role": "user", "content": last}));
        body = json!({"model": "wide", "messages": messages}).to_string();
        assert_eq!(body.len(), len);
        let got = TestClient::http1()
            .exchange(
                "POST",
                &proxy.url("/v1/chat/completions"),
                &[("content-type", "application/json")],
                body.clone(),
            )
            .await;
        assert_eq!(got.status, 200);
        assert_eq!(
            got.headers
                .get("x-compactor-compacted")
                .and_then(|v| v.to_str().ok()),
            Some("false")
        );
        // Not `assert_eq!`: two megabytes printed help no one.
        let received = mock.last_request().body;
        assert!(
            received == body.as_bytes(),
            "request {n} ({len} bytes) reached the provider as {} other bytes",
            received.len()
        );
    }
    proxy.shutdown().await;
}
