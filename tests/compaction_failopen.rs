//! Fail open, through the real proxy: when a due compaction does not happen (blank summary,
//! summarizer error, summarizer timeout, an answer over `summarizer.max_summary_bytes`) the
//! ORIGINAL request goes upstream byte for byte, the client gets the upstream's answer and the
//! failure is counted once. Requests that need no compaction, or that are not JSON at all,
//! arrive byte-identical; fields compactor does not interpret survive a real rewrite with their
//! values, bytes and order.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde::Deserializer as _;
use serde_json::{json, Value};

use support::summary_calls::{self, asked_inside, is_summary_request, prompt_of};
use support::{upstream_toml, Exchange, MockUpstream, Recorded, Reply, TestClient, TestProxy};

const COMPACTIONS: &str = "compactor_compactions_total";

/// Triggers on the message count only: 14 messages > 10, about 300 tokens.
const SMALL: &str = "[compaction]\nmax_messages = 10\nmin_preserve_tokens = 20\n\
                     max_preserve_tokens = 60\n";

const AUTH: &str = "Bearer sk-failopen";

/// A conversation of `n` messages after the system prompt, alternating user / assistant.
fn conversation(n: usize) -> Vec<Value> {
    let mut m = vec![json!({"role": "system", "content": "You are a careful assistant."})];
    for i in 0..n {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        m.push(json!({"role": role, "content": format!("turn {i}: {}", "words ".repeat(8))}));
    }
    m
}

/// A triggering request, serialised with unusual spacing so that any re-serialisation shows.
fn triggering_body() -> Vec<u8> {
    let messages = serde_json::to_string_pretty(&conversation(13)).expect("json");
    format!("{{ \"model\" : \"gpt-4o\",\n  \"temperature\": 0.70, \"messages\": {messages} }}\n")
        .into_bytes()
}

/// The upstream's answer to chat requests (distinct bytes, so the test sees it is passed on).
fn upstream_answer() -> Reply {
    Reply::json(
        200,
        &json!({"id": "chatcmpl-upstream-7", "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "from upstream"}}]}),
    )
    .with_header("x-upstream", "yes")
}

fn completion(content: &str) -> Reply {
    Reply::json(200, &summary_calls::completion(content))
}

/// Mock whose summary requests get `summary` and whose other requests get [`upstream_answer`].
async fn mock_with(summary: impl Fn() -> Reply + Send + Sync + 'static) -> MockUpstream {
    let mock = MockUpstream::start().await;
    mock.set_handler(move |r| {
        if is_summary_request(r) {
            summary()
        } else {
            upstream_answer()
        }
    });
    mock
}

async fn send(proxy: &TestProxy, body: &[u8]) -> Exchange {
    let headers = [
        ("content-type", "application/json"),
        ("authorization", AUTH),
    ];
    TestClient::http1()
        .exchange(
            "POST",
            &proxy.url("/v1/chat/completions"),
            &headers,
            Bytes::copy_from_slice(body),
        )
        .await
}

/// The chat requests the upstream received (summary requests left out).
fn forwarded(mock: &MockUpstream) -> Vec<Recorded> {
    mock.requests()
        .into_iter()
        .filter(|r| !is_summary_request(r))
        .collect()
}

async fn compactions(proxy: &TestProxy, trigger: &str, outcome: &str) -> f64 {
    proxy
        .metric(COMPACTIONS, &[("trigger", trigger), ("outcome", outcome)])
        .await
        .unwrap_or(0.0)
}

/// Sends the triggering request through a proxy configured with `summarizer_toml`; checks the
/// original went upstream byte-identical, the client got the upstream's 200, and the failure
/// was counted exactly once under `outcome`. Returns the mock for further checks.
async fn assert_fails_open(
    mock: MockUpstream,
    summarizer_toml: &str,
    outcome: &str,
) -> MockUpstream {
    let (proxy, mock) = fails_open(mock, summarizer_toml, outcome).await;
    proxy.shutdown().await;
    mock
}

/// [`assert_fails_open`], leaving the proxy running for further checks of its metrics.
async fn fails_open(
    mock: MockUpstream,
    summarizer_toml: &str,
    outcome: &str,
) -> (TestProxy, MockUpstream) {
    let proxy = TestProxy::start(&format!(
        "{}{SMALL}{summarizer_toml}",
        upstream_toml(&mock.url())
    ))
    .await;
    let body = triggering_body();
    let sent = send(&proxy, &body).await;
    assert_eq!(sent.status, 200, "{}", String::from_utf8_lossy(&sent.body));
    assert_eq!(
        sent.header("x-upstream"),
        Some("yes"),
        "the upstream's response"
    );
    let v: Value = serde_json::from_slice(&sent.body).expect("JSON");
    assert_eq!(v["id"], "chatcmpl-upstream-7");
    assert_eq!(sent.header("x-compactor-compacted"), Some("false"));

    let chats = forwarded(&mock);
    assert_eq!(chats.len(), 1, "forwarded once");
    assert_eq!(chats[0].body, body, "the original request, byte for byte");
    assert_eq!(chats[0].header("authorization"), Some(AUTH));
    assert_eq!(
        chats[0].header("content-length"),
        Some(body.len().to_string().as_str())
    );

    assert_eq!(
        compactions(&proxy, "messages", outcome).await,
        1.0,
        "{outcome} counted once"
    );
    for other in ["compacted", "failed", "blank"] {
        if other != outcome {
            assert_eq!(compactions(&proxy, "messages", other).await, 0.0, "{other}");
        }
    }
    assert_eq!(compactions(&proxy, "tokens", outcome).await, 0.0);
    (proxy, mock)
}

#[tokio::test]
async fn a_blank_summary_from_an_exec_plugin_forwards_the_original() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("blank.py");
    std::fs::write(
        &script,
        "import json, sys\nsys.stdin.read()\nprint(json.dumps({\"summary\": \"  \"}))\n",
    )
    .expect("write script");
    let toml = format!(
        "[summarizer]\nbackend = \"exec\"\n[summarizer.exec]\ncommand = \"python3\"\n\
         args = [\"{}\"]\n",
        script.display()
    );
    let mock = mock_with(upstream_answer).await;
    let mock = assert_fails_open(mock, &toml, "blank").await;
    assert_eq!(mock.request_count(), 1, "exec asks no one");
}

#[tokio::test]
async fn a_blank_summary_from_the_openai_backend_forwards_the_original() {
    let mock = mock_with(|| completion(" \n\t ")).await;
    let mock = assert_fails_open(mock, "", "blank").await;
    let summaries: Vec<Recorded> = mock
        .requests()
        .into_iter()
        .filter(is_summary_request)
        .collect();
    // Asked inside the conversation first (the default model has no price: as the agents
    // ask), then, that answer blank, with the standalone prompt: blank too.
    assert_eq!(summaries.len(), 2, "the summarizer was asked twice");
    let prompts: Vec<String> = summaries.iter().filter_map(prompt_of).collect();
    assert!(asked_inside(&prompts[0]), "{}", prompts[0]);
    assert!(!asked_inside(&prompts[1]), "{}", prompts[1]);
    for call in &summaries {
        assert_eq!(call.header("authorization"), Some(AUTH));
    }
}

#[tokio::test]
async fn a_summarizer_error_forwards_the_original() {
    let mock = mock_with(|| Reply::status(500)).await;
    let mock = assert_fails_open(mock, "", "failed").await;
    assert_eq!(
        mock.requests()
            .iter()
            .filter(|r| is_summary_request(r))
            .count(),
        1
    );
}

#[tokio::test]
async fn a_summarizer_timeout_forwards_the_original() {
    let mock = mock_with(|| Reply::Stall).await;
    let started = Instant::now();
    let mock = assert_fails_open(mock, "[summarizer]\ntimeout_secs = 0.3\n", "failed").await;
    // Bounded by the summarizer timeout, not by the test's own 20 s limit.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        mock.requests()
            .iter()
            .filter(|r| is_summary_request(r))
            .count(),
        1
    );
}

/// The summary requests the mock received.
fn summary_requests(mock: &MockUpstream) -> usize {
    mock.requests()
        .iter()
        .filter(|r| is_summary_request(r))
        .count()
}

/// `compactor_summarizer_requests_total` of the default (`auto`) backend with `outcome`.
async fn summarizer_calls(proxy: &TestProxy, outcome: &str) -> f64 {
    proxy
        .metric(
            "compactor_summarizer_requests_total",
            &[("backend", "auto"), ("outcome", outcome)],
        )
        .await
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_ten_megabyte_summarizer_answer_is_refused_unread_and_not_asked_for_again() {
    // The issue's case: a 10 MB answer, a well-formed completion, against the default bound
    // (1 MiB of summary + 64 KiB of JSON around it).
    let answer = Bytes::from(summary_calls::completion(&"s".repeat(10 * 1024 * 1024)).to_string());
    let mock = mock_with(move || Reply::bytes(200, "application/json", answer.clone())).await;
    let (proxy, mock) = fails_open(mock, "", "failed").await;
    assert_eq!(summary_requests(&mock), 1, "the summarizer was asked once");
    assert_eq!(summarizer_calls(&proxy, "too_large").await, 1.0);
    assert_eq!(summarizer_calls(&proxy, "ok").await, 0.0);
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_summary_over_the_bound_in_a_small_answer_is_refused_and_not_asked_for_again() {
    // 3,000 bytes of summary in an answer the transport may read: the summary itself is over
    // the bound. (Taken, it would not have made this small request smaller, and each further
    // attempt would have asked again.)
    let mock = mock_with(|| completion(&"s".repeat(3_000))).await;
    let (proxy, mock) =
        fails_open(mock, "[summarizer]\nmax_summary_bytes = 2000\n", "failed").await;
    assert_eq!(summary_requests(&mock), 1, "the summarizer was asked once");
    assert_eq!(summarizer_calls(&proxy, "too_large").await, 1.0);
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_request_below_the_triggers_arrives_byte_identical() {
    let mock = mock_with(|| Reply::status(500)).await;
    let proxy = TestProxy::start(&format!("{}{SMALL}", upstream_toml(&mock.url()))).await;
    let body =
        b"{\"messages\":[ {\"role\":\"user\",\"content\":\"caf\\u00e9 \\ud83d\\ude00\"} ],\n\
                 \"model\":\"gpt-4o\", \"max_tokens\": 1e2, \"x_vendor\": {\"z\":1,\"a\":[]}}";
    let sent = send(&proxy, body).await;
    assert_eq!(sent.status, 200);
    assert_eq!(sent.header("x-compactor-compacted"), Some("false"));
    assert_eq!(mock.request_count(), 1);
    assert_eq!(mock.last_request().body, body.to_vec());
    for outcome in ["compacted", "failed", "blank"] {
        assert_eq!(compactions(&proxy, "messages", outcome).await, 0.0);
        assert_eq!(compactions(&proxy, "tokens", outcome).await, 0.0);
    }
    assert_eq!(compactions(&proxy, "none", "unreadable").await, 0.0);
    proxy.shutdown().await;
}

#[tokio::test]
async fn invalid_json_is_forwarded_byte_identical_and_the_upstream_decides() {
    let mock = MockUpstream::start().await;
    mock.set_handler(|_| {
        Reply::json(
            400,
            &json!({"error": {"message": "upstream says: bad JSON"}}),
        )
    });
    let proxy = TestProxy::start(&format!("{}{SMALL}", upstream_toml(&mock.url()))).await;
    for body in [
        &b"{\"model\": \"gpt-4o\", \"messages\": [ {\"role\": \"user\""[..],
        b"\xff\xfe not even UTF-8",
        b"",
    ] {
        let before = mock.request_count();
        let sent = send(&proxy, body).await;
        assert_eq!(sent.status, 400, "the upstream's status");
        assert!(
            String::from_utf8_lossy(&sent.body).contains("upstream says"),
            "the upstream's body"
        );
        assert_eq!(mock.request_count(), before + 1);
        assert_eq!(mock.last_request().body, body.to_vec(), "byte-identical");
    }
    for outcome in ["compacted", "failed", "blank"] {
        assert_eq!(compactions(&proxy, "messages", outcome).await, 0.0);
    }
    assert_eq!(compactions(&proxy, "none", "unreadable").await, 3.0);
    proxy.shutdown().await;
}

/// The top-level keys of a JSON object, in document order.
fn top_level_keys(body: &[u8]) -> Vec<String> {
    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Vec<String>, A::Error> {
            let mut keys = Vec::new();
            while let Some(k) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                keys.push(k);
            }
            Ok(keys)
        }
    }
    serde_json::Deserializer::from_slice(body)
        .deserialize_map(Keys)
        .expect("a JSON object")
}

#[tokio::test]
async fn unknown_fields_survive_a_real_rewrite() {
    let mock = mock_with(upstream_answer).await;
    let proxy = TestProxy::start(&format!(
        "{}{SMALL}[summarizer]\nbackend = \"extractive\"\n",
        upstream_toml(&mock.url())
    ))
    .await;
    // Long early turns (worth summarising), a short recent tail.
    let mut messages = conversation(13);
    for m in &mut messages[1..11] {
        m["content"] = json!(format!(
            "{} {}",
            m["content"].as_str().unwrap_or(""),
            "more ".repeat(120)
        ));
    }
    messages[0]["name"] = json!("system-prompt-v2");
    let last = messages.len() - 1;
    messages[last - 2]["name"] = json!("alice");
    messages[last]["content"] = json!([
        {"type": "text", "text": "Please continue.",
         "cache_control": {"type": "ephemeral"}}
    ]);
    messages[last]["cache_control"] = json!({"type": "ephemeral", "ttl": "5m"});
    // Raw bytes (`1.50`, `2e0`, spacing) that a re-serialisation would normalise.
    let x_foo = "{\"b\": 1, \"a\": [1.50, 2e0]}";
    let body = format!(
        "{{\"model\": \"gpt-4o\", \"response_format\": {{\"type\": \"json_object\"}}, \
         \"messages\": {}, \"stream_options\": {{\"include_usage\": true}}, \
         \"x_foo\": {x_foo}, \"temperature\": 0.0, \"stream\": false}}",
        serde_json::to_string(&messages).expect("json")
    )
    .into_bytes();

    let sent = send(&proxy, &body).await;
    assert_eq!(sent.status, 200);
    assert_eq!(sent.header("x-compactor-compacted"), Some("true"));
    assert_eq!(compactions(&proxy, "messages", "compacted").await, 1.0);
    let chats = forwarded(&mock);
    assert_eq!(chats.len(), 1);
    let out_bytes = &chats[0].body;
    assert_ne!(out_bytes, &body, "rewritten");

    assert_eq!(
        top_level_keys(out_bytes),
        top_level_keys(&body),
        "key order"
    );
    let original: Value = serde_json::from_slice(&body).expect("json");
    let out: Value = serde_json::from_slice(out_bytes).expect("forwarded JSON");
    for key in [
        "model",
        "response_format",
        "stream_options",
        "x_foo",
        "temperature",
        "stream",
    ] {
        assert_eq!(out[key], original[key], "{key}");
    }
    let text = String::from_utf8_lossy(out_bytes);
    assert!(text.contains(x_foo), "raw bytes of x_foo kept: {text}");
    assert!(
        text.contains("\"temperature\": 0.0"),
        "0.0 not re-serialised: {text}"
    );

    let out_messages = out["messages"].as_array().expect("messages");
    assert!(out_messages.len() < messages.len());
    assert_eq!(out_messages[0], messages[0], "system message with its name");
    assert_eq!(out_messages[1], messages[1], "the opening kept");
    let tail = &out_messages[3..];
    assert!(
        tail.len() >= 3,
        "the tail reaches the named message: {}",
        tail.len()
    );
    assert_eq!(tail, &messages[messages.len() - tail.len()..]);
    assert_eq!(tail[tail.len() - 3]["name"], "alice");
    assert_eq!(
        tail[tail.len() - 1]["cache_control"],
        json!({"type": "ephemeral", "ttl": "5m"})
    );
    assert_eq!(
        tail[tail.len() - 1]["content"][0]["cache_control"],
        json!({"type": "ephemeral"})
    );
    proxy.shutdown().await;
}

/// `depth` nested arrays around `0`: valid JSON that no reader may walk by recursion.
fn nested(depth: usize) -> String {
    format!("{}0{}", "[".repeat(depth), "]".repeat(depth))
}

/// JSON nested far deeper than any reader's recursion could survive, wherever compactor reads
/// (a message's unknown field, a content block, tool definitions, a top-level field; in every
/// dialect, below and over the trigger) is forwarded as sent: the proxy neither crashes nor
/// refuses it, and the upstream decides.
#[tokio::test]
async fn deeply_nested_json_anywhere_is_forwarded_byte_identical_in_every_dialect() {
    let mock = mock_with(|| completion("SUMMARY")).await;
    let proxy = TestProxy::start(&format!("{}{SMALL}", upstream_toml(&mock.url()))).await;
    let deep = nested(200_000);
    let old_turns: Vec<String> = (0..12)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            format!(r#"{{"role":"{role}","content":"turn {i}","x":{deep}}}"#)
        })
        .collect();
    let old_turns = old_turns.join(",");
    // Tool calls and outputs enough for masking to weigh them (strategy `hybrid`, the default).
    let chat_tools: Vec<String> = (0..20)
        .map(|i| {
            format!(
                r#"{{"role":"assistant","content":null,"tool_calls":[{{"id":"c{i}","type":"function","function":{{"name":"f","arguments":"{{}}"}},"x":{deep}}}]}},{{"role":"tool","tool_call_id":"c{i}","content":"output {i}","x":{deep}}}"#
            )
        })
        .collect();
    let chat_tools = chat_tools.join(",");
    let claude_tools: Vec<String> = (0..20)
        .map(|i| {
            format!(
                r#"{{"role":"assistant","content":[{{"type":"tool_use","id":"t{i}","name":"f","input":{deep}}}]}},{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t{i}","content":"output {i}","x":{deep}}}]}}"#
            )
        })
        .collect();
    let claude_tools = claude_tools.join(",");
    let chat =
        |messages: &str| format!(r#"{{"model":"gpt-4o","messages":[{messages}],"x":{deep}}}"#);
    let cases = [
        (
            "/v1/chat/completions",
            chat(&format!(r#"{{"role":"user","content":"hi","x":{deep}}}"#)),
        ),
        (
            "/v1/chat/completions",
            format!(
                r#"{{"model":"gpt-4o","tools":[{{"type":"function","function":{{"name":"f","parameters":{deep}}}}}],"messages":[{{"role":"user","content":"hi"}}]}}"#
            ),
        ),
        (
            "/v1/chat/completions",
            chat(&format!(r#"{old_turns},{{"role":"user","content":"now"}}"#)),
        ),
        (
            "/v1/messages",
            format!(
                r#"{{"model":"claude-sonnet-4-5","max_tokens":100,"system":[{{"type":"text","text":"s","x":{deep}}}],"messages":[{{"role":"user","content":[{{"type":"text","text":"hi","x":{deep}}}]}}]}}"#
            ),
        ),
        (
            "/v1/messages",
            format!(
                r#"{{"model":"claude-sonnet-4-5","max_tokens":100,"messages":[{old_turns},{{"role":"user","content":"now"}}]}}"#
            ),
        ),
        (
            "/v1/chat/completions",
            chat(&format!(r#"{{"role":"user","content":"go"}},{chat_tools}"#)),
        ),
        (
            "/v1/messages",
            format!(
                r#"{{"model":"claude-sonnet-4-5","max_tokens":100,"messages":[{{"role":"user","content":"go"}},{claude_tools},{{"role":"assistant","content":"done"}},{{"role":"user","content":"next"}}]}}"#
            ),
        ),
        (
            "/v1/responses",
            format!(
                r#"{{"model":"gpt-5","input":[{{"type":"message","role":"user","content":[{{"type":"input_text","text":"hi","x":{deep}}}]}}],"metadata":{deep}}}"#
            ),
        ),
    ];
    let headers = [
        ("content-type", "application/json"),
        ("authorization", AUTH),
        ("anthropic-version", "2023-06-01"),
    ];
    for (path, body) in cases {
        let before = forwarded(&mock).len();
        let sent = TestClient::http1()
            .exchange("POST", &proxy.url(path), &headers, body.clone())
            .await;
        assert_eq!(sent.status, 200, "{path}: the upstream's answer");
        let forwarded = forwarded(&mock);
        assert_eq!(forwarded.len(), before + 1, "{path}: forwarded once");
        assert!(
            forwarded[before].body == body.as_bytes(),
            "{path}: forwarded byte-identical"
        );
    }
    proxy.shutdown().await;
}

/// A compressed request body (Codex compresses its requests with zstd when signed in with
/// ChatGPT) is not read: it goes upstream as sent, its `Content-Encoding` with it, counted as
/// unreadable, never half-decoded or forwarded without its encoding.
#[tokio::test]
async fn a_compressed_request_body_is_forwarded_as_sent_with_its_encoding() {
    use std::io::Write;
    let mock = mock_with(|| completion("never asked")).await;
    let proxy = TestProxy::start(&format!("{}{SMALL}", upstream_toml(&mock.url()))).await;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&triggering_body()).expect("gzip");
    let compressed = gz.finish().expect("gzip");
    let sent = TestClient::http1()
        .exchange(
            "POST",
            &proxy.url("/v1/chat/completions"),
            &[
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
                ("authorization", AUTH),
            ],
            Bytes::from(compressed.clone()),
        )
        .await;
    assert_eq!(sent.status, 200);
    let got = forwarded(&mock);
    assert_eq!(got.len(), 1, "no summary was asked for");
    assert_eq!(got[0].body, compressed, "byte-identical");
    assert_eq!(got[0].header("content-encoding"), Some("gzip"));
    assert_eq!(compactions(&proxy, "none", "unreadable").await, 1.0);
    proxy.shutdown().await;
}
