//! Anthropic's 1M-token context through the real proxy. A request that enables it
//! (`anthropic-beta: context-1m-…`, as Claude Code's `[1m]` models do) has the long window, not
//! its model's usual one, so it is not compacted at a fifth of what it may hold; and a window a
//! provider shows for one is learned for that one alone (`<model>[1m]`).

mod support;

use bytes::Bytes;
use serde_json::{json, Value};
use support::summary_calls::agent_requests;
use support::{upstream_toml, Exchange, MockUpstream, Reply, TestClient, TestProxy};

/// `tiny`'s usual window and its long one, small enough for a test conversation to cross the
/// first and not the second.
const CONFIG: &str = "[compaction]\nmax_messages = 1000\nmin_preserve_tokens = 20\n\
                      max_preserve_tokens = 200\n[summarizer]\nbackend = \"extractive\"\n\
                      [models]\n\"tiny\" = { context_window = 1000 }\n\
                      \"tiny[1m]\" = { context_window = 100000 }\n";

const LONG: &str = "interleaved-thinking-2025-05-14,context-1m-2025-08-07";

/// A conversation of about 2,000 tokens: over `tiny`'s trigger, far under its long window's.
fn conversation(topic: &str) -> Value {
    let mut messages = Vec::new();
    for i in 0..18 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role,
                             "content": format!("{topic} turn {i}: {}", "words ".repeat(70))}));
    }
    json!({"model": "tiny", "max_tokens": 100, "messages": messages})
}

fn answer() -> Reply {
    Reply::json(
        200,
        &json!({"id": "m", "type": "message", "role": "assistant", "model": "tiny",
                "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                "usage": {"input_tokens": 10, "output_tokens": 1}}),
    )
}

async fn send(proxy: &TestProxy, body: &Value, beta: Option<&str>) -> Exchange {
    let mut headers = vec![
        ("content-type", "application/json"),
        ("x-api-key", "sk-ant-long"),
        ("anthropic-version", "2023-06-01"),
    ];
    if let Some(beta) = beta {
        headers.push(("anthropic-beta", beta));
    }
    TestClient::http1()
        .exchange(
            "POST",
            &proxy.url("/v1/messages"),
            &headers,
            Bytes::from(body.to_string()),
        )
        .await
}

#[tokio::test]
async fn a_request_enabling_the_long_context_is_measured_against_it() {
    let mock = MockUpstream::start().await;
    mock.set_handler(|_| answer());
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;

    let long = conversation("alpha");
    let got = send(&proxy, &long, Some(LONG)).await;
    assert_eq!(got.status, 200, "{:?}", got.body);
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    let forwarded: Value = serde_json::from_slice(&mock.last_request().body).expect("JSON");
    assert_eq!(forwarded, long, "forwarded whole");

    // The same size without the flag: the usual window, compacted.
    let usual = conversation("beta");
    let got = send(&proxy, &usual, None).await;
    assert_eq!(got.status, 200, "{:?}", got.body);
    assert_eq!(got.header("x-compactor-compacted"), Some("true"));
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_window_shown_for_the_long_context_is_learned_for_it_alone() {
    // The provider grants less than the table says for the long context: it refuses the
    // whole conversation and takes a compacted one.
    let mock = MockUpstream::start().await;
    mock.set_handler(|r| {
        let long = r
            .header("anthropic-beta")
            .is_some_and(|b| b.contains("context-1m"));
        let whole = serde_json::from_slice::<Value>(&r.body)
            .is_ok_and(|v| v["messages"].as_array().is_some_and(|m| m.len() == 18));
        if long && whole {
            Reply::json(
                400,
                &json!({"type": "error", "error": {"type": "invalid_request_error",
                        "message": "prompt is too long: 2100 tokens > 1500 maximum"}}),
            )
        } else {
            answer()
        }
    });
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;

    let got = send(&proxy, &conversation("gamma"), Some(LONG)).await;
    assert_eq!(got.status, 200, "{:?}", got.body);
    assert_eq!(got.header("x-compactor-retried"), Some("true"));
    assert_eq!(agent_requests(&mock).len(), 2, "refused, then retried");

    let (status, text) = TestClient::http1()
        .get_text(&proxy.admin_url("/models"))
        .await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&text).expect("JSON");
    let learned: Vec<&Value> = models["models"]
        .as_array()
        .expect("models")
        .iter()
        .filter(|m| m["source"] == "error")
        .collect();
    assert_eq!(learned.len(), 1, "{text}");
    assert_eq!(learned[0]["model"], "tiny[1m]");
    assert_eq!(learned[0]["context_window"], 1500);
    proxy.shutdown().await;
}
