//! The compaction event log (`server.event_log`) through the real proxy: a compaction, a
//! refusal for length compacted and sent again, and a compaction that failed each leave one
//! JSON line with the session, trigger and figures, and nothing of the conversation.

mod support;

use bytes::Bytes;
use serde_json::{json, Value};
use support::summary_calls::is_summary_request;
use support::{upstream_toml, Exchange, MockUpstream, Reply, TestClient, TestProxy};

fn conversation(n: usize, topic: &str) -> Value {
    let mut m = vec![json!({"role": "system", "content": "You are a careful assistant."})];
    for i in 0..n {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        m.push(json!({"role": role, "content": format!("{topic} turn {i}: {}", "PRIVATE words ".repeat(100))}));
    }
    json!({"model": "gpt-4o", "messages": m})
}

async fn send(proxy: &TestProxy, body: &Value) -> Exchange {
    TestClient::http1()
        .exchange(
            "POST",
            &proxy.url("/v1/chat/completions"),
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer sk-events"),
            ],
            Bytes::from(body.to_string()),
        )
        .await
}

fn events(path: &std::path::Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).expect("the event log exists");
    assert!(!text.contains("PRIVATE"), "message contents logged: {text}");
    assert!(!text.contains("sk-events"), "a credential logged: {text}");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn ok() -> Reply {
    Reply::json(
        200,
        &json!({"id": "c", "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "fits"}}]}),
    )
}

#[tokio::test]
async fn compactions_retries_and_failures_are_logged_one_json_line_each() {
    let mock = MockUpstream::start().await;
    // The provider's window is 12 messages: larger requests are refused for their length.
    mock.set_handler(|r| {
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        let n = v["messages"].as_array().map_or(0, Vec::len);
        if is_summary_request(r) || n <= 12 {
            ok()
        } else {
            Reply::json(
                400,
                &json!({"error": {"message": "This model's maximum context length is 4096 tokens. However, your messages resulted in 6100 tokens.", "type": "invalid_request_error", "code": "context_length_exceeded"}}),
            )
        }
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("events.jsonl");
    let proxy = TestProxy::start(&format!(
        "{}[server]\nevent_log = {:?}\n[compaction]\nmax_messages = 30\nmin_preserve_tokens = 20\n\
         max_preserve_tokens = 200\n[summarizer]\nbackend = \"extractive\"\n",
        upstream_toml(&mock.url()),
        path.display().to_string(),
    ))
    .await;
    // Over the message trigger: compacted before it is sent.
    assert_eq!(send(&proxy, &conversation(31, "first")).await.status, 200);
    // Under the trigger but over the provider's window: refused, compacted, sent again.
    let got = send(&proxy, &conversation(19, "second")).await;
    assert_eq!(got.header("x-compactor-retried"), Some("true"));

    let logged = events(&path);
    assert_eq!(logged.len(), 2, "{logged:?}");
    let (compaction, retry) = (&logged[0], &logged[1]);
    assert_eq!(compaction["event"], "compaction");
    assert_eq!(compaction["trigger"], "messages");
    assert_eq!(retry["event"], "retry");
    assert_eq!(retry["trigger"], "overflow");
    for e in &logged {
        assert_eq!(e["summarizer"], "extractive");
        assert!(e["session"].as_str().is_some_and(|s| !s.is_empty()), "{e}");
        let (before, after) = (&e["tokens_before"], &e["tokens_after"]);
        assert!(after.as_u64() < before.as_u64(), "{e}");
        assert!(e["duration_ms"].as_f64().is_some(), "{e}");
        assert!(e["ts"].as_f64().is_some_and(|t| t > 1.7e9), "{e}");
    }
    assert_ne!(compaction["session"], retry["session"], "two conversations");

    // `compactor replay --events` shows the recorded day.
    let shown = std::process::Command::new(env!("CARGO_BIN_EXE_compactor"))
        .args(["replay", "--events"])
        .arg(&path)
        .output()
        .expect("run compactor replay");
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.status.success(),
        "{}",
        String::from_utf8_lossy(&shown.stderr)
    );
    let session = compaction["session"].as_str().expect("session");
    assert!(
        text.lines()
            .any(|l| l.starts_with(session) && l.split_whitespace().nth(1) == Some("1")),
        "{text}"
    );
    assert!(
        text.contains("total: 2 conversations")
            && text.contains("1 compactions, 1 refusal retries"),
        "{text}"
    );

    // A summarizer that answers nothing: the failed compaction is logged with its outcome.
    let failing = dir.path().join("failing.jsonl");
    let proxy = TestProxy::start(&format!(
        "{}[server]\nevent_log = {:?}\n[compaction]\nmax_messages = 10\n\
         [summarizer]\nbackend = \"exec\"\n[summarizer.exec]\ncommand = \"/bin/sh\"\n\
         args = [\"-c\", \"cat >/dev/null; echo '{{\\\"summary\\\": \\\"  \\\"}}'\"]\n",
        upstream_toml(&mock.url()),
        failing.display().to_string(),
    ))
    .await;
    send(&proxy, &conversation(11, "third")).await;
    let logged = events(&failing);
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert_eq!(logged[0]["event"], "compaction_failed");
    assert_eq!(logged[0]["outcome"], "blank");
    assert_eq!(logged[0]["trigger"], "messages");
}

#[tokio::test]
async fn an_event_log_that_cannot_be_opened_stops_the_start() {
    let config =
        compactor::Config::from_toml("[server]\nevent_log = \"/nonexistent-dir/events.jsonl\"\n")
            .expect("config");
    let err = compactor::app::App::new(config)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("/nonexistent-dir/events.jsonl"), "{err}");
}
