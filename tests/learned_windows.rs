//! Learned context windows, through the real proxy: a window a provider names when it refuses
//! a request for its length, or one its `usage` shows to be larger than the table says, is
//! remembered for the model, listed by `GET /models`, counted, and used by the trigger from
//! the next request on (another conversation's included).

mod support;

use bytes::Bytes;
use serde_json::{json, Value};
use support::summary_calls::{agent_requests, is_summary_request};
use support::{upstream_toml, Exchange, MockUpstream, Recorded, Reply, TestClient, TestProxy};

/// No message trigger; the `extractive` summarizer needs no network.
const CONFIG: &str = "[compaction]\nmax_messages = 1000\nmin_preserve_tokens = 20\n\
                      max_preserve_tokens = 200\n[summarizer]\nbackend = \"extractive\"\n\
                      [models]\n\"tiny\" = { context_window = 1000 }\n";

/// The provider's real window for `local-model`, which the models table does not know (it
/// falls to the 128k default).
const REAL_WINDOW: usize = 1_000;

/// A conversation of `n` turns of about 230 characters each.
fn conversation(topic: &str, n: usize) -> Vec<Value> {
    let mut m = vec![json!({"role": "system", "content": "You are a careful assistant."})];
    for i in 0..n {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        m.push(
            json!({"role": role, "content": format!("{topic} turn {i}: {}", "words ".repeat(38))}),
        );
    }
    m
}

/// The provider's own count, roughly: a quarter token per character of message text.
fn provider_tokens(r: &Recorded) -> usize {
    let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    v["messages"].as_array().map_or(0, |m| {
        m.iter()
            .map(|m| m["content"].as_str().map_or(0, str::len))
            .sum()
    }) / 4
}

fn answer(usage: Option<(u64, u64)>) -> Reply {
    let mut v = json!({"id": "c", "object": "chat.completion",
                       "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": "fits"}}]});
    if let Some((input, output)) = usage {
        v["usage"] = json!({"prompt_tokens": input, "completion_tokens": output,
                            "total_tokens": input + output});
    }
    Reply::json(200, &v)
}

/// Refuses requests over [`REAL_WINDOW`] the way OpenAI words it.
async fn small_provider() -> MockUpstream {
    let mock = MockUpstream::start().await;
    mock.set_handler(|r| {
        let tokens = provider_tokens(r);
        if is_summary_request(r) || tokens <= REAL_WINDOW {
            answer(None)
        } else {
            Reply::json(
                400,
                &json!({"error": {"message": format!("This model's maximum context length is {REAL_WINDOW} tokens. However, your messages resulted in {tokens} tokens. Please reduce the length of the messages."), "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}),
            )
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
                ("authorization", "Bearer sk-windows"),
            ],
            Bytes::from(body.to_string()),
        )
        .await
}

async fn models(proxy: &TestProxy) -> Value {
    let (status, text) = TestClient::http1()
        .get_text(&proxy.admin_url("/models"))
        .await;
    assert_eq!(status, 200, "GET /models: {text}");
    serde_json::from_str(&text).expect("JSON")
}

fn listed<'a>(models: &'a Value, model: &str) -> Option<&'a Value> {
    models["models"]
        .as_array()?
        .iter()
        .find(|m| m["model"] == model)
}

#[tokio::test]
async fn a_window_named_in_a_refusal_is_used_by_the_trigger_from_then_on() {
    let mock = small_provider().await;
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
    let before = models(&proxy).await;
    assert_eq!(before["default_context_window"], 128_000);
    assert!(listed(&before, "local-model").is_none());
    assert_eq!(
        listed(&before, "tiny").map(|m| m["source"].clone()),
        Some(json!("configured")),
        "the table is listed: {before}"
    );

    // First conversation: about a thousand tokens, far under the default window's trigger,
    // over the provider's real window. Refused, compacted, retried.
    let first = json!({"model": "Local-Model", "messages": conversation("alpha", 18)});
    let got = send(&proxy, &first).await;
    assert_eq!(got.status, 200, "{:?}", got.body);
    assert_eq!(got.header("x-compactor-retried"), Some("true"));
    assert_eq!(agent_requests(&mock).len(), 2, "refused, then retried");

    let learned = models(&proxy).await;
    let entry = listed(&learned, "local-model").expect("learned under its model key");
    assert_eq!(entry["context_window"], REAL_WINDOW);
    assert_eq!(entry["source"], "error");
    assert!(entry["learned_unix"].as_u64().is_some_and(|t| t > 0));
    assert_eq!(
        proxy
            .metric(
                "compactor_context_window_learned_total",
                &[("source", "error")]
            )
            .await,
        Some(1.0)
    );

    // Another conversation of the same size and model: compacted before it is sent, so the
    // provider never refuses it.
    let second = json!({"model": "local-model", "messages": conversation("beta", 18)});
    let got = send(&proxy, &second).await;
    assert_eq!(got.status, 200, "{:?}", got.body);
    assert_eq!(got.header("x-compactor-retried"), None);
    assert_eq!(got.header("x-compactor-compacted"), Some("true"));
    let all = agent_requests(&mock);
    assert_eq!(all.len(), 3, "one request for the second conversation");
    assert!(provider_tokens(&all[2]) <= REAL_WINDOW, "it fits");
    assert_eq!(
        proxy
            .metric(
                "compactor_compactions_total",
                &[("trigger", "tokens"), ("outcome", "compacted")]
            )
            .await,
        Some(1.0)
    );
    assert_eq!(
        proxy
            .metric(
                "compactor_context_window_learned_total",
                &[("source", "error")]
            )
            .await,
        Some(1.0),
        "the same refusal teaches nothing new"
    );
}

#[tokio::test]
async fn usage_beyond_the_configured_window_raises_it() {
    // `tiny` is configured at 1,000 tokens, but the provider serves it with a larger window.
    let mock = MockUpstream::start().await;
    // Input counted as the estimate counts it (calibration stays near 1), and a long answer.
    mock.set_handler(|r| answer(Some((provider_tokens(r) as u64, 3_000))));
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;

    // A small request whose usage (its input and 3,000 output) exceeds the configured window.
    let small = json!({"model": "tiny", "messages": conversation("gamma", 2)});
    let got = send(&proxy, &small).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    proxy
        .wait_metric(
            "compactor_context_window_learned_total",
            &[("source", "usage")],
            1.0,
        )
        .await;
    let learned = models(&proxy).await;
    let entry = listed(&learned, "tiny").expect("learned");
    assert_eq!(
        entry["source"], "usage",
        "learned entries come first: {learned}"
    );
    let used = entry["context_window"].as_u64().expect("a number");
    assert!(used > 3_000, "input plus output: {used}");

    // Over the configured window's trigger (850 estimated tokens), well under the learned
    // one's. Forwarded whole.
    let larger = json!({"model": "tiny", "messages": conversation("delta", 18)});
    let got = send(&proxy, &larger).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    let last = mock.last_request();
    let forwarded: Value = serde_json::from_slice(&last.body).expect("JSON");
    assert_eq!(forwarded["messages"], larger["messages"]);
    assert_eq!(
        proxy
            .metric(
                "compactor_compactions_total",
                &[("trigger", "tokens"), ("outcome", "compacted")]
            )
            .await,
        Some(0.0)
    );
}

#[tokio::test]
async fn a_window_is_learned_for_the_upstream_that_showed_it_not_for_the_model_name() {
    // A local server under `/local` serves `local-model` with a small window; the default
    // upstream serves a model of the same name with a large one.
    let small = small_provider().await;
    let large = MockUpstream::start().await;
    large.set_handler(|_| answer(None));
    let toml = format!(
        "{}[[routes]]\nprefix = \"/local\"\nbase_url = \"{}\"\n{CONFIG}",
        upstream_toml(&large.url()),
        small.url()
    );
    let proxy = TestProxy::start(&toml).await;
    let send_to = |path: &'static str, body: Value| {
        let url = proxy.url(path);
        async move {
            TestClient::http1()
                .exchange(
                    "POST",
                    &url,
                    &[
                        ("content-type", "application/json"),
                        ("authorization", "Bearer sk-windows"),
                    ],
                    Bytes::from(body.to_string()),
                )
                .await
        }
    };

    let first = json!({"model": "local-model", "messages": conversation("alpha", 18)});
    let got = send_to("/local/v1/chat/completions", first).await;
    assert_eq!(got.status, 200, "{:?}", got.body);
    assert_eq!(got.header("x-compactor-retried"), Some("true"));

    let learned = models(&proxy).await;
    let entry = listed(&learned, "local-model").expect("learned");
    assert_eq!(entry["context_window"], REAL_WINDOW);
    assert_eq!(
        entry["upstream"].as_str(),
        Some(small.url().trim_end_matches('/')),
        "listed with the upstream it was learned from: {learned}"
    );

    // The same size and model name to the default upstream: its window is not the local
    // server's, so nothing is compacted and the conversation is forwarded whole.
    let second = json!({"model": "local-model", "messages": conversation("beta", 18)});
    let got = send_to("/v1/chat/completions", second.clone()).await;
    assert_eq!(got.status, 200, "{:?}", got.body);
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    let forwarded: Value = serde_json::from_slice(&large.last_request().body).expect("JSON");
    assert_eq!(forwarded["messages"], second["messages"]);

    // To the local server again: compacted before it is sent, never refused.
    let third = json!({"model": "local-model", "messages": conversation("gamma", 18)});
    let got = send_to("/local/v1/chat/completions", third).await;
    assert_eq!(got.status, 200, "{:?}", got.body);
    assert_eq!(got.header("x-compactor-retried"), None);
    assert_eq!(got.header("x-compactor-compacted"), Some("true"));
    proxy.shutdown().await;
}
