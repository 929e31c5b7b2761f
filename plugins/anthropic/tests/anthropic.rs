//! The `anthropic` backend against a mock Messages API server on a real socket.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use compactor_plugin_anthropic::{AnthropicConfig, AnthropicSummarizer, SYSTEM_PROMPT};
use compactor_plugin_api::{Api, Caller, SummarizeError, Summarizer, SummaryRequest};
use compactor_plugin_testing::{caller, MockProvider, Reply};

fn message(blocks: Value) -> Reply {
    Reply::Json(
        200,
        json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
            "content": blocks, "stop_reason": "end_turn",
            "usage": {"input_tokens": 10, "output_tokens": 5}
        }),
    )
}

fn request(caller: Caller) -> SummaryRequest {
    SummaryRequest {
        in_conversation: None,
        prompt: "<task>Summarize the conversation so far</task>\n<conversation>...</conversation>"
            .into(),
        prior_summary: None,
        entries: vec![],
        read_files: vec![],
        modified_files: vec![],
        instructions: None,
        compaction_num: 1,
        model: Some("claude-sonnet-4-5".into()),
        max_output_tokens: 2000,
        timeout: Duration::from_secs(10),
        caller,
    }
}

fn config() -> AnthropicConfig {
    AnthropicConfig {
        anthropic_version: "2023-06-01".into(),
        max_tokens: 4096,
        ..Default::default()
    }
}

fn plugin(config: AnthropicConfig) -> AnthropicSummarizer {
    AnthropicSummarizer::new(config).expect("builds")
}

#[tokio::test]
async fn configured_endpoint_model_and_key_are_used() {
    let mock = MockProvider::start(vec![message(json!([
        {"type": "text", "text": "1. Primary Request"},
        {"type": "text", "text": " and Intent: fix it\n"}
    ]))])
    .await;
    let p = plugin(AnthropicConfig {
        base_url: Some(mock.url()),
        model: Some("claude-haiku".into()),
        api_key: Some("sk-ant-configured".into()),
        max_tokens: 1500,
        ..config()
    });
    let req = request(caller(
        "http://unused.invalid",
        &[("x-api-key", "sk-ant-caller")],
    ));
    let summary = p.summarize(&req).await.expect("summary");
    assert_eq!(summary.text, "1. Primary Request and Intent: fix it");

    let got = mock.received();
    assert_eq!(got.len(), 1);
    let r = &got[0];
    assert_eq!(r.path, "/v1/messages");
    assert_eq!(r.header("x-api-key"), Some("sk-ant-configured"));
    assert_eq!(r.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert!(r.header("authorization").is_none());
    assert_eq!(r.body["model"], "claude-haiku");
    assert_eq!(
        r.body["max_tokens"], 1500,
        "the smaller of config and request"
    );
    assert_eq!(r.body["system"], SYSTEM_PROMPT);
    assert_eq!(r.body["messages"][0]["role"], "user");
    assert_eq!(r.body["messages"][0]["content"], req.prompt.as_str());
    assert_eq!(r.body["messages"].as_array().map(Vec::len), Some(1));
}

#[tokio::test]
async fn zero_configuration_uses_the_callers_upstream_model_and_key() {
    let mock = MockProvider::start(vec![message(json!([{"type": "text", "text": "sum"}]))]).await;
    let p = plugin(config());
    let req = request(caller(&mock.url(), &[("x-api-key", "sk-ant-caller")]));
    assert_eq!(p.summarize(&req).await.expect("summary").text, "sum");
    let r = &mock.received()[0];
    assert_eq!(r.path, "/v1/messages");
    assert_eq!(r.header("x-api-key"), Some("sk-ant-caller"));
    assert_eq!(r.body["model"], "claude-sonnet-4-5");
    assert_eq!(r.body["max_tokens"], 2000);
}

#[tokio::test]
async fn a_bearer_only_caller_is_passed_on_as_authorization() {
    let mock = MockProvider::start(vec![message(json!([{"type": "text", "text": "sum"}]))]).await;
    let p = plugin(config());
    let req = request(caller(
        &mock.url(),
        &[("authorization", "Bearer oauth-token")],
    ));
    p.summarize(&req).await.expect("summary");
    let r = &mock.received()[0];
    assert_eq!(r.header("authorization"), Some("Bearer oauth-token"));
    assert!(r.header("x-api-key").is_none());
}

#[tokio::test]
async fn provider_errors_become_status_errors() {
    let mock = MockProvider::start(vec![Reply::Json(
        529,
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    )])
    .await;
    let p = plugin(config());
    match p.summarize(&request(caller(&mock.url(), &[]))).await {
        Err(SummarizeError::Status { status, message }) => {
            assert_eq!(status, 529);
            assert_eq!(message, "Overloaded");
        }
        other => panic!("{other:?}"),
    }
    let mock = MockProvider::start(vec![Reply::Json(
        400,
        json!({"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: too large"}}),
    )])
    .await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("400");
    assert!(
        matches!(err, SummarizeError::Status { status: 400, .. }),
        "{err:?}"
    );
    assert_eq!(mock.received().len(), 1, "no retry");
}

#[tokio::test]
async fn a_server_that_never_answers_times_out() {
    let mock = MockProvider::start(vec![Reply::Hang]).await;
    let p = plugin(config());
    let mut req = request(caller(&mock.url(), &[]));
    req.timeout = Duration::from_millis(300);
    let started = Instant::now();
    let err = p.summarize(&req).await.expect_err("times out");
    assert!(matches!(err, SummarizeError::Timeout(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn answers_without_text_are_invalid_or_blank() {
    let p = plugin(config());
    let mock = MockProvider::start(vec![message(
        json!([{"type": "tool_use", "id": "x", "name": "n", "input": {}}]),
    )])
    .await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("no text");
    assert!(matches!(err, SummarizeError::InvalidOutput(_)), "{err:?}");
    let mock = MockProvider::start(vec![message(json!([{"type": "text", "text": "  "}]))]).await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("blank");
    assert!(matches!(err, SummarizeError::Blank), "{err:?}");
    let mock = MockProvider::start(vec![Reply::Text(200, "{}")]).await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("no content");
    assert!(matches!(err, SummarizeError::InvalidOutput(_)), "{err:?}");
}

#[tokio::test]
async fn answers_over_the_summary_bound_are_refused() {
    let p = plugin(AnthropicConfig {
        max_summary_bytes: 1000,
        ..config()
    });
    // Two blocks that together pass the bound, in an answer the transport may read whole.
    let mock = MockProvider::start(vec![message(json!([
        {"type": "text", "text": "a".repeat(600)},
        {"type": "text", "text": "b".repeat(600)},
    ]))])
    .await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("summary too large");
    assert!(
        matches!(&err, SummarizeError::TooLarge { what, limit: 1000 } if what == "summary"),
        "{err:?}"
    );
    // An answer over the bound plus its JSON envelope is not read at all.
    let big = "a".repeat(1000 + compactor_plugin_api::SUMMARY_ENVELOPE_BYTES);
    let mock = MockProvider::start(vec![message(json!([{"type": "text", "text": big}]))]).await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("answer too large");
    assert!(
        matches!(&err, SummarizeError::TooLarge { what, .. } if what == "response body"),
        "{err:?}"
    );
    assert_eq!(mock.received().len(), 1, "asked once");
}

#[tokio::test]
async fn the_conversation_itself_is_sent_to_the_callers_own_model_and_upstream() {
    let conversation = json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 2000,
        "stream": false,
        "system": [{"type": "text", "text": "You are Claude Code.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "fix the parser", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Summarize the conversation above."}
        ]}]
    });
    let in_conversation = Some(serde_json::to_vec(&conversation).expect("json").into());
    let mock = MockProvider::start(vec![message(json!([
        {"type": "thinking", "thinking": "hm", "signature": "s"},
        {"type": "text", "text": "the summary"}
    ]))])
    .await;
    let p = plugin(config());
    let mut req = request(messages_caller(&mock.url(), &[("x-api-key", "sk-ant-own")]));
    req.in_conversation = in_conversation.clone();
    let summary = p.summarize(&req).await.expect("summary");
    assert_eq!(summary.text, "the summary");
    let got = mock.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].path, "/v1/messages");
    assert_eq!(got[0].header("x-api-key"), Some("sk-ant-own"));
    assert_eq!(got[0].header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(got[0].body, conversation, "sent exactly as built");

    // Only a text-less answer or a refused shape falls back to the standalone prompt.
    let mock = MockProvider::start(vec![
        message(json!([{"type": "tool_use", "id": "t", "name": "Bash", "input": {}}])),
        message(json!([{"type": "text", "text": "from the prompt"}])),
    ])
    .await;
    let mut req = request(messages_caller(&mock.url(), &[]));
    req.in_conversation = in_conversation.clone();
    let summary = p.summarize(&req).await.expect("the prompt answers");
    assert_eq!(summary.text, "from the prompt");
    let got = mock.received();
    assert_eq!(got.len(), 2);
    assert_eq!(got[1].body["messages"][0]["content"], req.prompt.as_str());

    // A configured model has no cache of this conversation.
    let mock = MockProvider::start(vec![message(json!([{"type": "text", "text": "s"}]))]).await;
    let p = plugin(AnthropicConfig {
        model: Some("claude-haiku-4-5".into()),
        ..config()
    });
    let mut req = request(messages_caller(&mock.url(), &[]));
    req.in_conversation = in_conversation;
    p.summarize(&req).await.expect("summary");
    assert_eq!(mock.received()[0].body["model"], "claude-haiku-4-5");

    // Nor does a caller of another wire format (a configured `anthropic` behind a Chat
    // Completions agent): its conversation is not a Messages body.
    let mock = MockProvider::start(vec![message(json!([{"type": "text", "text": "s"}]))]).await;
    let mut req = request(caller(&mock.url(), &[]));
    req.in_conversation = Some(b"{}".as_slice().into());
    plugin(config()).summarize(&req).await.expect("summary");
    assert_eq!(mock.received()[0].body["system"], SYSTEM_PROMPT);
}

fn messages_caller(base: &str, credentials: &[(&str, &str)]) -> Caller {
    Caller {
        api: Api::Messages,
        ..caller(base, credentials)
    }
}
