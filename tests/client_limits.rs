//! Bounded clients, through the real proxy on real sockets: connections that send nothing,
//! stay idle after a request, stop after the HTTP/2 preface, stop mid-body, or stop reading
//! their answer are closed after `server.client_timeout_secs` (a stalled body gets 408), and
//! neither slots nor shutdown are held by them, while a client reading slowly but steadily
//! keeps its stream; `server.max_connections` makes accepting wait while the admin listener
//! still answers, and `/livez` answers however many idle clients fill the admin listener; a
//! client that half-closes after its request gets its answer.

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

/// A mock whose `GET /v1/big` answers `mib` MiB, streamed (one shared buffer, so the mock holds
/// 1 MiB whatever the size), and anything else a small JSON body.
async fn big_mock(mib: usize) -> MockUpstream {
    let mock = MockUpstream::start().await;
    let chunk = Bytes::from(vec![b'x'; 1 << 20]);
    mock.set_handler(move |r| {
        if r.path() == "/v1/big" {
            Reply::Chunks {
                status: 200,
                headers: vec![("content-type".into(), "application/octet-stream".into())],
                chunks: vec![chunk.clone(); mib],
            }
        } else {
            Reply::json(200, &json!({"ok": true}))
        }
    });
    mock
}

/// Connects and asks for the big body; the caller decides how (whether) to read it.
async fn ask_big(proxy: &TestProxy) -> TcpStream {
    let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
    stream
        .write_all(b"GET /v1/big HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    stream
}

#[tokio::test]
async fn clients_that_stop_reading_hold_their_slots_only_until_the_timeout() {
    let mock = big_mock(256).await;
    let proxy = TestProxy::start(&format!(
        "{}[server]\nclient_timeout_secs = 0.5\nmax_connections = 3\n",
        upstream_toml(&mock.url())
    ))
    .await;
    // Three clients take every slot and never read: far more than the sockets buffer.
    let mut stalled = Vec::new();
    for _ in 0..3 {
        stalled.push(ask_big(&proxy).await);
    }
    proxy
        .wait_metric("compactor_in_flight_requests", &[], 3.0)
        .await;

    // A fourth is served once the send timeout has freed a slot (before it, never: the three
    // have requests in progress, which the idle timeout leaves alone).
    let mut fourth = TcpStream::connect(proxy.addr).await.expect("connect");
    fourth
        .write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    let answered = until_closed(&mut fourth).await;
    let text = String::from_utf8_lossy(&answered);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");

    proxy
        .wait_metric("compactor_client_send_timeouts_total", &[], 3.0)
        .await;
    proxy
        .wait_metric("compactor_in_flight_requests", &[], 0.0)
        .await;
    // What the stalled clients got: the head and what the sockets held, then the end.
    let got = until_closed(&mut stalled[0]).await;
    assert!(got.starts_with(b"HTTP/1.1 200"));
    assert!(got.len() < 256 << 20, "cut short: {} bytes", got.len());
    proxy.shutdown().await;
}

#[tokio::test]
async fn shutdown_does_not_wait_the_grace_period_for_a_client_that_stopped_reading() {
    let mock = big_mock(256).await;
    let mut proxy = TestProxy::start(&format!(
        "{}[server]\nclient_timeout_secs = 0.5\nshutdown_grace_secs = 60.0\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let _stalled = ask_big(&proxy).await;
    proxy
        .wait_metric("compactor_in_flight_requests", &[], 1.0)
        .await;
    proxy.trigger_shutdown();
    let task = proxy.take_task();
    let started = Instant::now();
    // Bounded by the tests' 20 s, a third of the grace period.
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
async fn a_client_reading_slowly_but_steadily_gets_the_whole_stream() {
    const MIB: usize = 32;
    let mock = big_mock(MIB).await;
    let timeout = Duration::from_secs(2);
    let proxy = TestProxy::start(&format!(
        "{}[server]\nclient_timeout_secs = {}\n",
        upstream_toml(&mock.url()),
        timeout.as_secs_f64()
    ))
    .await;
    let mut stream = ask_big(&proxy).await;
    let started = Instant::now();
    let mut got = Vec::new();
    let read = support::within("the slow read", async {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            // The reader's pace (about 10 MB/s, far slower than the proxy can send), not
            // synchronisation.
            tokio::time::sleep(Duration::from_millis(5)).await;
            match stream.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => panic!("cut after {} bytes: {e}", got.len()),
            }
        }
    });
    read.await;
    assert!(
        started.elapsed() > timeout,
        "the stream outlasted the timeout: {:?}",
        started.elapsed()
    );
    assert!(got.starts_with(b"HTTP/1.1 200"));
    assert!(got.len() > MIB << 20, "whole: {} bytes", got.len());
    assert!(got.ends_with(b"\r\n0\r\n\r\n"), "the last chunk arrived");
    assert_eq!(
        proxy
            .metric("compactor_client_send_timeouts_total", &[])
            .await,
        Some(0.0)
    );
    proxy.shutdown().await;
}

/// A fresh connection's `GET /livez`: the whole answer.
async fn probe(admin: std::net::SocketAddr) -> String {
    let mut stream = TcpStream::connect(admin).await.expect("connect");
    stream
        .write_all(b"GET /livez HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    String::from_utf8_lossy(&until_closed(&mut stream).await).into_owned()
}

#[tokio::test]
async fn livez_answers_while_idle_clients_fill_the_admin_listener() {
    let mock = mock().await;
    // Idle connections would be held for a minute: three times the tests' bound.
    let proxy = TestProxy::start(&format!(
        "{}[server]\nclient_timeout_secs = 60.0\n",
        upstream_toml(&mock.url())
    ))
    .await;
    // Sixteen keep-alive clients (the admin listener's room), each served once and now idle,
    // then four that send half a request head and stop.
    let mut keep_alive = Vec::new();
    for _ in 0..16 {
        let (mut sender, task) = support::raw_http1(proxy.admin).await;
        let request = http::Request::get("/livez")
            .header("host", "x")
            .body(support::empty_body())
            .expect("request");
        let response = support::within("a keep-alive probe", sender.send_request(request))
            .await
            .expect("answered");
        assert_eq!(response.status(), 200);
        support::body_bytes(response).await;
        keep_alive.push((sender, task));
    }
    let mut half_heads = Vec::new();
    for _ in 0..4 {
        let mut stream = TcpStream::connect(proxy.admin).await.expect("connect");
        stream
            .write_all(b"GET /livez HTTP/1.1\r\nhost")
            .await
            .expect("write");
        half_heads.push(stream);
    }

    // Nine probes in a row, each on a new connection, all answered well within the client
    // timeout the idle clients would otherwise hold their slots for.
    support::within("nine probes", async {
        for _ in 0..9 {
            let text = probe(proxy.admin).await;
            assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        }
    })
    .await;
    // Room was made from idle clients: the one idle longest was closed.
    let first = &keep_alive[0].1;
    support::eventually("the longest-idle client closed", || async {
        first.is_finished().then_some(())
    })
    .await;
    // (Connections still idle would hold the drain for the client timeout: the clients go.)
    drop((keep_alive, half_heads));
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_client_that_half_closes_after_its_request_gets_the_answer() {
    let mock = mock().await;
    let proxy = TestProxy::start(&config(&mock, "")).await;
    let body =
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let requests = [
        "GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n".to_owned(),
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        ),
    ];
    for request in requests {
        let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
        stream.write_all(request.as_bytes()).await.expect("write");
        // shutdown(Write): the request is all the client will send.
        stream.shutdown().await.expect("half-close");
        let answered = until_closed(&mut stream).await;
        let text = String::from_utf8_lossy(&answered);
        assert!(text.starts_with("HTTP/1.1 200"), "{request}: {text}");
        assert!(text.ends_with("{\"ok\":true}"), "the whole answer: {text}");
    }
    assert_eq!(mock.requests().len(), 2);
    proxy.shutdown().await;
}
