//! Google Gemini through the real proxy: a Gemini CLI–shaped conversation
//! (`POST /v1beta/models/{model}:streamGenerateContent?alt=sse`, `contents` of `user` and
//! `model` entries with `functionCall` / `functionResponse` parts and thought signatures, a
//! `systemInstruction`, tools and a `generationConfig`) against a mock provider that enforces
//! Gemini's request rules (`compactor_plugin_testing::rules::gemini`). Over the message count
//! the request is compacted, valid for Gemini, every other field and the query string kept;
//! the model named in the path decides the window; Gemini's over-window 400 is compacted and
//! sent again before the agent sees it; `usageMetadata` is read off the stream (priced at the
//! model's prices); with `auto`, the summary is asked of the caller's own Gemini, with its own
//! key, on its own model.

mod support;

use compactor::compaction::prompt::SUMMARY_INTRO;
use compactor_plugin_testing::rules::gemini::{check_gemini, rejection_body};
use compactor_plugin_testing::rules::Rejection;
use serde_json::{json, Value};

use support::{upstream_toml, MockUpstream, Recorded, Reply, TestClient, TestProxy};

const KEY: &str = "AIza-test-key";

/// A Gemini CLI–like request of `steps` shell steps (each a model call and its answer).
fn request(steps: usize, output_lines: usize) -> Vec<u8> {
    let mut contents = vec![json!({"role": "user", "parts": [
        {"text": "<session_context>\nRULE-PURPLE: answer in lowercase.\n</session_context>"},
        {"text": "Walk through the aardvark ledger, one step at a time."}
    ]})];
    for k in 1..=steps {
        contents.push(json!({"role": "model", "parts": [
            {"text": format!("Running step {k}.")},
            {"functionCall": {"id": format!("run_shell_command_{k}"), "name": "run_shell_command",
                              "args": {"command": format!("echo step-{k}")}},
             "thoughtSignature": "c2lnbmF0dXJl"}
        ]}));
        let output: String = (0..output_lines)
            .map(|i| format!("line {k}.{i}\n"))
            .collect();
        contents.push(json!({"role": "user", "parts": [
            {"functionResponse": {"id": format!("run_shell_command_{k}"), "name": "run_shell_command",
                                  "response": {"output": format!("step-{k}\n{output}")}}}
        ]}));
    }
    serde_json::to_vec(&json!({
        "contents": contents,
        "systemInstruction": {"role": "user", "parts": [{"text": "You are a CLI agent."}]},
        "tools": [{"functionDeclarations": [{"name": "run_shell_command",
            "parametersJsonSchema": {"type": "object", "properties": {"command": {"type": "string"}}}}]}],
        "generationConfig": {"temperature": 1, "thinkingConfig": {"includeThoughts": true, "thinkingBudget": 8192}}
    }))
    .expect("json")
}

/// One streamed answer with its usage, as Gemini sends it.
fn streamed_answer() -> Reply {
    Reply::sse(&[
        json!({"candidates": [{"content": {"parts": [{"text": "ok"}], "role": "model"}, "index": 0}]})
            .to_string(),
        json!({"candidates": [{"content": {"parts": [{"text": " done"}], "role": "model"},
                "finishReason": "STOP", "index": 0}],
               "usageMetadata": {"promptTokenCount": 1_000_000, "candidatesTokenCount": 200_000,
                                 "thoughtsTokenCount": 100_000, "cachedContentTokenCount": 500_000,
                                 "totalTokenCount": 1_300_000},
               "modelVersion": "gemini-2.5-flash"})
        .to_string(),
    ])
}

/// A summary call's answer (`generateContent`, not streamed).
fn summary_answer() -> Reply {
    Reply::json(
        200,
        &json!({"candidates": [{"content": {"parts": [
                    {"text": "thinking about it", "thought": true},
                    {"text": "1. Primary Request and Intent: walk the aardvark ledger."}],
                "role": "model"}, "finishReason": "STOP", "index": 0}],
               "usageMetadata": {"promptTokenCount": 900, "candidatesTokenCount": 50, "totalTokenCount": 950},
               "modelVersion": "gemini-2.5-flash"}),
    )
}

/// A mock Gemini: summary calls (`:generateContent`) answered with a summary, chat calls
/// checked by Gemini's rules against `window` and refused with its 400 past it.
async fn gemini(window: usize) -> MockUpstream {
    let mock = MockUpstream::start().await;
    mock.set_handler(move |r: &Recorded| {
        let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        if r.path().ends_with(":generateContent") {
            return summary_answer();
        }
        match check_gemini(&body, window) {
            Ok(()) => streamed_answer(),
            Err(rejection) => Reply::json(400, &rejection_body(&rejection)),
        }
    });
    mock
}

fn chat_path(model: &str) -> String {
    format!("/v1beta/models/{model}:streamGenerateContent?alt=sse")
}

fn contents(r: &Recorded) -> Vec<Value> {
    let body: Value = serde_json::from_slice(&r.body).expect("json");
    body["contents"].as_array().cloned().expect("contents")
}

/// Over the message count the forwarded request is compacted and valid for Gemini, the path
/// and query go on as sent, every field but `contents` is byte-identical, and the opening
/// (Gemini CLI's session context and the prompt) is kept with the summary after its parts.
#[tokio::test]
async fn a_long_conversation_is_compacted_valid_for_gemini() {
    let mock = gemini(usize::MAX).await;
    let toml = format!(
        "{}[compaction]\nstrategy = \"summarize\"\nmax_messages = 8\nbackground_ratio = 0\n\
         min_preserve_tokens = 50\nmax_preserve_tokens = 400\n[summarizer]\nbackend = \"extractive\"\n",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let body = request(6, 40);
    let client = TestClient::http1();
    let answer = client
        .exchange(
            "POST",
            &proxy.url(&chat_path("gemini-2.5-flash")),
            &[
                ("content-type", "application/json"),
                ("x-goog-api-key", KEY),
            ],
            body.clone(),
        )
        .await;
    assert_eq!(answer.status, 200);
    assert!(String::from_utf8_lossy(&answer.body).contains("\"STOP\""));
    let received = mock.requests();
    assert_eq!(
        received.len(),
        1,
        "one chat call, no summary call (extractive)"
    );
    let forwarded = &received[0];
    assert_eq!(
        forwarded.path_and_query,
        chat_path("gemini-2.5-flash"),
        "path and query as sent"
    );
    assert_eq!(forwarded.header("x-goog-api-key"), Some(KEY));
    let out: Value = serde_json::from_slice(&forwarded.body).expect("json");
    check_gemini(&out, usize::MAX).expect("valid for Gemini");
    let sent: Value = serde_json::from_slice(&body).expect("json");
    for key in ["systemInstruction", "tools", "generationConfig"] {
        assert_eq!(out[key], sent[key], "{key} kept");
    }
    let new = contents(forwarded);
    let old = sent["contents"].as_array().expect("contents");
    assert!(
        new.len() < old.len(),
        "compacted: {} of {}",
        new.len(),
        old.len()
    );
    let opening = old[0]["parts"].as_array().expect("parts");
    let first = new[0]["parts"].as_array().expect("parts");
    assert_eq!(&first[..opening.len()], &opening[..], "the opening kept");
    assert!(
        first[opening.len()]["text"]
            .as_str()
            .is_some_and(|t| t.starts_with(SUMMARY_INTRO)),
        "the summary follows the opening's parts: {}",
        new[0]
    );
    assert_eq!(new.last(), old.last(), "the latest answer verbatim");
    // The stream's usage was read and priced as gemini-2.5-flash's (from the path).
    proxy
        .wait_metric(
            "compactor_upstream_usage_tokens_total",
            &[("kind", "cache_read")],
            500_000.0,
        )
        .await;
    let output = proxy
        .metric(
            "compactor_upstream_usage_tokens_total",
            &[("kind", "output")],
        )
        .await;
    assert_eq!(output, Some(300_000.0), "candidates and thoughts");
    let billed = proxy
        .metric(
            "compactor_cost_usd_total",
            &[("dialect", "gemini"), ("kind", "cache_read")],
        )
        .await
        .expect("priced");
    assert!(
        (billed - 0.015).abs() < 1e-9,
        "500k cached at $0.03/M: {billed}"
    );
    let routed = proxy
        .metric(
            "compactor_requests_total",
            &[
                ("route", "gemini"),
                ("method", "POST"),
                ("status_class", "2xx"),
            ],
        )
        .await;
    assert_eq!(routed, Some(1.0));
}

/// Gemini's over-window 400 is compacted and sent again: the agent sees only the answer, the
/// window the refusal names is learned for the model in the path.
#[tokio::test]
async fn gemini_refusals_for_length_are_compacted_and_retried() {
    let mock = gemini(1_000).await;
    let toml = format!(
        "{}[compaction]\nstrategy = \"summarize\"\nbackground_ratio = 0\n\
         min_preserve_tokens = 50\nmax_preserve_tokens = 400\n[summarizer]\nbackend = \"extractive\"\n",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let body = request(6, 80);
    let sent: Value = serde_json::from_slice(&body).expect("json");
    assert!(
        matches!(
            check_gemini(&sent, 1_000),
            Err(Rejection::ContextLength { .. })
        ),
        "the request as sent is over the mock's window: {:?}",
        check_gemini(&sent, 1_000)
    );
    let client = TestClient::http1();
    let answer = client
        .exchange(
            "POST",
            &proxy.url(&chat_path("gemini-2.5-pro")),
            &[
                ("content-type", "application/json"),
                ("x-goog-api-key", KEY),
            ],
            body,
        )
        .await;
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let received = mock.requests();
    assert_eq!(
        received.len(),
        2,
        "refused once, then the compacted request"
    );
    let retried: Value = serde_json::from_slice(&received[1].body).expect("json");
    check_gemini(&retried, 1_000).expect("the retry fits");
    assert_eq!(received[1].path_and_query, chat_path("gemini-2.5-pro"));
    let retries = proxy
        .metric(
            "compactor_retries_total",
            &[
                ("reason", "context_length"),
                ("outcome", "retried"),
                ("via", "status"),
            ],
        )
        .await;
    assert_eq!(retries, Some(1.0));
}

/// With `auto`, a Gemini conversation is summarised by the caller's own Gemini: the summary
/// call goes to `generateContent` of the model in the path, with the caller's key, and the
/// summary it answers (its thought left out) is what is forwarded.
#[tokio::test]
async fn auto_summarises_gemini_through_the_callers_gemini() {
    let mock = gemini(usize::MAX).await;
    let toml = format!(
        "{}[compaction]\nstrategy = \"summarize\"\nmax_messages = 8\nbackground_ratio = 0\n\
         min_preserve_tokens = 50\nmax_preserve_tokens = 400\n",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();
    let answer = client
        .exchange(
            "POST",
            &proxy.url(&format!(
                "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse&key={KEY}"
            )),
            &[("content-type", "application/json")],
            request(6, 40),
        )
        .await;
    assert_eq!(answer.status, 200);
    let received = mock.requests();
    let summary_calls: Vec<&Recorded> = received
        .iter()
        .filter(|r| r.path().ends_with(":generateContent"))
        .collect();
    assert!(!summary_calls.is_empty(), "a summary call was made");
    for call in &summary_calls {
        assert_eq!(
            call.path(),
            "/v1beta/models/gemini-2.5-flash:generateContent"
        );
        assert_eq!(
            call.header("x-goog-api-key"),
            Some(KEY),
            "the key the caller sent in its query, as Gemini's header"
        );
        assert!(
            !call.path_and_query.contains("key="),
            "never in a URL compactor builds"
        );
    }
    // Asked inside the conversation first (gemini-2.5-flash reads its cache at a tenth of
    // input): the request as received, its tools not callable, then the turn asking for the
    // summary; the mock answers it, so no standalone prompt follows.
    assert_eq!(summary_calls.len(), 1, "one call, inside the conversation");
    let asked: Value = serde_json::from_slice(&summary_calls[0].body).expect("json");
    let sent: Value = serde_json::from_slice(&request(6, 40)).expect("json");
    let asked_contents = asked["contents"].as_array().expect("contents");
    let sent_contents = sent["contents"].as_array().expect("contents");
    assert_eq!(
        &asked_contents[..sent_contents.len() - 1],
        &sent_contents[..sent_contents.len() - 1],
        "the conversation as sent"
    );
    let turn = asked_contents.last().expect("the turn")["parts"]
        .as_array()
        .and_then(|p| p.last())
        .and_then(|p| p["text"].as_str())
        .unwrap_or_default();
    assert!(turn.starts_with("<task>"), "{turn}");
    assert_eq!(asked["toolConfig"]["functionCallingConfig"]["mode"], "NONE");
    assert_eq!(asked["systemInstruction"], sent["systemInstruction"]);
    let chat = received
        .iter()
        .rfind(|r| r.path().ends_with(":streamGenerateContent"))
        .expect("the chat call");
    assert!(
        chat.path_and_query.ends_with(&format!("key={KEY}")),
        "the caller's query as sent"
    );
    let forwarded = String::from_utf8_lossy(&chat.body);
    assert!(
        forwarded.contains("walk the aardvark ledger"),
        "the model's summary forwarded"
    );
    assert!(
        !forwarded.contains("thinking about it"),
        "its thought left out"
    );
}
