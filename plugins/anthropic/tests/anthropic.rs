//! The `anthropic` backend against a mock Messages API server on a real socket.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;

use compactor_plugin_anthropic::{AnthropicConfig, AnthropicSummarizer, SYSTEM_PROMPT};
use compactor_plugin_api::{Caller, SummarizeError, Summarizer, SummaryRequest};

/// What the mock received.
#[derive(Debug, Clone)]
struct Received {
    path: String,
    headers: http::HeaderMap,
    body: Value,
}

/// How the mock answers.
#[derive(Clone)]
enum Reply {
    Json(u16, Value),
    Text(u16, &'static str),
    Hang,
}

struct Mock {
    addr: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Mock {
    /// Answers the n-th request with `replies[n]` (the last one repeats).
    async fn start(replies: Vec<Reply>) -> Mock {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let received = Arc::new(Mutex::new(Vec::new()));
        let log = received.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let log = log.clone();
                let replies = replies.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let log = log.clone();
                        let replies = replies.clone();
                        async move {
                            let (parts, body) = req.into_parts();
                            let bytes = body.collect().await.expect("body").to_bytes();
                            let n = {
                                let mut log = log.lock().expect("lock");
                                log.push(Received {
                                    path: parts.uri.path().to_owned(),
                                    headers: parts.headers,
                                    body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
                                });
                                log.len() - 1
                            };
                            let reply = replies[n.min(replies.len() - 1)].clone();
                            let (status, body) = match reply {
                                Reply::Json(s, v) => (s, v.to_string()),
                                Reply::Text(s, t) => (s, t.to_owned()),
                                Reply::Hang => std::future::pending().await,
                            };
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(status)
                                    .header("content-type", "application/json")
                                    .body(Full::new(Bytes::from(body)))
                                    .expect("response"),
                            )
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Mock { addr, received }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn received(&self) -> Vec<Received> {
        self.received.lock().expect("lock").clone()
    }
}

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

fn caller(base: &str, credentials: &[(&str, &str)]) -> Caller {
    Caller {
        upstream_base_url: base.into(),
        api_prefix: "/v1".into(),
        credentials: credentials
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Caller::default()
    }
}

fn header<'a>(r: &'a Received, name: &str) -> Option<&'a str> {
    r.headers.get(name).and_then(|v| v.to_str().ok())
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
    let mock = Mock::start(vec![message(json!([
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
    assert_eq!(header(r, "x-api-key"), Some("sk-ant-configured"));
    assert_eq!(header(r, "anthropic-version"), Some("2023-06-01"));
    assert_eq!(header(r, "content-type"), Some("application/json"));
    assert!(header(r, "authorization").is_none());
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
    let mock = Mock::start(vec![message(json!([{"type": "text", "text": "sum"}]))]).await;
    let p = plugin(config());
    let req = request(caller(&mock.url(), &[("x-api-key", "sk-ant-caller")]));
    assert_eq!(p.summarize(&req).await.expect("summary").text, "sum");
    let r = &mock.received()[0];
    assert_eq!(r.path, "/v1/messages");
    assert_eq!(header(r, "x-api-key"), Some("sk-ant-caller"));
    assert_eq!(r.body["model"], "claude-sonnet-4-5");
    assert_eq!(r.body["max_tokens"], 2000);
}

#[tokio::test]
async fn a_bearer_only_caller_is_passed_on_as_authorization() {
    let mock = Mock::start(vec![message(json!([{"type": "text", "text": "sum"}]))]).await;
    let p = plugin(config());
    let req = request(caller(
        &mock.url(),
        &[("authorization", "Bearer oauth-token")],
    ));
    p.summarize(&req).await.expect("summary");
    let r = &mock.received()[0];
    assert_eq!(header(r, "authorization"), Some("Bearer oauth-token"));
    assert!(header(r, "x-api-key").is_none());
}

#[tokio::test]
async fn provider_errors_become_status_errors() {
    let mock = Mock::start(vec![Reply::Json(
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
    let mock = Mock::start(vec![Reply::Json(
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
    let mock = Mock::start(vec![Reply::Hang]).await;
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
    let mock = Mock::start(vec![message(
        json!([{"type": "tool_use", "id": "x", "name": "n", "input": {}}]),
    )])
    .await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("no text");
    assert!(matches!(err, SummarizeError::InvalidOutput(_)), "{err:?}");
    let mock = Mock::start(vec![message(json!([{"type": "text", "text": "  "}]))]).await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("blank");
    assert!(matches!(err, SummarizeError::Blank), "{err:?}");
    let mock = Mock::start(vec![Reply::Text(200, "{}")]).await;
    let err = p
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("no content");
    assert!(matches!(err, SummarizeError::InvalidOutput(_)), "{err:?}");
}
