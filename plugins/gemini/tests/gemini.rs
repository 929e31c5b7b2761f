//! The `gemini` backend against a mock Gemini API server on a real socket.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use compactor_plugin_api::{
    Api, Caller, SummarizeError, Summarizer, SummaryRequest, SUMMARY_ENVELOPE_BYTES,
};
use compactor_plugin_gemini::{GeminiConfig, GeminiSettings, GeminiSummarizer, SYSTEM_PROMPT};
use compactor_plugin_testing::{caller, MockProvider, Reply};

/// A `generateContent` answer whose first candidate holds `parts`.
fn answer(parts: Value) -> Reply {
    Reply::Json(
        200,
        json!({
            "candidates": [{"content": {"role": "model", "parts": parts},
                            "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 5,
                              "totalTokenCount": 15},
            "modelVersion": "gemini-2.5-flash",
            "responseId": "r1"
        }),
    )
}

fn text(text: &str) -> Reply {
    answer(json!([{ "text": text }]))
}

/// A Gemini error body, as the API sends them.
fn error(code: u16, status: &str, message: &str) -> Reply {
    Reply::Json(
        code,
        json!({"error": {"code": code, "message": message, "status": status}}),
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
        model: Some("gemini-2.5-flash".into()),
        max_output_tokens: 2000,
        timeout: Duration::from_secs(10),
        caller,
    }
}

/// A caller of the Gemini API: upstream `base`, API prefix `/v1beta/models/gemini-2.5-flash`
/// (its path before `:generateContent`, as compactor hands it on).
fn gemini_caller(base: &str, credentials: &[(&str, &str)]) -> Caller {
    Caller {
        api_prefix: "/v1beta/models/gemini-2.5-flash".into(),
        api: Api::Gemini,
        ..caller(base, credentials)
    }
}

fn config() -> GeminiConfig {
    GeminiSettings::default().config(None, None, compactor_plugin_api::DEFAULT_MAX_SUMMARY_BYTES)
}

fn plugin(config: GeminiConfig) -> GeminiSummarizer {
    GeminiSummarizer::new(config).expect("builds")
}

const OWN_PATH: &str = "/v1beta/models/gemini-2.5-flash:generateContent";

#[tokio::test]
async fn zero_configuration_uses_the_callers_upstream_prefix_model_and_key() {
    let mock = MockProvider::start(vec![text("1. Primary Request and Intent: fix it\n")]).await;
    let p = plugin(config());
    assert_eq!(p.name(), "gemini");
    let req = request(gemini_caller(
        &mock.url(),
        &[("x-goog-api-key", "AIza-caller")],
    ));
    let summary = p.summarize(&req).await.expect("summary");
    assert_eq!(summary.text, "1. Primary Request and Intent: fix it");

    let got = mock.received();
    assert_eq!(got.len(), 1);
    let r = &got[0];
    assert_eq!(r.path, OWN_PATH);
    assert_eq!(r.header("x-goog-api-key"), Some("AIza-caller"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert!(r.header("authorization").is_none());
    assert_eq!(
        r.body,
        json!({
            "systemInstruction": {"parts": [{"text": SYSTEM_PROMPT}]},
            "contents": [{"role": "user", "parts": [{"text": req.prompt}]}],
            "generationConfig": {"maxOutputTokens": 2000}
        }),
        "the smaller of config (4096) and request (2000)"
    );
}

#[tokio::test]
async fn a_caller_under_a_path_keeps_its_prefix() {
    let mock = MockProvider::start(vec![text("sum")]).await;
    let mut caller = gemini_caller(&format!("{}/google/", mock.url()), &[]);
    caller.api_prefix = "/v1alpha".into();
    plugin(config())
        .summarize(&request(caller))
        .await
        .expect("summary");
    assert_eq!(
        mock.received()[0].path,
        "/google/v1alpha/models/gemini-2.5-flash:generateContent"
    );
}

#[tokio::test]
async fn configured_endpoint_model_and_key_are_used() {
    let mock = MockProvider::start(vec![text("sum")]).await;
    let p = plugin(
        GeminiSettings {
            base_url: Some(format!("{}/", mock.url())),
            model: Some("gemini-2.5-flash-lite".into()),
            max_tokens: 1500,
            ..GeminiSettings::default()
        }
        .config(Some("AIza-configured".into()), None, 1 << 20),
    );
    let mut req = request(gemini_caller(
        "http://unused.invalid",
        &[
            ("x-goog-api-key", "AIza-caller"),
            ("authorization", "Bearer ya29.caller"),
        ],
    ));
    req.max_output_tokens = 0;
    assert_eq!(p.summarize(&req).await.expect("summary").text, "sum");
    let got = mock.received();
    assert_eq!(got.len(), 1);
    let r = &got[0];
    assert_eq!(
        r.path,
        "/v1beta/models/gemini-2.5-flash-lite:generateContent"
    );
    assert_eq!(r.header("x-goog-api-key"), Some("AIza-configured"));
    assert!(r.header("authorization").is_none());
    assert_eq!(
        r.body["generationConfig"]["maxOutputTokens"], 1500,
        "the configured budget when the request gives none"
    );
    assert_eq!(
        r.body["contents"][0]["parts"][0]["text"],
        req.prompt.as_str()
    );
}

#[tokio::test]
async fn the_callers_key_comes_before_its_authorization() {
    let mock = MockProvider::start(vec![text("sum")]).await;
    let req = request(gemini_caller(
        &mock.url(),
        &[
            ("authorization", "Bearer ya29.caller"),
            ("x-goog-api-key", "AIza-caller"),
        ],
    ));
    plugin(config()).summarize(&req).await.expect("summary");
    let r = &mock.received()[0];
    assert_eq!(r.header("x-goog-api-key"), Some("AIza-caller"));
    assert!(r.header("authorization").is_none());
}

#[tokio::test]
async fn a_bearer_only_caller_is_passed_on_as_authorization() {
    let mock = MockProvider::start(vec![text("sum")]).await;
    let req = request(gemini_caller(
        &mock.url(),
        &[("authorization", "Bearer ya29.oauth-token")],
    ));
    plugin(config()).summarize(&req).await.expect("summary");
    let r = &mock.received()[0];
    assert_eq!(r.header("authorization"), Some("Bearer ya29.oauth-token"));
    assert!(r.header("x-goog-api-key").is_none());
}

#[tokio::test]
async fn without_credentials_the_request_goes_out_without_them() {
    // As the `anthropic` and `openai` backends do: a gateway may add its own, and a provider
    // that wants one answers 401/403, which is a status error.
    let mock = MockProvider::start(vec![error(
        403,
        "PERMISSION_DENIED",
        "Method doesn't allow unregistered callers.",
    )])
    .await;
    match plugin(config())
        .summarize(&request(gemini_caller(&mock.url(), &[])))
        .await
    {
        Err(SummarizeError::Status { status, message }) => {
            assert_eq!(status, 403);
            assert_eq!(message, "Method doesn't allow unregistered callers.");
        }
        other => panic!("{other:?}"),
    }
    let r = &mock.received()[0];
    assert!(r.header("x-goog-api-key").is_none());
    assert!(r.header("authorization").is_none());
}

#[tokio::test]
async fn an_echoed_key_is_redacted_and_never_debug_printed() {
    let mock = MockProvider::start(vec![error(
        400,
        "INVALID_ARGUMENT",
        "API key not valid: AIza-very-secret. Please pass a valid API key.",
    )])
    .await;
    let keyed = GeminiConfig {
        api_key: Some("AIza-very-secret".into()),
        ..config()
    };
    assert!(!format!("{keyed:?}").contains("AIza-very-secret"));
    let p = plugin(keyed);
    assert!(!format!("{p:?}").contains("AIza-very-secret"));
    let err = p
        .summarize(&request(gemini_caller(&mock.url(), &[])))
        .await
        .expect_err("400");
    let shown = format!("{err:?} {err}");
    assert!(!shown.contains("AIza-very-secret"), "{shown}");
    assert!(shown.contains("API key not valid: [redacted]."), "{shown}");
    // The caller's own key and token are redacted too.
    let mock = MockProvider::start(vec![error(
        401,
        "UNAUTHENTICATED",
        "Request had invalid authentication credentials: ya29.caller-token",
    )])
    .await;
    let err = plugin(config())
        .summarize(&request(gemini_caller(
            &mock.url(),
            &[("authorization", "Bearer ya29.caller-token")],
        )))
        .await
        .expect_err("401");
    assert!(!err.to_string().contains("ya29.caller-token"), "{err}");
}

#[tokio::test]
async fn thought_parts_are_skipped_and_text_parts_joined() {
    let mock = MockProvider::start(vec![answer(json!([
        {"text": "**Planning the summary** I should list the files.", "thought": true},
        {"text": "1. Primary Request"},
        {"text": " and Intent: fix it", "thoughtSignature": "c2ln"},
    ]))])
    .await;
    let summary = plugin(config())
        .summarize(&request(gemini_caller(&mock.url(), &[])))
        .await
        .expect("summary");
    assert_eq!(summary.text, "1. Primary Request and Intent: fix it");
}

#[tokio::test]
async fn an_answer_cut_at_the_budget_keeps_its_text() {
    let mock = MockProvider::start(vec![Reply::Json(
        200,
        json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "1. Primary Request and"}]},
                               "finishReason": "MAX_TOKENS"}]}),
    )])
    .await;
    let summary = plugin(config())
        .summarize(&request(gemini_caller(&mock.url(), &[])))
        .await
        .expect("the text it has");
    assert_eq!(summary.text, "1. Primary Request and");
    assert_eq!(summary.usage, None, "no usage metadata, no usage");
}

#[tokio::test]
async fn answers_without_text_are_invalid_or_blank() {
    let p = plugin(config());
    for (reply, says) in [
        (
            Reply::Json(
                200,
                json!({"promptFeedback": {"blockReason": "PROHIBITED_CONTENT"},
                       "usageMetadata": {"promptTokenCount": 10}}),
            ),
            "blocked (PROHIBITED_CONTENT)",
        ),
        (Reply::Json(200, json!({"candidates": []})), "no candidates"),
        (Reply::Text(200, "{}"), "no candidates"),
        (
            answer(json!([{"functionCall": {"name": "run_shell", "args": {"cmd": "ls"}}}])),
            "no text",
        ),
        (
            answer(json!([{"text": "only thinking", "thought": true}])),
            "no text",
        ),
        (
            Reply::Json(
                200,
                json!({"candidates": [{"content": {"role": "model"}, "finishReason": "MAX_TOKENS"}]}),
            ),
            "finishReason MAX_TOKENS",
        ),
        (
            Reply::Json(200, json!({"candidates": [{"finishReason": "SAFETY"}]})),
            "finishReason SAFETY",
        ),
    ] {
        let mock = MockProvider::start(vec![reply]).await;
        match p.summarize(&request(gemini_caller(&mock.url(), &[]))).await {
            Err(SummarizeError::InvalidOutput(m)) => assert!(m.contains(says), "{m} / {says}"),
            other => panic!("{says}: {other:?}"),
        }
    }
    let mock =
        MockProvider::start(vec![answer(json!([{"text": " \n"}, {"text": "\u{200B}"}]))]).await;
    let err = p
        .summarize(&request(gemini_caller(&mock.url(), &[])))
        .await
        .expect_err("blank");
    assert!(matches!(err, SummarizeError::Blank), "{err:?}");
    let mock = MockProvider::start(vec![Reply::Text(200, "not json")]).await;
    let err = p
        .summarize(&request(gemini_caller(&mock.url(), &[])))
        .await
        .expect_err("not JSON");
    assert!(matches!(err, SummarizeError::InvalidOutput(_)), "{err:?}");
}

#[tokio::test]
async fn usage_counts_cached_input_and_thinking() {
    let mock = MockProvider::start(vec![Reply::Json(
        200,
        json!({
            "candidates": [{"content": {"role": "model", "parts": [{"text": "sum"}]},
                            "finishReason": "STOP"}],
            "usageMetadata": {"promptTokenCount": 12000, "cachedContentTokenCount": 8192,
                              "candidatesTokenCount": 900, "thoughtsTokenCount": 1100,
                              "totalTokenCount": 14000,
                              "promptTokensDetails": [{"modality": "TEXT", "tokenCount": 12000}]},
            "modelVersion": "gemini-2.5-flash-preview-09-2025"
        }),
    )])
    .await;
    let summary = plugin(config())
        .summarize(&request(gemini_caller(&mock.url(), &[])))
        .await
        .expect("summary");
    let u = summary.usage.expect("usage");
    assert_eq!(u.model, "gemini-2.5-flash-preview-09-2025");
    assert_eq!(
        (u.input, u.output, u.cache_read, u.cache_write),
        (12_000, 2_000, 8_192, 0)
    );

    // Without `modelVersion`, the model asked for (configured, without `models/`).
    let mock = MockProvider::start(vec![Reply::Json(
        200,
        json!({"candidates": [{"content": {"parts": [{"text": "sum"}]}}],
               "usageMetadata": {"promptTokenCount": 7, "candidatesTokenCount": 3}}),
    )])
    .await;
    let p = plugin(GeminiConfig {
        base_url: Some(mock.url()),
        model: Some("models/gemini-2.5-pro".into()),
        ..config()
    });
    let summary = p
        .summarize(&request(caller("http://unused.invalid", &[])))
        .await
        .expect("summary");
    assert_eq!(
        mock.received()[0].path,
        "/v1beta/models/gemini-2.5-pro:generateContent"
    );
    let u = summary.usage.expect("usage");
    assert_eq!(
        (u.model.as_str(), u.input, u.output, u.cache_read),
        ("gemini-2.5-pro", 7, 3, 0)
    );
}

#[tokio::test]
async fn provider_errors_become_status_errors_with_the_providers_message() {
    let p = plugin(config());
    for (code, status, message) in [
        (
            400,
            "INVALID_ARGUMENT",
            "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).",
        ),
        (
            429,
            "RESOURCE_EXHAUSTED",
            "You exceeded your current quota, please check your plan and billing details.",
        ),
        (503, "UNAVAILABLE", "The model is overloaded. Please try again later."),
    ] {
        let mock = MockProvider::start(vec![error(code, status, message)]).await;
        match p
            .summarize(&request(gemini_caller(&mock.url(), &[])))
            .await
        {
            Err(SummarizeError::Status {
                status: got,
                message: said,
            }) => {
                assert_eq!(got, code);
                assert_eq!(said, message);
            }
            other => panic!("{code}: {other:?}"),
        }
        assert_eq!(mock.received().len(), 1, "no retry");
    }
}

#[tokio::test]
async fn a_server_that_never_answers_times_out() {
    let mock = MockProvider::start(vec![Reply::Hang]).await;
    let mut req = request(gemini_caller(&mock.url(), &[]));
    req.timeout = Duration::from_millis(300);
    let started = Instant::now();
    let err = plugin(config())
        .summarize(&req)
        .await
        .expect_err("times out");
    assert!(
        matches!(err, SummarizeError::Timeout(t) if t == Duration::from_millis(300)),
        "{err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn models_that_cannot_stand_in_the_path_are_refused_unsent() {
    let mock = MockProvider::start(vec![text("sum")]).await;
    let p = plugin(config());
    for model in [
        "tunedModels/mine",
        "gemini-2.5-flash:streamGenerateContent",
        "gemini?alt=sse",
        "gemini#x",
        "gemini 2.5",
        "gemini%2Fx",
    ] {
        let mut req = request(gemini_caller(&mock.url(), &[]));
        req.model = Some(model.into());
        match p.summarize(&req).await {
            Err(SummarizeError::Config(m)) => assert!(m.contains("model name"), "{m}"),
            other => panic!("{model}: {other:?}"),
        }
    }
    let mut req = request(gemini_caller(&mock.url(), &[]));
    req.model = None;
    let err = p.summarize(&req).await.expect_err("no model");
    assert!(matches!(err, SummarizeError::Config(_)), "{err:?}");
    // Nor is there anywhere to send it without an upstream or a base_url.
    let err = p
        .summarize(&request(Caller::default()))
        .await
        .expect_err("no endpoint");
    assert!(matches!(err, SummarizeError::Config(_)), "{err:?}");
    assert!(mock.received().is_empty(), "nothing sent");
}

#[tokio::test]
async fn answers_over_the_summary_bound_are_refused() {
    let p = plugin(GeminiConfig {
        max_summary_bytes: 1000,
        ..config()
    });
    let mock = MockProvider::start(vec![answer(json!([
        {"text": "a".repeat(600)},
        {"text": "b".repeat(600)},
    ]))])
    .await;
    let err = p
        .summarize(&request(gemini_caller(&mock.url(), &[])))
        .await
        .expect_err("summary too large");
    assert!(
        matches!(&err, SummarizeError::TooLarge { what, limit: 1000 } if what == "summary"),
        "{err:?}"
    );
    let big = "a".repeat(1000 + SUMMARY_ENVELOPE_BYTES);
    let mock = MockProvider::start(vec![answer(json!([{ "text": big }]))]).await;
    let err = p
        .summarize(&request(gemini_caller(&mock.url(), &[])))
        .await
        .expect_err("answer too large");
    assert!(
        matches!(&err, SummarizeError::TooLarge { what, .. } if what == "response body"),
        "{err:?}"
    );
    assert_eq!(mock.received().len(), 1, "asked once");
}

/// A conversation as compactor builds it for a Gemini caller: the request as the provider last
/// received it, then a user turn asking for the summary.
fn conversation() -> Value {
    json!({
        "systemInstruction": {"parts": [{"text": "You are Gemini CLI."}]},
        "contents": [
            {"role": "user", "parts": [{"text": "fix the parser"}]},
            {"role": "model", "parts": [{"functionCall": {"name": "run_shell", "args": {"cmd": "cargo test"}}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "run_shell", "response": {"output": "ok"}}}]},
            {"role": "user", "parts": [{"text": "Summarize the conversation above."}]}
        ],
        "tools": [{"functionDeclarations": [{"name": "run_shell"}]}],
        "generationConfig": {"maxOutputTokens": 2000}
    })
}

fn in_conversation() -> Option<std::sync::Arc<[u8]>> {
    Some(serde_json::to_vec(&conversation()).expect("json").into())
}

#[tokio::test]
async fn the_conversation_itself_is_sent_to_the_callers_own_model_and_upstream() {
    let mock = MockProvider::start(vec![answer(json!([
        {"text": "thinking", "thought": true},
        {"text": "the summary"}
    ]))])
    .await;
    let p = plugin(config());
    assert!(p.reads_conversation(Api::Gemini));
    let mut req = request(gemini_caller(
        &mock.url(),
        &[("x-goog-api-key", "AIza-own")],
    ));
    req.in_conversation = in_conversation();
    let summary = p.summarize(&req).await.expect("summary");
    assert_eq!(summary.text, "the summary");
    let got = mock.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].path, OWN_PATH);
    assert_eq!(got[0].header("x-goog-api-key"), Some("AIza-own"));
    assert_eq!(got[0].body, conversation(), "sent exactly as built");
}

#[tokio::test]
async fn a_refused_shape_or_a_text_less_answer_falls_back_to_the_prompt() {
    let p = plugin(config());
    for first in [
        error(
            400,
            "INVALID_ARGUMENT",
            "Please ensure that function call turn comes immediately after a user turn.",
        ),
        answer(json!([{"functionCall": {"name": "run_shell", "args": {"cmd": "ls"}}}])),
    ] {
        let mock = MockProvider::start(vec![first, text("from the prompt")]).await;
        let mut req = request(gemini_caller(
            &mock.url(),
            &[("x-goog-api-key", "AIza-own")],
        ));
        req.in_conversation = in_conversation();
        let summary = p.summarize(&req).await.expect("the prompt answers");
        assert_eq!(summary.text, "from the prompt");
        let got = mock.received();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].body, conversation());
        assert_eq!(
            (got[0].path.as_str(), got[1].path.as_str()),
            (OWN_PATH, OWN_PATH)
        );
        assert_eq!(got[1].header("x-goog-api-key"), Some("AIza-own"));
        assert_eq!(
            got[1].body["contents"][0]["parts"][0]["text"],
            req.prompt.as_str()
        );
        assert_eq!(
            got[1].body["systemInstruction"]["parts"][0]["text"],
            SYSTEM_PROMPT
        );
    }
}

#[tokio::test]
async fn rate_limits_and_server_errors_are_not_asked_again() {
    let p = plugin(config());
    for (code, status) in [(429, "RESOURCE_EXHAUSTED"), (503, "UNAVAILABLE")] {
        let mock = MockProvider::start(vec![error(code, status, "busy"), text("unused")]).await;
        let mut req = request(gemini_caller(&mock.url(), &[]));
        req.in_conversation = in_conversation();
        match p.summarize(&req).await {
            Err(SummarizeError::Status { status, .. }) => assert_eq!(status, code),
            other => panic!("{code}: {other:?}"),
        }
        assert_eq!(mock.received().len(), 1, "{code}: no second request");
    }
}

#[tokio::test]
async fn the_conversation_is_not_sent_elsewhere() {
    // A configured model has no cache of this conversation.
    let mock = MockProvider::start(vec![text("s")]).await;
    let p = plugin(GeminiConfig {
        model: Some("gemini-2.5-flash-lite".into()),
        ..config()
    });
    assert!(!p.reads_conversation(Api::Gemini));
    let mut req = request(gemini_caller(&mock.url(), &[]));
    req.in_conversation = in_conversation();
    p.summarize(&req).await.expect("summary");
    let got = mock.received();
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0].path,
        "/v1beta/models/gemini-2.5-flash-lite:generateContent"
    );
    assert_eq!(
        got[0].body["systemInstruction"]["parts"][0]["text"],
        SYSTEM_PROMPT
    );

    // Nor does a configured endpoint.
    let mock = MockProvider::start(vec![text("s")]).await;
    let p = plugin(GeminiConfig {
        base_url: Some(mock.url()),
        ..config()
    });
    let mut req = request(gemini_caller("http://unused.invalid", &[]));
    req.in_conversation = in_conversation();
    p.summarize(&req).await.expect("summary");
    assert_eq!(mock.received()[0].path, OWN_PATH);
    assert_eq!(
        mock.received()[0].body["systemInstruction"]["parts"][0]["text"],
        SYSTEM_PROMPT
    );

    // Nor is a caller of another wire format's conversation a Gemini body.
    let mock = MockProvider::start(vec![text("s")]).await;
    let mut req = request(Caller {
        api: Api::Messages,
        ..gemini_caller(&mock.url(), &[])
    });
    req.in_conversation = Some(b"{}".as_slice().into());
    plugin(config()).summarize(&req).await.expect("summary");
    assert_eq!(mock.received().len(), 1);
    assert_eq!(
        mock.received()[0].body["systemInstruction"]["parts"][0]["text"],
        SYSTEM_PROMPT
    );
}
