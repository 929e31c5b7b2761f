//! Credentials never reach the log, at any level: the binary runs with `RUST_LOG=trace` and
//! the access log on, serves requests carrying every credential header (and one in a query
//! string, and Gemini's `key` parameter) over HTTP/1.1 and HTTP/2 (plain, chat requests that
//! compact through the caller-credential summarizer, Chat Completions and Gemini, and one
//! that fails upstream), and its whole log is searched for the secrets. The access log has its
//! line per request.

mod support;

use serde_json::json;
use support::{upstream_toml, Binary, MockUpstream, Reply, TestClient};

const SECRETS: [(&str, &str); 5] = [
    ("authorization", "Bearer sk-test-SECRET-authorization"),
    ("x-api-key", "sk-ant-SECRET-x-api-key"),
    ("api-key", "SECRET-azure-api-key"),
    ("x-goog-api-key", "SECRET-gemini-header-key"),
    ("cookie", "session=SECRET-cookie"),
];

#[tokio::test]
async fn no_credential_appears_in_trace_logs() {
    let mock = MockUpstream::start().await;
    // Summarizer calls (the caller's own credentials, default `auto` backend) get a summary;
    // everything else a plain completion.
    mock.set_handler(|r| {
        let body = String::from_utf8_lossy(&r.body);
        let content = if body.contains("<task>") { "SUMMARY" } else { "ok" };
        if r.path().contains(":generateContent") {
            return Reply::json(
                200,
                &json!({"candidates": [{"content": {"role": "model", "parts": [{"text": content}]},
                                        "finishReason": "STOP", "index": 0}]}),
            );
        }
        Reply::json(
            200,
            &json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}),
        )
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("compactor.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             access_log = true\n[compaction]\nmax_messages = 4\nmin_preserve_tokens = 10\n\n{}",
            upstream_toml(&mock.url())
        ),
    )
    .expect("write config");
    let mut binary = Binary::serve_with_log(&config, dir.path(), "trace").await;

    let mut messages = vec![json!({"role": "system", "content": "s"})];
    for i in 0..7 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": format!("turn {i} {}", "z".repeat(2000))}));
    }
    let chat = json!({"model": "gpt-4o", "messages": messages}).to_string();
    let contents: Vec<_> = (0..7)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "model" };
            json!({"role": role, "parts": [{"text": format!("turn {i} {}", "z".repeat(2000))}]})
        })
        .collect();
    let gemini = json!({"contents": contents}).to_string();
    for client in [TestClient::http1(), TestClient::h2c()] {
        for (path, body) in [
            ("/v1/models?api_key=SECRET-in-query", String::new()),
            ("/v1/chat/completions", chat.clone()),
            (
                "/v1beta/models/gemini-2.5-flash:generateContent?key=SECRET-gemini-query-key",
                gemini.clone(),
            ),
        ] {
            let method = if body.is_empty() { "GET" } else { "POST" };
            let response = client
                .request(
                    method,
                    &format!("http://{}{path}", binary.proxy),
                    &SECRETS,
                    body,
                )
                .await;
            assert_eq!(response.status(), 200);
            support::body_bytes(response).await;
        }
    }
    // The summarizer was called with the caller's credential: the secret did travel upstream.
    let summarizer_calls: Vec<_> = mock
        .requests()
        .into_iter()
        .filter(|r| String::from_utf8_lossy(&r.body).contains("<task>"))
        .collect();
    assert!(!summarizer_calls.is_empty(), "the chat request compacted");
    assert_eq!(
        summarizer_calls[0].header("authorization"),
        Some(SECRETS[0].1)
    );
    // The Gemini request was summarised by Gemini, with the caller's key.
    let gemini_call = summarizer_calls
        .iter()
        .find(|r| r.path() == "/v1beta/models/gemini-2.5-flash:generateContent")
        .expect("a Gemini summary call");
    assert_eq!(gemini_call.header("x-goog-api-key"), Some(SECRETS[3].1));

    binary.signal("TERM");
    support::within("compactor exit", binary.child.wait())
        .await
        .expect("wait");
    let rest = (&mut binary.drain).await.unwrap_or_default();
    let log = [binary.log.clone(), rest].concat().join("\n");
    assert!(
        log.lines().count() > 20,
        "trace logging produced too little to be meaningful:\n{log}"
    );
    // One structured event per compaction, with its figures and without message contents.
    let event = log
        .lines()
        .find(|l| l.contains("INFO") && l.contains(" compaction "))
        .unwrap_or_else(|| panic!("no compaction event in the log:\n{log}"));
    for field in [
        "session=",
        "trigger=\"messages\"",
        "outcome=",
        "messages_before=",
        "messages_after=",
        "tokens_before=",
        "tokens_after=",
        "summarizer=\"auto\"",
        "duration_ms=",
    ] {
        assert!(event.contains(field), "{field} missing from {event}");
    }
    assert!(
        !log.contains(&"z".repeat(50)),
        "message contents reached the log"
    );
    // One access line per request: the two paths on both protocols, with their figures.
    let access: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("compactor::access"))
        .collect();
    assert_eq!(access.len(), 6, "{log}");
    let upstream = format!("upstream=\"{}\"", mock.url().trim_end_matches('/'));
    for line in &access {
        for field in ["method=", "path=\"/v1", "status=200", "duration_ms="] {
            assert!(line.contains(field), "{field} missing from {line}");
        }
        assert!(line.contains(&upstream), "{upstream} missing from {line}");
    }
    let chat = access
        .iter()
        .find(|l| l.contains("path=\"/v1/chat/completions\""))
        .expect("a chat request's line");
    for field in [
        "compacted=\"true\"",
        "session=",
        "tokens_in=",
        "tokens_out=",
    ] {
        assert!(chat.contains(field), "{field} missing from {chat}");
    }
    assert!(!chat.contains("session=\"-\""), "{chat}");
    // Every secret value contains this marker; no fragment of one may be logged.
    for line in log.lines() {
        assert!(
            !line.contains("SECRET"),
            "a credential leaked into the log: {line}"
        );
    }
}
