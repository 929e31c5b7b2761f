//! Soak: the compactor binary under mixed traffic for a bounded time (30 s by default;
//! `COMPACTOR_SOAK_SECS=600 cargo test --release --test soak -- --nocapture` for a long run),
//! sampling its resident memory and open file descriptors every half second. Traffic: chat
//! conversations that grow and compact (summaries stored and reused), streamed answers,
//! pass-through calls, clients that vanish mid-request, and idle connections that the client
//! timeout closes. What must hold: every well-formed request answered, and neither memory nor
//! descriptors keep growing (the second half's peak within a margin of the first half's).

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::json;
use support::{upstream_toml, Binary, MockUpstream, Reply, TestClient};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("proc fd")
        .count()
}

fn conversation(session: usize, turns: usize) -> Bytes {
    let mut messages = vec![json!({"role": "system", "content": "You are a coding agent."})];
    for i in 0..turns {
        messages.push(json!({"role": "user", "content": format!("session {session} step {i}: {}", "run the tests ".repeat(20))}));
        messages.push(json!({"role": "assistant", "content": format!("done {i}")}));
    }
    messages.push(json!({"role": "user", "content": "continue"}));
    Bytes::from(
        json!({"model": "gpt-4o", "messages": messages, "stream": session % 2 == 0}).to_string(),
    )
}

#[tokio::test]
async fn mixed_traffic_does_not_grow_memory_or_descriptors() {
    let secs: u64 = std::env::var("COMPACTOR_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let mock = MockUpstream::start().await;
    mock.set_recording(false);
    mock.set_handler(|r| {
        if r.body.windows(13).any(|w| w == b"\"stream\":true") {
            Reply::sse(&[
                r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"ok"}}]}"#,
                "[DONE]",
            ])
        } else {
            Reply::json(200, &json!({"id": "c", "object": "chat.completion", "choices": [{"index": 0,
                "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 900, "completion_tokens": 5, "total_tokens": 905}}))
        }
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("compactor.toml");
    std::fs::write(
        &config,
        format!(
            "{}[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             client_timeout_secs = 1.0\n\
             [compaction]\nmax_messages = 30\nmin_preserve_tokens = 50\nmax_preserve_tokens = 300\n\
             [summarizer]\nbackend = \"extractive\"\n\
             [store]\nmax_sessions = 200\nmax_sessions_per_tenant = 200\n",
            upstream_toml(&mock.url())
        ),
    )
    .expect("config");
    let binary = Binary::serve_with_log(&config, dir.path(), "info").await;
    let pid = binary.pid;
    let proxy = binary.proxy;
    let chat = format!("http://{proxy}/v1/chat/completions");
    let models = format!("http://{proxy}/v1/models");

    let deadline = Instant::now() + Duration::from_secs(secs);
    let traffic = {
        let chat = chat.clone();
        tokio::spawn(async move {
            let client = TestClient::http1();
            let headers = [
                ("content-type", "application/json"),
                ("authorization", "Bearer sk-soak"),
            ];
            let mut round = 0usize;
            let mut answered = 0usize;
            while Instant::now() < deadline {
                // A few conversations at a time, each a little longer every round (compacting
                // past 30 messages, then reusing and refining its summary), new ones over time.
                for session in round / 20..round / 20 + 8 {
                    let got = client
                        .exchange(
                            "POST",
                            &chat,
                            &headers,
                            conversation(session, 5 + round % 20),
                        )
                        .await;
                    assert_eq!(got.status, 200, "{}", String::from_utf8_lossy(&got.body));
                    answered += 1;
                }
                let got = client.exchange("GET", &models, &[], Bytes::new()).await;
                assert_eq!(got.status, 200);
                answered += 1;
                // A client that goes away mid-body, and one that connects and says nothing.
                if let Ok(mut s) = TcpStream::connect(proxy).await {
                    let _ = s
                        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"mo")
                        .await;
                }
                let idle = TcpStream::connect(proxy).await.ok();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    drop(idle);
                });
                round += 1;
            }
            answered
        })
    };

    let mut samples: Vec<(u64, usize)> = Vec::new();
    while !traffic.is_finished() {
        samples.push((rss(pid), fds(pid)));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let answered = traffic.await.expect("traffic");
    // The client timeout (1 s) closes what the vanished and idle clients left.
    let settle = Instant::now() + Duration::from_secs(10);
    let baseline_fds = samples.first().map_or(0, |s| s.1);
    while fds(pid) > baseline_fds + 16 && Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let half = samples.len() / 2;
    assert!(half >= 4, "too few samples: {}", samples.len());
    let peak = |s: &[(u64, usize)]| s.iter().map(|x| x.0).max().unwrap_or(0);
    let (first, second) = (peak(&samples[..half]), peak(&samples[half..]));
    let fd_peak = samples.iter().map(|x| x.1).max().unwrap_or(0);
    eprintln!(
        "soak {secs} s: {answered} requests answered; RSS peak first half {:.1} MB, second half {:.1} MB; fds baseline {baseline_fds}, peak {fd_peak}, after {}",
        first as f64 / 1e6,
        second as f64 / 1e6,
        fds(pid)
    );
    assert!(answered > 50, "traffic ran: {answered}");
    assert!(
        second <= first + first / 5 + 8 * 1024 * 1024,
        "memory keeps growing: {first} then {second}"
    );
    assert!(
        fds(pid) <= baseline_fds + 16,
        "descriptors not returned: {baseline_fds} at start, {} after",
        fds(pid)
    );
}
