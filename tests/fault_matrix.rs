//! The fault matrix, through the real proxy: every upstream fault (refused, reset before the
//! head, reset mid-SSE, stall before the head, stall mid-body, 5xx, 429, garbage) × every
//! summarizer fault (error, timeout, blank, garbage, oversized, hang) × every dialect, each
//! request due for compaction, with shutdown begun while the requests are in flight.
//!
//! What must hold everywhere: compactor loses no request and turns none into an error of its
//! own. The summarizer failing means the original request goes upstream byte for byte; the
//! client then gets exactly what the upstream gave (its status and body), or, where the
//! upstream gave nothing usable, compactor's gateway error (502 unreachable or garbled, 504 no
//! head in time); a stream the upstream breaks reaches the client as far as it went. No
//! compaction panics, and shutdown completes within its grace period.

mod support;

use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use support::{refused_port, upstream_toml, MockUpstream, Recorded, Reply, TestProxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Upstream {
    Refused,
    ResetBeforeHead,
    ResetMidSse,
    StallBeforeHead,
    StallMidBody,
    ServerError,
    RateLimited,
    Garbage,
}

const UPSTREAM: [Upstream; 8] = [
    Upstream::Refused,
    Upstream::ResetBeforeHead,
    Upstream::ResetMidSse,
    Upstream::StallBeforeHead,
    Upstream::StallMidBody,
    Upstream::ServerError,
    Upstream::RateLimited,
    Upstream::Garbage,
];

#[derive(Debug, Clone, Copy)]
enum Summarizer {
    Error,
    Timeout,
    Blank,
    Garbage,
    Oversized,
    Hang,
}

const SUMMARIZER: [Summarizer; 6] = [
    Summarizer::Error,
    Summarizer::Timeout,
    Summarizer::Blank,
    Summarizer::Garbage,
    Summarizer::Oversized,
    Summarizer::Hang,
];

#[derive(Debug, Clone, Copy)]
enum Dialect {
    Chat,
    Messages,
    Responses,
}

const DIALECTS: [Dialect; 3] = [Dialect::Chat, Dialect::Messages, Dialect::Responses];

const SSE_HEAD: &str = "data: {\"partial\": 1}\n\n";

impl Dialect {
    fn path(self) -> &'static str {
        match self {
            Dialect::Chat => "/v1/chat/completions",
            Dialect::Messages => "/v1/messages",
            Dialect::Responses => "/v1/responses",
        }
    }

    /// A request due for compaction (12 messages > `max_messages = 6`).
    fn body(self, stream: bool) -> Bytes {
        let turns: Vec<Value> = (0..12)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                json!({"role": role, "content": format!("turn {i}: {}", "words ".repeat(30))})
            })
            .collect();
        let v = match self {
            Dialect::Chat => {
                let mut messages = vec![json!({"role": "system", "content": "Be careful."})];
                messages.extend(turns);
                json!({"model": "gpt-4o", "stream": stream, "messages": messages})
            }
            Dialect::Messages => json!({"model": "claude-sonnet-4", "max_tokens": 100,
                "stream": stream, "system": "Be careful.", "messages": turns}),
            Dialect::Responses => {
                json!({"model": "gpt-4o", "stream": stream, "store": false, "input": turns})
            }
        };
        Bytes::from(v.to_string())
    }
}

impl Upstream {
    fn label(self) -> &'static str {
        match self {
            Upstream::Refused => "refused",
            Upstream::ResetBeforeHead => "reset-before-head",
            Upstream::ResetMidSse => "reset-mid-sse",
            Upstream::StallBeforeHead => "stall-before-head",
            Upstream::StallMidBody => "stall-mid-body",
            Upstream::ServerError => "server-error",
            Upstream::RateLimited => "rate-limited",
            Upstream::Garbage => "garbage",
        }
    }

    fn streams(self) -> bool {
        matches!(self, Upstream::ResetMidSse | Upstream::StallMidBody)
    }

    /// What the mock provider answers for this fault.
    fn reply(self) -> Reply {
        let sse = vec![("content-type".to_owned(), "text/event-stream".to_owned())];
        match self {
            Upstream::ResetBeforeHead => Reply::Reset,
            Upstream::StallBeforeHead => Reply::Stall,
            Upstream::ResetMidSse => Reply::ResetAfter {
                status: 200,
                headers: sse,
                chunks: vec![Bytes::from(SSE_HEAD)],
            },
            Upstream::StallMidBody => Reply::StallAfter {
                status: 200,
                headers: sse,
                chunks: vec![Bytes::from(SSE_HEAD)],
            },
            Upstream::ServerError => Reply::json(500, &json!({"error": {"message": "boom"}})),
            Upstream::RateLimited => Reply::json(
                429,
                &json!({"error": {"message": "Rate limit reached: tokens per min"}}),
            ),
            // Served by a closed port and a raw TCP server instead: never asked of the mock.
            Upstream::Refused | Upstream::Garbage => Reply::status(599),
        }
    }
}

impl Summarizer {
    fn reply(self) -> Reply {
        let completion = |content: &str| {
            json!({"id": "s", "object": "chat.completion", "model": "m", "choices": [{"index": 0,
                "finish_reason": "stop", "message": {"role": "assistant", "content": content}}]})
        };
        match self {
            Summarizer::Error => Reply::json(500, &json!({"error": {"message": "down"}})),
            Summarizer::Timeout => Reply::Stall,
            Summarizer::Blank => Reply::json(200, &completion("  \u{200b} ")),
            Summarizer::Garbage => Reply::bytes(200, "application/json", "{\"choices\": [nope"),
            // Far beyond `max_summary_bytes` below.
            Summarizer::Oversized => Reply::json(200, &completion(&"x".repeat(512 * 1024))),
            Summarizer::Hang => Reply::StallAfter {
                status: 200,
                headers: vec![("content-type".into(), "application/json".into())],
                chunks: vec![Bytes::from_static(b"{\"choices\": [")],
            },
        }
    }
}

/// A server that answers anything with bytes that are not HTTP.
async fn garbage_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf).await;
                let _ = stream
                    .write_all(b"SSH-2.0-not-http\r\n\x00\x01\x02\r\n\r\n")
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

fn config(upstream: &str, summarizer: &MockUpstream) -> String {
    format!(
        "{}response_timeout_secs = 0.5\n\
         [server]\nshutdown_grace_secs = 1.0\n\
         [compaction]\nmax_messages = 6\nbackground_ratio = 0\nmin_preserve_tokens = 20\n\
         max_preserve_tokens = 100\n\
         [summarizer]\nbackend = \"openai\"\ntimeout_secs = 0.3\nmax_summary_bytes = 65536\n\
         [summarizer.openai]\nbase_url = \"{}/v1\"\nmodel = \"m\"\n",
        upstream_toml(upstream),
        summarizer.url()
    )
}

/// One client exchange: the status (None: no response head) and the body bytes that arrived.
struct Seen {
    status: Option<u16>,
    body: Vec<u8>,
}

/// A raw HTTP/1.1 exchange (the body read until the server closes or stops for a second), so
/// a broken stream is observed as far as it went.
async fn send(url: String, body: Bytes, fault: Upstream) -> Seen {
    let rest = url.strip_prefix("http://").expect("http url");
    let (host, path) = rest.split_once('/').expect("path");
    let mut stream = tokio::net::TcpStream::connect(host).await.expect("connect");
    let head = format!(
        "POST /{path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n\
         authorization: Bearer sk-matrix\r\nx-api-key: sk-matrix\r\nanthropic-version: 2023-06-01\r\n\
         x-fault: {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        fault.label(),
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("write head");
    stream.write_all(&body).await.expect("write body");
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|t| t.get(..3))
        .and_then(|s| s.parse().ok());
    let body = match text.find("\r\n\r\n") {
        Some(i) => got[i + 4..].to_vec(),
        None => Vec::new(),
    };
    Seen { status, body }
}

fn received_original(mock: &MockUpstream, fault: Upstream, original: &Bytes) -> bool {
    mock.requests()
        .iter()
        .filter(|r: &&Recorded| r.header("x-fault") == Some(fault.label()))
        .any(|r| r.body == *original)
}

fn check(what: &str, fault: Upstream, seen: &Seen) {
    let body = String::from_utf8_lossy(&seen.body);
    match fault {
        Upstream::Refused | Upstream::ResetBeforeHead | Upstream::Garbage => {
            assert_eq!(seen.status, Some(502), "{what}: {body}");
        }
        Upstream::StallBeforeHead => assert_eq!(seen.status, Some(504), "{what}: {body}"),
        Upstream::ServerError => {
            assert_eq!(seen.status, Some(500), "{what}");
            assert!(
                body.contains("\"boom\""),
                "{what}: the upstream's own body: {body}"
            );
        }
        Upstream::RateLimited => {
            assert_eq!(seen.status, Some(429), "{what}");
            assert!(body.contains("tokens per min"), "{what}: {body}");
        }
        Upstream::ResetMidSse | Upstream::StallMidBody => {
            assert_eq!(seen.status, Some(200), "{what}: {body}");
            assert!(
                body.contains("\"partial\""),
                "{what}: what the upstream sent: {body}"
            );
        }
    }
}

async fn run(summarizer_fault: Summarizer, dialect: Dialect) {
    let summarizer = MockUpstream::start().await;
    summarizer.set_handler(move |_| summarizer_fault.reply());
    let provider = MockUpstream::start().await;
    provider.set_handler(|r| {
        let fault = UPSTREAM
            .into_iter()
            .find(|f| r.header("x-fault") == Some(f.label()));
        fault.map_or(Reply::status(400), Upstream::reply)
    });
    let garbage = garbage_server().await;
    let refused_port = refused_port();
    let refused = format!("http://127.0.0.1:{}", refused_port.port());

    for (upstream, faults) in [
        (provider.url(), &UPSTREAM[1..7]),
        (refused, &UPSTREAM[..1]),
        (garbage, &UPSTREAM[7..]),
    ] {
        let asked = summarizer.request_count();
        let mut proxy = TestProxy::start(&config(&upstream, &summarizer)).await;
        let url = proxy.url(dialect.path());
        let requests: Vec<_> = faults
            .iter()
            .map(|&fault| {
                let body = dialect.body(fault.streams());
                let task = tokio::spawn(send(url.clone(), body.clone(), fault));
                (fault, body, task)
            })
            .collect();
        // Shutdown begins while the requests are in flight (each is at least at its summarizer
        // call, which fails slowly for the timeout and hang faults).
        proxy
            .wait_metric("compactor_in_flight_requests", &[], faults.len() as f64)
            .await;
        let panics = proxy
            .metric(
                "compactor_compactions_total",
                &[("trigger", "none"), ("outcome", "panic")],
            )
            .await;
        proxy.trigger_shutdown();
        let task = proxy.take_task();
        for (fault, body, seen) in requests {
            let what =
                format!("{dialect:?} / summarizer {summarizer_fault:?} / upstream {fault:?}");
            let seen = seen.await.expect("client task");
            check(&what, fault, &seen);
            if upstream == provider.url() {
                assert!(
                    received_original(&provider, fault, &body),
                    "{what}: the original request, byte for byte"
                );
            }
        }
        support::within("the drain", task)
            .await
            .expect("server task")
            .expect("server run");
        assert_eq!(
            panics,
            Some(0.0),
            "{dialect:?} / {summarizer_fault:?}: no compaction panicked"
        );
        assert!(
            summarizer.request_count() > asked,
            // Concurrent requests of one conversation share one summary (and its breaker).
            "{dialect:?} / {summarizer_fault:?}: the failing summarizer was asked"
        );
    }
}

#[tokio::test]
async fn no_fault_loses_a_request_or_becomes_compactors_error() {
    for summarizer_fault in SUMMARIZER {
        let runs = DIALECTS.map(|dialect| run(summarizer_fault, dialect));
        let [a, b, c] = runs;
        tokio::join!(a, b, c);
    }
}
