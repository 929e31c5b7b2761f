//! The `openai` backend against a mock Chat Completions / Responses server on a real socket.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use compactor_plugin_api::{Api, Caller, SummarizeError, Summarizer, SummaryRequest};
use compactor_plugin_openai::{OpenAiConfig, OpenAiSummarizer, SYSTEM_PROMPT};
use compactor_plugin_testing::{caller, MockProvider, Reply};

fn completion(content: Value) -> Reply {
    Reply::Json(
        200,
        json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
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
        model: Some("gpt-4o-mini".into()),
        max_output_tokens: 1000,
        timeout: Duration::from_secs(10),
        caller,
    }
}

fn plugin(config: OpenAiConfig) -> OpenAiSummarizer {
    OpenAiSummarizer::new(config).expect("builds")
}

#[tokio::test]
async fn configured_endpoint_model_and_key_are_used() {
    let mock = MockProvider::start(vec![completion(json!("  1. Primary Request: fix it\n"))]).await;
    let p = plugin(OpenAiConfig {
        base_url: Some(format!("{}/v1/", mock.url())),
        model: Some("summary-model".into()),
        api_key: Some("sk-configured".into()),
        max_tokens: 4096,
        temperature: Some(0.2),
        ca_file: None,
        max_summary_bytes: 64 * 1024,
    });
    let req = request(caller(
        "http://unused.invalid",
        &[("authorization", "Bearer sk-caller")],
    ));
    let summary = p.summarize(&req).await.expect("summary");
    assert_eq!(summary.text, "1. Primary Request: fix it");

    let got = mock.received();
    assert_eq!(got.len(), 1);
    let r = &got[0];
    assert_eq!(r.path, "/v1/chat/completions");
    assert_eq!(r.header("authorization"), Some("Bearer sk-configured"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body["model"], "summary-model");
    assert_eq!(r.body["max_tokens"], 1000, "capped by the request's budget");
    assert_eq!(r.body["temperature"], 0.2);
    assert_eq!(r.body["stream"], false);
    assert_eq!(r.body["messages"][0]["role"], "system");
    assert_eq!(r.body["messages"][0]["content"], SYSTEM_PROMPT);
    assert_eq!(r.body["messages"][1]["role"], "user");
    assert_eq!(r.body["messages"][1]["content"], req.prompt.as_str());
}

#[tokio::test]
async fn zero_configuration_uses_the_callers_upstream_model_and_credentials() {
    let mock = MockProvider::start(vec![completion(json!("the summary"))]).await;
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        ..Default::default()
    });
    let req = request(caller(
        &mock.url(),
        &[
            ("authorization", "Bearer sk-caller-own"),
            ("api-key", "azure-key-1"),
        ],
    ));
    let summary = p.summarize(&req).await.expect("summary");
    assert_eq!(summary.text, "the summary");
    let r = &mock.received()[0];
    assert_eq!(r.path, "/v1/chat/completions");
    assert_eq!(r.header("authorization"), Some("Bearer sk-caller-own"));
    assert_eq!(r.header("api-key"), Some("azure-key-1"));
    assert_eq!(r.body["model"], "gpt-4o-mini");
    assert!(r.body.get("temperature").is_none());
}

#[tokio::test]
async fn provider_errors_become_status_errors_with_a_redacted_bounded_message() {
    let mock = MockProvider::start(vec![Reply::Json(
        401,
        json!({"error": {"message": format!("Incorrect API key provided: sk-leaky-key. {}", "x".repeat(2000)),
                         "type": "invalid_request_error", "code": "invalid_api_key"}}),
    )])
    .await;
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        ..Default::default()
    });
    let req = request(caller(
        &mock.url(),
        &[("authorization", "Bearer sk-leaky-key")],
    ));
    match p.summarize(&req).await {
        Err(SummarizeError::Status { status, message }) => {
            assert_eq!(status, 401);
            assert!(
                message.starts_with("Incorrect API key provided: [redacted]."),
                "{message}"
            );
            assert!(!message.contains("sk-leaky-key"));
            assert!(message.chars().count() <= 301, "{}", message.len());
        }
        other => panic!("{other:?}"),
    }

    let mock = MockProvider::start(vec![Reply::Text(503, "upstream overloaded")]).await;
    let req = request(caller(&mock.url(), &[]));
    match p.summarize(&req).await {
        Err(SummarizeError::Status { status, message }) => {
            assert_eq!(status, 503);
            assert_eq!(message, "upstream overloaded");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_server_that_never_answers_times_out() {
    let mock = MockProvider::start(vec![Reply::Hang]).await;
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        ..Default::default()
    });
    let mut req = request(caller(&mock.url(), &[]));
    req.timeout = Duration::from_millis(300);
    let started = Instant::now();
    let err = p.summarize(&req).await.expect_err("times out");
    assert!(
        matches!(err, SummarizeError::Timeout(d) if d == req.timeout),
        "{err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(mock.received().len(), 1, "the request did arrive");
}

#[tokio::test]
async fn a_closed_port_is_a_transport_error() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        ..Default::default()
    });
    let err = p
        .summarize(&request(caller(&format!("http://{addr}"), &[])))
        .await
        .expect_err("refused");
    assert_eq!(err.kind(), "transport", "{err:?}");
}

#[tokio::test]
async fn missing_or_blank_content_is_rejected() {
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        ..Default::default()
    });
    let mock = MockProvider::start(vec![Reply::Json(200, json!({"choices": []}))]).await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("no content");
    assert!(matches!(err, SummarizeError::InvalidOutput(_)), "{err:?}");

    let mock = MockProvider::start(vec![completion(json!(" \n "))]).await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("blank");
    assert!(matches!(err, SummarizeError::Blank), "{err:?}");

    let mock = MockProvider::start(vec![Reply::Text(200, "<html>not json</html>")]).await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("not json");
    assert!(matches!(err, SummarizeError::InvalidOutput(_)), "{err:?}");
}

#[tokio::test]
async fn models_that_reject_max_tokens_get_max_completion_tokens() {
    let mock = MockProvider::start(vec![
        Reply::Json(
            400,
            json!({"error": {"message": "Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead.",
                             "type": "invalid_request_error", "param": "max_tokens"}}),
        ),
        completion(json!("ok")),
    ])
    .await;
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        ..Default::default()
    });
    let summary = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect("second attempt answers");
    assert_eq!(summary.text, "ok");
    let got = mock.received();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].body["max_tokens"], 1000);
    assert!(got[1].body.get("max_tokens").is_none());
    assert_eq!(got[1].body["max_completion_tokens"], 1000);
}

#[tokio::test]
async fn no_model_anywhere_is_a_config_error() {
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        ..Default::default()
    });
    let mut req = request(caller("http://127.0.0.1:9", &[]));
    req.model = None;
    let err = p.summarize(&req).await.expect_err("no model");
    assert_eq!(err.kind(), "config");
}

#[tokio::test]
async fn reasoning_models_get_max_completion_tokens_and_no_temperature_on_the_first_call() {
    // (model configured, model of the request): the configured one wins when set.
    for (configured, requested) in [
        (None, "o3-mini"),
        (None, "o1"),
        (None, "gpt-5"),
        (None, "gpt-5-mini"),
        (Some("openai/o4-mini"), "gpt-4o-mini"),
    ] {
        let mock = MockProvider::start(vec![completion(json!("ok"))]).await;
        let p = plugin(OpenAiConfig {
            model: configured.map(str::to_owned),
            max_tokens: 4096,
            temperature: Some(0.2),
            ..Default::default()
        });
        let mut req = request(caller(&mock.url(), &[]));
        req.model = Some(requested.into());
        let summary = p.summarize(&req).await.expect("summary");
        assert_eq!(summary.text, "ok");

        let got = mock.received();
        let model = configured.unwrap_or(requested);
        assert_eq!(got.len(), 1, "{model}: one request, no refusal round trip");
        let r = &got[0];
        assert_eq!(r.path, "/v1/chat/completions");
        assert_eq!(r.body["model"], model);
        assert_eq!(r.body["max_completion_tokens"], 1000, "{model}");
        assert!(r.body.get("max_tokens").is_none(), "{model}: {}", r.body);
        assert!(r.body.get("temperature").is_none(), "{model}: {}", r.body);
    }
}

#[tokio::test]
async fn other_models_keep_max_tokens_and_temperature() {
    // The configured model wins over a reasoning model named by the request.
    for (configured, requested) in [(None, "gpt-4o"), (Some("gpt-4o"), "o3-mini")] {
        let mock = MockProvider::start(vec![completion(json!("ok"))]).await;
        let p = plugin(OpenAiConfig {
            model: configured.map(str::to_owned),
            max_tokens: 4096,
            temperature: Some(0.2),
            ..Default::default()
        });
        let mut req = request(caller(&mock.url(), &[]));
        req.model = Some(requested.into());
        p.summarize(&req).await.expect("summary");

        let got = mock.received();
        assert_eq!(got.len(), 1);
        let r = &got[0];
        assert_eq!(r.body["model"], "gpt-4o");
        assert_eq!(r.body["max_tokens"], 1000);
        assert!(r.body.get("max_completion_tokens").is_none(), "{}", r.body);
        assert_eq!(r.body["temperature"], 0.2);
    }
}

/// A Responses API answer in the shape OpenAI sends for a reasoning model: a `reasoning` item
/// before the `message` item.
fn response(texts: &[&str]) -> Reply {
    let content: Vec<Value> = texts
        .iter()
        .map(|t| json!({"type": "output_text", "text": t, "annotations": [], "logprobs": []}))
        .collect();
    Reply::Json(
        200,
        json!({
            "id": "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b",
            "object": "response",
            "created_at": 1741476542,
            "status": "completed",
            "error": null,
            "incomplete_details": null,
            "instructions": SYSTEM_PROMPT,
            "max_output_tokens": 1000,
            "model": "o4-mini-2025-04-16",
            "output": [
                {"id": "rs_67ccd2bf17f0819081ff3bb2cf6508e60bb6a6b452d3795b",
                 "type": "reasoning",
                 "summary": [{"type": "summary_text", "text": "**Summarizing the session** NOT THE SUMMARY"}]},
                {"id": "msg_67ccd2bf17f0819081ff3bb2cf6508e60bb6a6b452d3795b",
                 "type": "message",
                 "status": "completed",
                 "role": "assistant",
                 "content": content}
            ],
            "parallel_tool_calls": true,
            "reasoning": {"effort": "medium", "summary": null},
            "store": false,
            "text": {"format": {"type": "text"}},
            "usage": {"input_tokens": 36, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": 87, "output_tokens_details": {"reasoning_tokens": 64},
                      "total_tokens": 123}
        }),
    )
}

fn responses_caller(base: &str, credentials: &[(&str, &str)]) -> Caller {
    Caller {
        api: Api::Responses,
        ..caller(base, credentials)
    }
}

#[tokio::test]
async fn responses_callers_are_summarised_through_the_responses_api() {
    let mock = MockProvider::start(vec![response(&["  1. Primary Request:", " fix it\n"])]).await;
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        temperature: Some(0.2),
        ..Default::default()
    });
    let mut req = request(responses_caller(
        &mock.url(),
        &[("authorization", "Bearer sk-caller-own")],
    ));
    req.model = Some("o4-mini".into());
    let summary = p.summarize(&req).await.expect("summary");
    assert_eq!(summary.text, "1. Primary Request: fix it");

    let got = mock.received();
    assert_eq!(got.len(), 1);
    let r = &got[0];
    assert_eq!(r.path, "/v1/responses");
    assert_eq!(r.header("authorization"), Some("Bearer sk-caller-own"));
    assert_eq!(r.body["model"], "o4-mini");
    assert_eq!(
        r.body["max_output_tokens"], 1000,
        "capped by the request's budget"
    );
    assert_eq!(r.body["store"], false);
    assert_eq!(r.body["instructions"], SYSTEM_PROMPT);
    assert_eq!(r.body["input"][0]["role"], "user");
    assert_eq!(r.body["input"][0]["content"], req.prompt.as_str());
    for absent in [
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
    ] {
        assert!(r.body.get(absent).is_none(), "{absent}: {}", r.body);
    }
}

#[tokio::test]
async fn responses_callers_use_responses_on_a_configured_base_url_too() {
    let mock = MockProvider::start(vec![response(&["the summary"])]).await;
    let p = plugin(OpenAiConfig {
        base_url: Some(format!("{}/api/v1", mock.url())),
        model: Some("gpt-4.1-mini".into()),
        api_key: Some("sk-configured".into()),
        max_tokens: 500,
        temperature: Some(0.3),
        ca_file: None,
        max_summary_bytes: 64 * 1024,
    });
    let req = request(responses_caller("http://unused.invalid", &[]));
    let summary = p.summarize(&req).await.expect("summary");
    assert_eq!(summary.text, "the summary");

    let got = mock.received();
    assert_eq!(got.len(), 1);
    let r = &got[0];
    assert_eq!(r.path, "/api/v1/responses");
    assert_eq!(r.header("authorization"), Some("Bearer sk-configured"));
    assert_eq!(r.body["model"], "gpt-4.1-mini");
    assert_eq!(
        r.body["max_output_tokens"], 500,
        "the configured budget is smaller"
    );
    assert_eq!(r.body["temperature"], 0.3, "not a reasoning model");
    assert_eq!(r.body["store"], false);
}

#[tokio::test]
async fn responses_errors_become_status_errors() {
    let mock = MockProvider::start(vec![Reply::Json(
        400,
        json!({"error": {"message": "The requested model 'o9-nope' does not exist.",
                         "type": "invalid_request_error", "param": "model",
                         "code": "model_not_found"}}),
    )])
    .await;
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        ..Default::default()
    });
    let mut req = request(responses_caller(&mock.url(), &[]));
    req.model = Some("o9-nope".into());
    match p.summarize(&req).await {
        Err(SummarizeError::Status { status, message }) => {
            assert_eq!(status, 400);
            assert_eq!(message, "The requested model 'o9-nope' does not exist.");
        }
        other => panic!("{other:?}"),
    }
    let got = mock.received();
    assert_eq!(got.len(), 1, "nothing to adjust, no second attempt");
    assert_eq!(got[0].path, "/v1/responses");

    let mock = MockProvider::start(vec![Reply::Text(502, "bad gateway")]).await;
    let req = request(responses_caller(&mock.url(), &[]));
    match p.summarize(&req).await {
        Err(SummarizeError::Status { status, message }) => {
            assert_eq!(status, 502);
            assert_eq!(message, "bad gateway");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_responses_answer_without_output_text_is_invalid() {
    // A reasoning model that spent the whole budget thinking.
    let mock = MockProvider::start(vec![Reply::Json(
        200,
        json!({
            "id": "resp_1", "object": "response", "status": "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"},
            "output": [{"id": "rs_1", "type": "reasoning", "summary": []}],
            "usage": {"input_tokens": 36, "output_tokens": 1000,
                      "output_tokens_details": {"reasoning_tokens": 1000}, "total_tokens": 1036}
        }),
    )])
    .await;
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        ..Default::default()
    });
    let err = p
        .summarize(&request(responses_caller(&mock.url(), &[])))
        .await
        .expect_err("no text");
    assert!(
        matches!(&err, SummarizeError::InvalidOutput(m) if m.contains("max_output_tokens")),
        "{err:?}"
    );
}

#[tokio::test]
async fn answers_over_the_summary_bound_are_refused_and_asked_once() {
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        max_summary_bytes: 1000,
        ..Default::default()
    });
    // A summary over the bound in an answer the transport may read whole.
    let mock = MockProvider::start(vec![completion(json!("s".repeat(1001)))]).await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("summary too large");
    assert!(
        matches!(&err, SummarizeError::TooLarge { what, limit: 1000 } if what == "summary"),
        "{err:?}"
    );
    // An answer over the bound plus its JSON envelope is not read at all.
    let big = "s".repeat(1000 + compactor_plugin_api::SUMMARY_ENVELOPE_BYTES);
    let mock = MockProvider::start(vec![completion(json!(big))]).await;
    let mut req = request(caller(&mock.url(), &[]));
    for api in [Api::ChatCompletions, Api::Responses] {
        req.caller.api = api;
        let seen = mock.received().len();
        let err = p.summarize(&req).await.expect_err("answer too large");
        assert!(
            matches!(&err, SummarizeError::TooLarge { what, .. } if what == "response body"),
            "{api:?}: {err:?}"
        );
        assert_eq!(err.kind(), "too_large");
        assert_eq!(mock.received().len(), seen + 1, "{api:?}: asked once");
    }
    // At the bound, the summary is taken.
    let mock = MockProvider::start(vec![completion(json!("s".repeat(1000)))]).await;
    let summary = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect("summary at the bound");
    assert_eq!(summary.text.len(), 1000);
}

/// A request asking for the summary inside the conversation, as compactor builds it.
fn in_conversation(body: Value) -> Option<std::sync::Arc<[u8]>> {
    Some(serde_json::to_vec(&body).expect("json").into())
}

#[tokio::test]
async fn the_conversation_itself_is_sent_to_the_callers_own_model_and_upstream() {
    let conversation = json!({
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": "fix the parser"},
            {"role": "user", "content": "Summarize the conversation above."}
        ],
        "max_tokens": 1000, "stream": false, "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    });
    let mock = MockProvider::start(vec![completion(json!("the summary"))]).await;
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        ..Default::default()
    });
    let mut req = request(caller(&mock.url(), &[("authorization", "Bearer sk-own")]));
    req.in_conversation = in_conversation(conversation.clone());
    let summary = p.summarize(&req).await.expect("summary");
    assert_eq!(summary.text, "the summary");
    let got = mock.received();
    assert_eq!(got.len(), 1, "one call, the conversation's");
    assert_eq!(got[0].path, "/v1/chat/completions");
    assert_eq!(got[0].header("authorization"), Some("Bearer sk-own"));
    assert_eq!(got[0].body, conversation, "sent exactly as built");

    // A configured model has no cache of this conversation: the standalone prompt goes.
    let mock = MockProvider::start(vec![completion(json!("the summary"))]).await;
    let p = plugin(OpenAiConfig {
        model: Some("gpt-4.1-nano".into()),
        max_tokens: 4096,
        ..Default::default()
    });
    let mut req = request(caller(&mock.url(), &[]));
    req.in_conversation = in_conversation(conversation.clone());
    p.summarize(&req).await.expect("summary");
    let got = mock.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].body["model"], "gpt-4.1-nano");
    assert_eq!(got[0].body["messages"][1]["content"], req.prompt.as_str());

    // Responses callers send theirs to `/responses`.
    let mock = MockProvider::start(vec![response(&["from the responses api"])]).await;
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        ..Default::default()
    });
    let body = json!({"model": "gpt-5", "input": [{"role": "user", "content": "hi"}],
                      "stream": false, "max_output_tokens": 1000});
    let mut req = request(responses_caller(&mock.url(), &[]));
    req.in_conversation = in_conversation(body.clone());
    let summary = p.summarize(&req).await.expect("summary");
    assert_eq!(summary.text, "from the responses api");
    let got = mock.received();
    assert_eq!(got[0].path, "/v1/responses");
    assert_eq!(got[0].body, body);
}

#[tokio::test]
async fn a_refused_or_empty_answer_inside_the_conversation_falls_back_to_the_prompt() {
    let p = plugin(OpenAiConfig {
        max_tokens: 4096,
        ..Default::default()
    });
    let conversation =
        json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]});
    // Refused (a shape the endpoint does not take), then a tool call instead of a summary.
    for first in [
        Reply::Json(
            400,
            json!({"error": {"message": "tool_choice is not supported"}}),
        ),
        completion(Value::Null),
    ] {
        let mock = MockProvider::start(vec![first, completion(json!("from the prompt"))]).await;
        let mut req = request(caller(&mock.url(), &[]));
        req.in_conversation = in_conversation(conversation.clone());
        let summary = p.summarize(&req).await.expect("the prompt answers");
        assert_eq!(summary.text, "from the prompt");
        let got = mock.received();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].body, conversation);
        assert_eq!(got[1].body["messages"][1]["content"], req.prompt.as_str());
    }
    // A rate limit or a server error would meet the prompt too: one call, the error.
    for status in [429, 503] {
        let mock = MockProvider::start(vec![Reply::Text(status, "busy")]).await;
        let mut req = request(caller(&mock.url(), &[]));
        req.in_conversation = in_conversation(conversation.clone());
        let err = p.summarize(&req).await.expect_err("fails");
        assert!(
            matches!(err, SummarizeError::Status { status: s, .. } if s == status),
            "{err:?}"
        );
        assert_eq!(mock.received().len(), 1);
    }
}
