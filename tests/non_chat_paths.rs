//! Non-chat `POST`s whose paths end in, or sit under, `messages`, `responses` or
//! `chat/completions` (OpenAI Assistants, Responses sub-resources, stored chat completions,
//! Anthropic token counting and batches) pass through like any other call: streamed byte for
//! byte past `server.max_body_bytes`, without `x-compactor-*` headers, counted as route
//! `other`, never as an `unreadable` chat body.

mod support;

use bytes::Bytes;
use serde_json::json;
use support::{upstream_toml, MockUpstream, Reply, TestClient, TestProxy};

/// Smaller than the Assistants message below, so reading it as chat would refuse it (413).
const MAX_BODY_BYTES: usize = 2048;

fn no_compactor_headers(path: &str, headers: &http::HeaderMap) {
    let ours: Vec<&str> = headers
        .keys()
        .map(|k| k.as_str())
        .filter(|k| k.starts_with("x-compactor-"))
        .collect();
    assert!(ours.is_empty(), "{path}: response carries {ours:?}");
}

#[tokio::test]
async fn non_chat_posts_pass_through_unread() {
    let mock = MockUpstream::start().await;
    let toml = format!(
        "[server]\nmax_body_bytes = {MAX_BODY_BYTES}\n\n{}",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();

    // Bodies as the providers' clients send them; the whitespace is the caller's own.
    let long_note = "The deployment log follows. ".repeat(120);
    let calls = [
        (
            "/v1/threads/thread_abc123/messages",
            format!("{{\"role\": \"user\",  \"content\": \"{long_note}\"}}"),
        ),
        (
            "/v1/threads/thread_abc123/messages",
            r#"{"role":"user","content":[{"type":"text","text":"hi"}],"attachments":[]}"#.into(),
        ),
        (
            "/openai/threads/thread_abc123/messages?api-version=2024-05-01-preview",
            r#"{"role":"user","content":"hi"}"#.into(),
        ),
        (
            "/v1/threads/thread_abc123/runs",
            r#"{"assistant_id":"asst_abc123","additional_messages":[{"role":"user","content":"hi"}]}"#.into(),
        ),
        ("/v1/responses/resp_abc123/cancel", String::new()),
        (
            "/v1/responses/compact",
            r#"{"model":"gpt-5","input":[{"role":"user","content":"hi"}]}"#.into(),
        ),
        (
            "/v1/chat/completions/chatcmpl_abc123",
            r#"{"metadata":{"reviewed":"yes"}}"#.into(),
        ),
        (
            "/v1/messages/count_tokens",
            r#"{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"hi"}]}"#.into(),
        ),
        (
            "/v1/messages/batches",
            r#"{"requests":[{"custom_id":"a","params":{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}}]}"#.into(),
        ),
    ];
    assert!(calls[0].1.len() > MAX_BODY_BYTES);

    for (n, (path, body)) in calls.iter().enumerate() {
        let answer = json!({"id": format!("answer_{n}"), "object": "thread.message"});
        mock.push(Reply::json(200, &answer));
        let exchange = client
            .exchange(
                "POST",
                &proxy.url(path),
                &[("content-type", "application/json")],
                body.clone(),
            )
            .await;
        assert_eq!(exchange.status, 200, "{path}: {:?}", exchange.body);
        assert_eq!(exchange.body, Bytes::from(answer.to_string()), "{path}");
        no_compactor_headers(path, &exchange.headers);
        let seen = mock.last_request();
        assert_eq!(seen.path_and_query, *path);
        assert!(
            seen.body == body.as_bytes(),
            "{path}: the body changed in transit"
        );
    }

    let other_post = [
        ("route", "other"),
        ("method", "POST"),
        ("status_class", "2xx"),
    ];
    proxy
        .wait_metric("compactor_requests_total", &other_post, calls.len() as f64)
        .await;
    let unreadable = proxy
        .metric(
            "compactor_compactions_total",
            &[("trigger", "none"), ("outcome", "unreadable")],
        )
        .await;
    assert!(
        unreadable.unwrap_or(0.0) == 0.0,
        "non-chat bodies counted as unreadable chat: {unreadable:?}"
    );

    // The same proxy still reads a chat call at the provider's chat path.
    mock.push(Reply::json(
        200,
        &json!({"id": "msg_abc123", "type": "message"}),
    ));
    let chat = client
        .exchange(
            "POST",
            &proxy.url("/v1/messages"),
            &[("content-type", "application/json")],
            r#"{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .await;
    assert_eq!(chat.status, 200);
    assert_eq!(chat.header("x-compactor-compacted"), Some("false"));
    proxy.shutdown().await;
}
