//! Bounded memory, through the real proxy: a chat body the buffer budget
//! (`server.max_buffered_bytes`) cannot hold is streamed upstream byte for byte, uncompacted,
//! never refused, and counted; and the compactor process's peak RSS stays under a documented
//! bound while 32 clients send 1 MB chat bodies at once.

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

/// The budget holds what has arrived, not what a client declares: a request declaring most of
/// it and sending a few bytes leaves room for another client's body, which is read and
/// inspected as usual.
#[tokio::test]
async fn a_declared_but_unsent_body_holds_none_of_the_budget() {
    let mock = answering_mock().await;
    let proxy = TestProxy::start(&format!(
        "{}[server]\nmax_buffered_bytes = 4096\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let url = proxy.url("/v1/chat/completions");

    let (tx, body) = channel_body();
    let request = Request::post(&url)
        .header("content-type", "application/json")
        .header("content-length", "3000")
        .body(body)
        .expect("request");
    let slow = tokio::spawn(async move { TestClient::http1().try_send(request).await });
    assert!(
        tx.send(Bytes::from_static(b"{\"model\":")).await,
        "body open"
    );
    // Its handler has started (and, in the same step, taken its share of the budget).
    proxy
        .wait_metric("compactor_in_flight_requests", &[], 1.0)
        .await;

    let other = conversation(6, 300);
    assert!(other.len() > 4096 - 3000 && other.len() < 4096 - 10);
    let got = TestClient::http1()
        .exchange(
            "POST",
            &url,
            &[("content-type", "application/json")],
            Bytes::from(other.clone()),
        )
        .await;
    assert_eq!(got.status, 200);
    assert!(
        got.header("x-compactor-tokens-before").is_some(),
        "read whole and inspected"
    );
    assert_eq!(mock.last_request().body, other);
    assert_eq!(
        proxy
            .metric("compactor_unbuffered_requests_total", &[])
            .await,
        Some(0.0)
    );
    slow.abort();
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

#[tokio::test]
async fn peak_rss_stays_bounded_while_32_clients_send_1_mb_bodies() {
    let mock = answering_mock().await;
    mock.set_recording(false);
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("compactor.toml");
    std::fs::write(
        &config,
        format!(
            "{}[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             max_buffered_bytes = 8388608\n[compaction]\nmax_messages = 40\n\
             background_ratio = 0\n[summarizer]\nbackend = \"extractive\"\n",
            upstream_toml(&mock.url())
        ),
    )
    .expect("config");
    let binary = Binary::serve_with_log(&config, dir.path(), "info").await;
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
