//! Bounded clients, through the real proxy on real sockets: connections that send nothing,
//! stay idle after a request, stop after the HTTP/2 preface, or stop mid-body are closed after
//! `server.client_timeout_secs` (a stalled body gets 408), and shutdown is not held by them;
//! `server.max_connections` makes accepting wait while the admin listener still answers.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::json;
use support::{upstream_toml, MockUpstream, Reply, TestClient, TestProxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A short client timeout; everything else default.
fn config(mock: &MockUpstream, extra: &str) -> String {
    format!(
        "{}[server]\nclient_timeout_secs = 0.3\n{extra}",
        upstream_toml(&mock.url())
    )
}

async fn mock() -> MockUpstream {
    let mock = MockUpstream::start().await;
    mock.set_handler(|_| Reply::json(200, &json!({"ok": true})));
    mock
}

/// Reads until the server closes the connection; returns what it sent. Panics if it stays
/// open past the tests' bound.
async fn until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let read = support::within("the server closing the connection", async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    });
    read.await;
    got
}

#[tokio::test]
async fn silent_idle_and_preface_only_connections_are_closed() {
    let mock = mock().await;
    let proxy = TestProxy::start(&config(&mock, "")).await;

    // Sends nothing at all.
    let mut silent = TcpStream::connect(proxy.addr).await.expect("connect");
    let opened = Instant::now();
    assert!(until_closed(&mut silent).await.is_empty());
    assert!(
        opened.elapsed() >= Duration::from_millis(300),
        "not before the timeout"
    );

    // One request, then idle keep-alive.
    let mut idle = TcpStream::connect(proxy.addr).await.expect("connect");
    idle.write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("write");
    let answered = until_closed(&mut idle).await;
    let text = String::from_utf8_lossy(&answered);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");

    // The HTTP/2 preface, then nothing.
    let mut h2 = TcpStream::connect(proxy.addr).await.expect("connect");
    h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .expect("write");
    h2.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]) // an empty SETTINGS frame
        .await
        .expect("write");
    until_closed(&mut h2).await;
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_stalled_body_gets_408_and_does_not_hold_shutdown() {
    let mock = mock().await;
    let mut proxy = TestProxy::start(&config(&mock, "shutdown_grace_secs = 60.0\n")).await;
    for path in ["/v1/chat/completions", "/v1/files"] {
        let mut stalled = TcpStream::connect(proxy.addr).await.expect("connect");
        stalled
            .write_all(
                format!(
                    "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                     content-length: 1000\r\n\r\n{{\"model\":"
                )
                .as_bytes(),
            )
            .await
            .expect("write");
        let answered = until_closed(&mut stalled).await;
        let text = String::from_utf8_lossy(&answered);
        if path == "/v1/chat/completions" {
            // Read whole by compactor: a clean 408.
            assert!(text.starts_with("HTTP/1.1 408"), "{path}: {text}");
            assert!(text.contains("request_timeout"), "{text}");
        }
        // Streamed through: the exchange ends (the upstream never got a whole body).
    }
    assert!(
        mock.requests()
            .iter()
            .all(|r| r.path() != "/v1/chat/completions"),
        "a stalled chat body is never forwarded"
    );
    // The admin listener's one route with a body, likewise.
    let mut stalled = TcpStream::connect(proxy.admin).await.expect("connect");
    stalled
        .write_all(
            b"POST /session/s/summarize HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"instr",
        )
        .await
        .expect("write");
    let answered = until_closed(&mut stalled).await;
    let text = String::from_utf8_lossy(&answered);
    assert!(text.starts_with("HTTP/1.1 408"), "admin: {text}");

    // Shutdown with a stalled client: over in about the client timeout, not the 60 s grace.
    let mut stalled = TcpStream::connect(proxy.addr).await.expect("connect");
    stalled
        .write_all(b"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\nabc")
        .await
        .expect("write");
    // The request is in progress (its head read, its body streaming upstream).
    proxy
        .wait_metric("compactor_in_flight_requests", &[], 1.0)
        .await;
    proxy.trigger_shutdown();
    let task = proxy.take_task();
    let started = Instant::now();
    support::within("the drain", task)
        .await
        .expect("server task")
        .expect("server run");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn beyond_max_connections_accepting_waits_and_the_admin_port_answers() {
    let mock = mock().await;
    let proxy = TestProxy::start(&format!(
        "{}[server]\nclient_timeout_secs = 30.0\nmax_connections = 2\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let held_a = TcpStream::connect(proxy.addr).await.expect("connect");
    let held_b = TcpStream::connect(proxy.addr).await.expect("connect");

    // A third client: the kernel completes the handshake, compactor does not serve it yet.
    let mut third = TcpStream::connect(proxy.addr).await.expect("connect");
    third
        .write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 64];
    let early = tokio::time::timeout(Duration::from_millis(300), third.read(&mut buf)).await;
    assert!(early.is_err(), "served beyond max_connections: {early:?}");

    let (status, _) = TestClient::http1()
        .get_text(&proxy.admin_url("/livez"))
        .await;
    assert_eq!(status, 200, "the admin listener keeps its own room");

    drop(held_a);
    let answered = until_closed(&mut third).await;
    let text = String::from_utf8_lossy(&answered);
    assert!(
        text.starts_with("HTTP/1.1 200"),
        "served once a slot is free: {text}"
    );
    drop(held_b);

    // Ordinary clients are unaffected.
    let got = TestClient::http1()
        .exchange("GET", &proxy.url("/v1/models"), &[], Bytes::new())
        .await;
    assert_eq!(got.status, 200);
    proxy.shutdown().await;
}
