//! The `auto` summarizer backend: with zero configuration it writes summaries through the
//! caller's own provider in the request's own wire API: Anthropic Messages requests go to
//! `{upstream}{prefix}/messages` with the caller's `x-api-key`, Chat Completions and Responses
//! requests to `{upstream}{prefix}/chat/completions` with the caller's `Authorization`. Real
//! sockets (the shared mock upstream).

mod support;

use std::sync::Arc;
use std::time::Duration;

use compactor::config::Config;
use compactor::metrics::Metrics;
use compactor::summarizer;
use compactor_plugin_api::{Api, Caller, Entry, Part, Role, Summarizer, SummaryRequest};
use serde_json::{json, Value};

use support::{metric_value, MockUpstream, Recorded, Reply};

fn request(caller: Caller) -> SummaryRequest {
    SummaryRequest {
        in_conversation: None,
        prompt: "<task>Summarize</task><conversation>AUTO-PROMPT-5512</conversation>".into(),
        prior_summary: None,
        entries: vec![Entry {
            role: Role::User,
            parts: vec![Part::Text {
                text: "Port the parser".into(),
            }],
        }],
        read_files: vec![],
        modified_files: vec![],
        instructions: None,
        compaction_num: 1,
        model: Some("the-request-model".into()),
        max_output_tokens: 1000,
        timeout: Duration::from_secs(20),
        caller,
    }
}

fn caller(base: &str, api: Api) -> Caller {
    Caller {
        upstream_base_url: base.into(),
        api_prefix: "/v1".into(),
        credentials: vec![
            ("authorization".into(), "Bearer sk-openai-caller".into()),
            ("x-api-key".into(), "sk-ant-caller".into()),
        ],
        api,
    }
}

/// A provider that answers each API in its own shape, so a request sent to the wrong API
/// cannot produce the expected summary.
fn provider(mock: &MockUpstream) {
    mock.set_handler(|req: &Recorded| match req.path() {
        "/v1/messages" => Reply::json(
            200,
            &json!({"type": "message", "role": "assistant",
                    "content": [{"type": "text", "text": "summary via messages"}]}),
        ),
        "/v1/chat/completions" => Reply::json(
            200,
            &json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": "summary via chat"}}]}),
        ),
        "/v1/responses" => Reply::json(
            200,
            &json!({"object": "response", "status": "completed", "output": [
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": "summary via responses"}]}]}),
        ),
        _ => Reply::status(404),
    });
}

fn auto() -> (Arc<dyn Summarizer>, Arc<Metrics>) {
    let config = Config::from_toml("[summarizer]\nbackend = \"auto\"\n").expect("config");
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let s = summarizer::build(&config, metrics.clone()).expect("auto builds unconfigured");
    (s, metrics)
}

#[tokio::test]
async fn messages_requests_are_summarised_through_the_messages_api() {
    let mock = MockUpstream::start().await;
    provider(&mock);
    let (s, metrics) = auto();
    let summary = s
        .summarize(&request(caller(&mock.url(), Api::Messages)))
        .await
        .expect("summary");
    assert_eq!(summary.text, "summary via messages");
    let sent = mock.last_request();
    assert_eq!(sent.path(), "/v1/messages");
    assert_eq!(sent.header("x-api-key"), Some("sk-ant-caller"));
    assert!(sent.header("anthropic-version").is_some());
    let body: Value = serde_json::from_slice(&sent.body).expect("JSON");
    assert_eq!(body["model"], "the-request-model");
    assert!(body["messages"][0]["content"]
        .as_str()
        .is_some_and(|p| p.contains("AUTO-PROMPT-5512")));
    assert_eq!(
        metric_value(
            &metrics.render(),
            "compactor_summarizer_requests_total",
            &[("backend", "auto"), ("outcome", "ok")]
        ),
        Some(1.0)
    );
}

#[tokio::test]
async fn chat_and_responses_requests_are_summarised_in_their_own_api() {
    // Some OpenAI-compatible endpoints agents use serve only `/responses`: a Responses
    // request is summarised through `/responses`, a Chat Completions one through
    // `/chat/completions`, each in one call.
    let mock = MockUpstream::start().await;
    provider(&mock);
    let (s, _) = auto();
    for (api, path, text) in [
        (
            Api::ChatCompletions,
            "/v1/chat/completions",
            "summary via chat",
        ),
        (Api::Responses, "/v1/responses", "summary via responses"),
    ] {
        let summary = s
            .summarize(&request(caller(&mock.url(), api)))
            .await
            .expect("summary");
        assert_eq!(summary.text, text, "{api:?}");
        let sent = mock.last_request();
        assert_eq!(sent.path(), path, "{api:?}");
        assert_eq!(
            sent.header("authorization"),
            Some("Bearer sk-openai-caller")
        );
    }
    assert_eq!(mock.request_count(), 2);
    // A caller that says nothing about its API is a Chat Completions caller.
    assert_eq!(Caller::default().api, Api::ChatCompletions);
}
