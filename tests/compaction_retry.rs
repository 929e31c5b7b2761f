//! Compact and retry, through the real proxy: a chat request the provider refuses for its
//! length (its window smaller than compactor thought: no trigger fired) is compacted and sent
//! once more before any byte reaches the client, streaming requests too; the client gets the
//! answer to the smaller request. A refusal for any other reason, or one compaction cannot
//! cure, reaches the client exactly as the provider sent it.

mod support;

use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use support::summary_calls::{agent_requests, is_summary_request};
use support::{upstream_toml, Exchange, MockUpstream, Recorded, Reply, TestClient, TestProxy};

/// No trigger fires (a large message limit, the default window); the `extractive` summarizer
/// needs no network.
const CONFIG: &str = "[compaction]\nmax_messages = 1000\nmin_preserve_tokens = 20\n\
                      max_preserve_tokens = 200\n[summarizer]\nbackend = \"extractive\"\n";

/// The provider's real window, in messages: above it, requests are refused.
const WINDOW_MESSAGES: usize = 12;

fn conversation(n: usize) -> Vec<Value> {
    let mut m = vec![json!({"role": "system", "content": "You are a careful assistant."})];
    for i in 0..n {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        m.push(json!({"role": role, "content": format!("turn {i}: {}", "words ".repeat(40))}));
    }
    m
}

fn messages_of(r: &Recorded) -> usize {
    let v: Value = serde_json::from_slice(&r.body).expect("JSON");
    v["messages"].as_array().map_or(0, Vec::len)
}

fn refusal() -> Reply {
    Reply::json(
        400,
        &json!({"error": {"message": "This model's maximum context length is 4096 tokens. However, your messages resulted in 6100 tokens. Please reduce the length of the messages.", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}),
    )
}

fn answer(stream: bool) -> Reply {
    if stream {
        Reply::sse(&[
            r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"fits"}}]}"#,
            "[DONE]",
        ])
    } else {
        Reply::json(
            200,
            &json!({"id": "c", "object": "chat.completion",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "fits"}}]}),
        )
    }
}

/// A provider that refuses chat requests of more than [`WINDOW_MESSAGES`] messages.
async fn provider(refuse: impl Fn() -> Reply + Send + Sync + 'static) -> MockUpstream {
    let mock = MockUpstream::start().await;
    mock.set_handler(move |r| {
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        let stream = v["stream"] == true;
        if is_summary_request(r) || messages_of(r) <= WINDOW_MESSAGES {
            answer(stream)
        } else {
            refuse()
        }
    });
    mock
}

async fn send(proxy: &TestProxy, body: &Value) -> Exchange {
    TestClient::http1()
        .exchange(
            "POST",
            &proxy.url("/v1/chat/completions"),
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer sk-retry"),
            ],
            Bytes::from(body.to_string()),
        )
        .await
}

async fn metric(proxy: &TestProxy, name: &str, labels: &[(&str, &str)]) -> f64 {
    proxy.metric(name, labels).await.unwrap_or(0.0)
}

#[tokio::test]
async fn a_refusal_for_length_is_compacted_and_retried_streaming_or_not() {
    for stream in [false, true] {
        let mock = provider(refusal).await;
        let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
        let body = json!({"model": "gpt-4o", "stream": stream, "messages": conversation(19)});
        let got = send(&proxy, &body).await;
        assert_eq!(got.status, 200, "stream {stream}: {:?}", got.body);
        assert_eq!(got.header("x-compactor-retried"), Some("true"));
        assert_eq!(got.header("x-compactor-compacted"), Some("true"));
        let text = String::from_utf8_lossy(&got.body);
        assert!(text.contains("fits"), "the answer to the retry: {text}");
        assert!(!text.contains("context_length_exceeded"), "{text}");

        let chats = agent_requests(&mock);
        assert_eq!(chats.len(), 2, "the original, then the retry");
        assert_eq!(messages_of(&chats[0]), 20, "sent as received first");
        assert!(messages_of(&chats[1]) <= WINDOW_MESSAGES, "the retry fits");
        let retried: Value = serde_json::from_slice(&chats[1].body).expect("JSON");
        assert_eq!(retried["messages"][0], body["messages"][0], "system kept");
        assert_eq!(
            retried["messages"].as_array().and_then(|m| m.last()),
            body["messages"].as_array().and_then(|m| m.last()),
            "latest turn verbatim"
        );
        assert_eq!(retried["stream"], stream);

        assert_eq!(
            metric(
                &proxy,
                "compactor_retries_total",
                &[
                    ("reason", "context_length"),
                    ("outcome", "retried"),
                    ("via", "status")
                ]
            )
            .await,
            1.0
        );
        assert_eq!(
            metric(
                &proxy,
                "compactor_compactions_total",
                &[("trigger", "overflow"), ("outcome", "compacted")]
            )
            .await,
            1.0
        );
        // The checkpoint was stored: the next request of the conversation is spliced at once
        // and never refused.
        let mut next = body.clone();
        next["messages"].as_array_mut().expect("messages").extend([
            json!({"role": "assistant", "content": "ok"}),
            json!({"role": "user", "content": "and now?"}),
        ]);
        let got = send(&proxy, &next).await;
        assert_eq!(got.status, 200);
        assert_eq!(got.header("x-compactor-retried"), None);
        assert_eq!(agent_requests(&mock).len(), 3);
        proxy.shutdown().await;
    }
}

#[tokio::test]
async fn other_refusals_and_incurable_ones_reach_the_client_unchanged() {
    // Not about length: passed on as sent, no retry.
    let not_length = || {
        Reply::json(400, &json!({"error": {"message": "Invalid value for 'temperature'", "code": "invalid_value"}}))
            .with_header("x-provider", "p")
    };
    let mock = provider(not_length).await;
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
    let body = json!({"model": "gpt-4o", "messages": conversation(19)});
    let got = send(&proxy, &body).await;
    assert_eq!(got.status, 400);
    assert_eq!(got.header("x-provider"), Some("p"));
    assert_eq!(got.json()["error"]["code"], "invalid_value");
    assert_eq!(got.header("x-compactor-retried"), None);
    assert_eq!(mock.request_count(), 1);
    proxy.shutdown().await;

    // About length, but nothing can be compacted (two messages): the refusal as sent.
    let mock = provider(refusal).await;
    mock.set_handler(|_| refusal());
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
    let short = json!({"model": "gpt-4o", "messages": conversation(1)});
    let got = send(&proxy, &short).await;
    assert_eq!(got.status, 400);
    assert_eq!(got.json()["error"]["code"], "context_length_exceeded");
    assert_eq!(mock.request_count(), 1, "nothing to retry with");
    assert_eq!(
        metric(
            &proxy,
            "compactor_retries_total",
            &[
                ("reason", "context_length"),
                ("outcome", "not_compacted"),
                ("via", "status")
            ]
        )
        .await,
        1.0
    );
    proxy.shutdown().await;

    // A retry that is refused again: its answer goes to the client, and there is no third try.
    let mock = provider(refusal).await;
    mock.set_handler(|r| {
        if is_summary_request(r) {
            answer(false)
        } else {
            refusal()
        }
    });
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
    let got = send(&proxy, &body).await;
    assert_eq!(got.status, 400);
    assert_eq!(got.json()["error"]["code"], "context_length_exceeded");
    assert_eq!(got.header("x-compactor-retried"), Some("true"));
    assert_eq!(agent_requests(&mock).len(), 2);
    proxy.shutdown().await;
}

/// A refusal sent without a `Content-Length` (chunked) is read and retried; an error body
/// longer than any refusal passes through byte for byte, the part read first included.
#[tokio::test]
async fn chunked_refusals_are_read_and_long_error_bodies_pass_whole() {
    let chunked_refusal = || {
        let Reply::Full { body, .. } = refusal() else {
            unreachable!("refusal() is a full JSON reply")
        };
        let (a, b) = body.split_at(body.len() / 2);
        Reply::Chunks {
            status: 400,
            headers: vec![("content-type".into(), "application/json".into())],
            chunks: vec![Bytes::copy_from_slice(a), Bytes::copy_from_slice(b)],
        }
    };
    let mock = provider(chunked_refusal).await;
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
    let body = json!({"model": "gpt-4o", "messages": conversation(19)});
    let got = send(&proxy, &body).await;
    assert_eq!(got.status, 200, "{:?}", got.body);
    assert_eq!(got.header("x-compactor-retried"), Some("true"));
    proxy.shutdown().await;

    let long: Vec<Bytes> = (0..10)
        .map(|i| Bytes::from(format!("{i}{}", "context_length_exceeded ".repeat(500))))
        .collect();
    let whole: Vec<u8> = long.iter().flat_map(|c| c.to_vec()).collect();
    assert!(whole.len() > 64 * 1024);
    let mock = MockUpstream::start().await;
    let chunks = long.clone();
    mock.set_handler(move |_| Reply::Chunks {
        status: 400,
        headers: vec![("content-type".into(), "text/plain".into())],
        chunks: chunks.clone(),
    });
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
    let got = send(&proxy, &body).await;
    assert_eq!(got.status, 400);
    assert_eq!(got.body.as_ref(), whole.as_slice(), "every byte, in order");
    assert_eq!(got.header("x-compactor-retried"), None);
    assert_eq!(mock.request_count(), 1);
    proxy.shutdown().await;
}

/// An error body that stalls after its first bytes is no refusal compactor can wait for: after
/// the upstream response timeout the client gets the status and those bytes, then the rest as
/// the provider sends it, as it would without compactor.
#[tokio::test]
async fn an_error_body_that_stalls_reaches_the_client_as_it_comes() {
    let mock = MockUpstream::start().await;
    let (reply, sender) = Reply::stream_channel(
        500,
        vec![("content-type".into(), "application/json".into())],
    );
    mock.push(reply);
    let toml = format!(
        "{}response_timeout_secs = 0.3
{CONFIG}",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let body = json!({"model": "gpt-4o", "messages": conversation(3)});
    let client = TestClient::http1();
    let url = proxy.url("/v1/chat/completions");
    let request = client.request(
        "POST",
        &url,
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer sk-retry"),
        ],
        Bytes::from(body.to_string()),
    );
    let first = r#"{"error": {"message": "overloaded, "#;
    let (response, sent) = support::within(
        "the response head while the error body is still open",
        async { tokio::join!(request, sender.send(first)) },
    )
    .await;
    sent.expect("the proxy reads the first bytes");
    // The head arrived while the body is still open upstream.
    assert_eq!(response.status(), 500);
    let rest = r#""type": "server_error"}}"#;
    sender.send(rest).await.expect("the rest");
    sender.finish();
    let got = support::within("the whole body", response.into_body().collect())
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(got, format!("{first}{rest}").as_bytes());
    assert_eq!(mock.request_count(), 1, "no retry");
    proxy.shutdown().await;
}

/// Anthropic Messages (Claude Code's shape) and OpenAI Responses (Codex's) refusals for length
/// are retried through their own dialects: valid, smaller, the latest turn verbatim.
#[tokio::test]
async fn messages_and_responses_refusals_are_retried_in_their_dialect() {
    let words = "the parser drops trailing commas ".repeat(6);
    let mut turns = Vec::new();
    for i in 0..9 {
        turns.push(json!({"role": "user", "content": [
            {"type": "text", "text": format!("<system-reminder>ctx {i}</system-reminder>")},
            {"type": "text", "text": format!("step {i}: {words}")}]}));
        turns.push(json!({"role": "assistant", "content": [{"type": "text", "text": format!("done {i}: {}", words.repeat(8))}]}));
    }
    turns.push(json!({"role": "user", "content": "now run the tests"}));
    let messages_body = json!({"model": "claude-sonnet-4-5", "max_tokens": 1024,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": turns});
    let mut items = vec![json!({"type": "message", "role": "developer", "content": "Be brief."})];
    for i in 0..6 {
        items.push(json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": format!("task {i}: {words}")}]}));
        items.push(json!({"type": "function_call", "call_id": format!("call_{i}"), "name": "shell", "arguments": "{\"command\":[\"ls\"]}"}));
        items.push(json!({"type": "function_call_output", "call_id": format!("call_{i}"), "output": words.repeat(8)}));
    }
    items.push(json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "summarise"}]}));
    let responses_body = json!({"model": "gpt-5-codex", "store": false, "input": items});

    let anthropic_refusal = json!({"type": "error", "error": {"type": "invalid_request_error",
        "message": "prompt is too long: 208317 tokens > 200000 maximum"}});
    let responses_refusal = json!({"error": {"message": "Your input exceeds the context window of this model. Please adjust your input and try again.",
        "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}});
    for (path, field, body, refusal, limit) in [
        (
            "/v1/messages",
            "messages",
            messages_body,
            anthropic_refusal,
            10,
        ),
        (
            "/v1/responses",
            "input",
            responses_body,
            responses_refusal,
            12,
        ),
    ] {
        let mock = MockUpstream::start().await;
        let refused = refusal.clone();
        mock.set_handler(move |r| {
            let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
            if is_summary_request(r) || v[field].as_array().map_or(0, Vec::len) <= limit {
                Reply::json(200, &json!({"id": "ok", "content": "fits", "output": []}))
            } else {
                Reply::json(400, &refused)
            }
        });
        let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
        let got = TestClient::http1()
            .exchange(
                "POST",
                &proxy.url(path),
                &[
                    ("content-type", "application/json"),
                    ("x-api-key", "sk-retry"),
                ],
                Bytes::from(body.to_string()),
            )
            .await;
        assert_eq!(got.status, 200, "{path}: {:?}", got.body);
        assert_eq!(got.header("x-compactor-retried"), Some("true"), "{path}");
        let sent: Vec<Value> = agent_requests(&mock)
            .iter()
            .map(|r| serde_json::from_slice(&r.body).expect("JSON"))
            .collect();
        assert_eq!(sent.len(), 2, "{path}");
        let (before, after) = (
            body[field].as_array().expect("conversation"),
            sent[1][field].as_array().expect("conversation"),
        );
        assert!(after.len() <= limit, "{path}: {} items", after.len());
        match path {
            "/v1/messages" => {
                // Roles alternate, so the summary leads the last user message, whose own
                // words follow it unchanged.
                let last = after.last().expect("a last message");
                let blocks = last["content"].as_array().expect("blocks");
                assert_eq!(
                    blocks.last().map(|b| &b["text"]),
                    Some(&json!("now run the tests"))
                );
                assert_eq!(sent[1]["system"], body["system"]);
                support::anthropic_rules::check_messages(&sent[1], 200_000)
            }
            _ => {
                assert_eq!(after.last(), before.last(), "{path}: latest turn verbatim");
                assert_eq!(sent[1]["store"], false);
                support::responses_rules::check_responses(&sent[1], 200_000)
            }
        }
        .unwrap_or_else(|e| panic!("{path}: {e:?}"));
        proxy.shutdown().await;
    }
}

/// A summary far longer than any window: a compaction with it is never smaller than what
/// it replaces, so every attempt is a call that fails.
fn endless_summary() -> Reply {
    Reply::json(
        200,
        &json!({"id": "s", "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant",
                                         "content": "long summary ".repeat(4000)}}]}),
    )
}

/// A provider that refuses every request for its length and answers every summary with
/// [`endless_summary`].
async fn incurable_provider() -> MockUpstream {
    let mock = MockUpstream::start().await;
    mock.set_handler(|r| {
        if is_summary_request(r) {
            endless_summary()
        } else {
            refusal()
        }
    });
    mock
}

/// The summarizer calls the mock received.
fn summarizer_calls(mock: &MockUpstream) -> usize {
    mock.requests()
        .iter()
        .filter(|r| is_summary_request(r))
        .count()
}

/// Summaries from the caller's provider (the mock), so the test counts every call.
const LLM_SUMMARIES: &str = "[compaction]\nmax_messages = 1000\nmin_preserve_tokens = 20\n\
                             max_preserve_tokens = 200\n[summarizer]\nbackend = \"openai\"\n";

#[tokio::test]
async fn a_request_makes_at_most_three_summarizer_calls_before_and_after_a_refusal() {
    // The trigger fires on the request (20 messages over `max_messages = 10`) and its three
    // attempts each get a summary too long to help; the provider then refuses the request for
    // its length. The compaction after the refusal has no call left.
    let mock = incurable_provider().await;
    let config = LLM_SUMMARIES.replace("max_messages = 1000", "max_messages = 10");
    let proxy = TestProxy::start(&format!("{}{config}", upstream_toml(&mock.url()))).await;
    let body = json!({"model": "gpt-4o", "messages": conversation(19)});
    let got = send(&proxy, &body).await;
    assert_eq!(got.status, 400, "the refusal reaches the client");
    assert_eq!(got.json()["error"]["code"], "context_length_exceeded");
    assert_eq!(
        summarizer_calls(&mock),
        3,
        "three calls for the client request, across both compactions"
    );
    assert_eq!(
        metric(
            &proxy,
            "compactor_compactions_total",
            &[("trigger", "overflow"), ("outcome", "failed")]
        )
        .await,
        1.0,
        "the refusal was seen and not compacted again"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn the_session_breaker_stops_compactions_after_refusals_that_cannot_be_cured() {
    // No trigger fires; every request is refused for its length and every compaction after
    // the refusal fails. After three failures the conversation's breaker opens: later
    // refusals are passed on without calling the summarizer.
    let mock = incurable_provider().await;
    let proxy = TestProxy::start(&format!("{}{LLM_SUMMARIES}", upstream_toml(&mock.url()))).await;
    let mut messages = conversation(19);
    let mut calls = Vec::new();
    for turn in 0..5 {
        let got = send(&proxy, &json!({"model": "gpt-4o", "messages": messages})).await;
        assert_eq!(got.status, 400, "turn {turn}");
        calls.push(summarizer_calls(&mock));
        messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
        messages.push(json!({"role": "user", "content": format!("question {turn}")}));
    }
    assert!(calls[0] > 0, "the first refusal is compacted: {calls:?}");
    assert_eq!(
        calls[2], calls[4],
        "no summarizer call once the breaker is open: {calls:?}"
    );
    assert_eq!(
        metric(
            &proxy,
            "compactor_compactions_total",
            &[("trigger", "overflow"), ("outcome", "breaker")]
        )
        .await,
        2.0
    );
    assert_eq!(
        metric(&proxy, "compactor_breaker_open_total", &[]).await,
        1.0
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn retries_refused_again_for_their_length_open_the_session_breaker() {
    // Every compaction after a refusal makes a smaller request, and the provider refuses that
    // one for its length too (its window is smaller than anything compactor can make). The
    // provider's answer is what counts: after three such retries the conversation's breaker
    // opens and later refusals are passed on without calling the summarizer.
    let mock = MockUpstream::start().await;
    mock.set_handler(|r| {
        if is_summary_request(r) {
            answer(false)
        } else {
            refusal()
        }
    });
    let proxy = TestProxy::start(&format!("{}{LLM_SUMMARIES}", upstream_toml(&mock.url()))).await;
    let mut messages = conversation(19);
    let mut calls = Vec::new();
    for turn in 0..5 {
        let got = send(&proxy, &json!({"model": "gpt-4o", "messages": messages})).await;
        assert_eq!(got.status, 400, "turn {turn}");
        assert_eq!(got.json()["error"]["code"], "context_length_exceeded");
        calls.push(summarizer_calls(&mock));
        messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
        messages.push(json!({"role": "user", "content": format!("question {turn}")}));
    }
    assert_eq!(
        metric(
            &proxy,
            "compactor_retries_total",
            &[
                ("reason", "context_length"),
                ("outcome", "retried"),
                ("via", "status")
            ]
        )
        .await,
        3.0,
        "three smaller requests were sent: {calls:?}"
    );
    assert_eq!(
        calls[2], calls[4],
        "no call once the breaker is open: {calls:?}"
    );
    assert_eq!(
        metric(&proxy, "compactor_breaker_open_total", &[]).await,
        1.0
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_refusal_that_names_no_window_teaches_its_size_as_a_ceiling() {
    // OpenAI's Responses refusal names no numbers. The refused request's size bounds the
    // window: learned, so the conversation's next, larger request is compacted by the trigger
    // before it is sent instead of being refused again.
    let words = "the parser drops trailing commas ".repeat(6);
    let items = |n: usize| {
        let mut items =
            vec![json!({"type": "message", "role": "developer", "content": "Be brief."})];
        for i in 0..n {
            items.push(json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": format!("task {i}: {words}")}]}));
            items.push(json!({"type": "function_call", "call_id": format!("call_{i}"), "name": "shell", "arguments": "{\"command\":[\"ls\"]}"}));
            items.push(json!({"type": "function_call_output", "call_id": format!("call_{i}"), "output": words.repeat(8)}));
        }
        items.push(json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go on"}]}));
        json!({"model": "gpt-5-codex", "store": false, "input": items})
    };
    let refusal = json!({"error": {"message": "Your input exceeds the context window of this model. Please adjust your input and try again.",
        "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}});
    let mock = MockUpstream::start().await;
    mock.set_handler(move |r| {
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        if is_summary_request(r) || v["input"].as_array().map_or(0, Vec::len) <= 12 {
            Reply::json(200, &json!({"id": "ok", "output": []}))
        } else {
            Reply::json(400, &refusal)
        }
    });
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
    let send = |body: Value| {
        let url = proxy.url("/v1/responses");
        async move {
            TestClient::http1()
                .exchange(
                    "POST",
                    &url,
                    &[
                        ("content-type", "application/json"),
                        ("authorization", "Bearer sk-retry"),
                    ],
                    Bytes::from(body.to_string()),
                )
                .await
        }
    };
    let refused = |mock: &MockUpstream| {
        agent_requests(mock)
            .iter()
            .filter(|r| {
                let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
                v["input"].as_array().map_or(0, Vec::len) > 12
            })
            .count()
    };
    let first = send(items(6)).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("x-compactor-retried"), Some("true"));
    assert_eq!(refused(&mock), 1);
    assert_eq!(
        metric(
            &proxy,
            "compactor_context_window_learned_total",
            &[("source", "refused")]
        )
        .await,
        1.0
    );
    let (status, models) = TestClient::http1()
        .get_text(&proxy.admin_url("/models"))
        .await;
    assert_eq!(status, 200);
    assert!(models.contains("\"refused\""), "{models}");

    let next = send(items(8)).await;
    assert_eq!(next.status, 200);
    assert_eq!(
        next.header("x-compactor-retried"),
        None,
        "compacted before it was sent"
    );
    assert_eq!(next.header("x-compactor-compacted"), Some("true"));
    assert_eq!(refused(&mock), 1, "no second refusal");
    proxy.shutdown().await;
}
