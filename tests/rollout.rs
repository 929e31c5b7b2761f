//! Rolling compactor out, through the real proxy: `compaction.mode = "shadow"` decides and
//! forwards the request as received, byte for byte, counting what enforce would have sent;
//! `compaction.sample_ratio` splits conversations into a compacted and a control cohort by a
//! stable hash of the session id, the same split on every replica and after a restart; a
//! request's `x-compactor-mode` header overrides both and is never forwarded; each cohort's
//! requests, tokens and refusals for length are counted apart.

mod support;

use bytes::Bytes;
use serde_json::{json, Value};
use support::summary_calls::{agent_requests, is_summary_request};
use support::{upstream_toml, Exchange, MockUpstream, Reply, TestClient, TestProxy};

/// Compacts past 10 messages; summaries by the network backend unless a test says otherwise,
/// so a summarizer call would reach the mock and be seen.
const COMPACTS: &str = "[compaction]\nmax_messages = 10\nmin_preserve_tokens = 20\n\
                        max_preserve_tokens = 200\n";

fn conversation(n: usize, topic: &str) -> Value {
    let mut m = vec![json!({"role": "system", "content": "You are a careful assistant."})];
    for i in 0..n {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        m.push(
            json!({"role": role, "content": format!("{topic} turn {i}: {}", "words ".repeat(300))}),
        );
    }
    json!({"model": "gpt-4o", "messages": m})
}

fn answer() -> Reply {
    Reply::json(
        200,
        &json!({"id": "c", "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "Short summary of the work."}}]}),
    )
}

async fn provider() -> MockUpstream {
    let mock = MockUpstream::start().await;
    mock.set_handler(|_| answer());
    mock
}

async fn send(proxy: &TestProxy, body: &Value, headers: &[(&str, &str)]) -> Exchange {
    send_to(proxy, "/v1/chat/completions", body, headers).await
}

async fn send_to(
    proxy: &TestProxy,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Exchange {
    let mut all = vec![
        ("content-type", "application/json"),
        ("authorization", "Bearer sk-rollout"),
    ];
    all.extend_from_slice(headers);
    TestClient::http1()
        .exchange(
            "POST",
            &proxy.url(path),
            &all,
            Bytes::from(body.to_string()),
        )
        .await
}

async fn metric(proxy: &TestProxy, name: &str, labels: &[(&str, &str)]) -> f64 {
    proxy.metric(name, labels).await.unwrap_or(0.0)
}

#[tokio::test]
async fn shadow_forwards_the_request_as_received_and_counts_what_enforce_would_send() {
    let mock = provider().await;
    let proxy = TestProxy::start(&format!(
        "{}{COMPACTS}mode = \"shadow\"\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let body = conversation(21, "shadow");
    let sent = Bytes::from(body.to_string());
    let got = send(&proxy, &body, &[]).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    let requests = mock.requests();
    assert_eq!(
        requests.len(),
        1,
        "no summarizer call reaches the provider in shadow: {:?}",
        requests
            .iter()
            .map(|r| r.path().to_string())
            .collect::<Vec<_>>()
    );
    assert_eq!(requests[0].body, sent, "forwarded byte for byte");

    let shadow = [("cohort", "shadow")];
    assert_eq!(
        metric(&proxy, "compactor_cohort_requests_total", &shadow).await,
        1.0
    );
    assert_eq!(
        metric(&proxy, "compactor_cohort_compacted_requests_total", &shadow).await,
        1.0,
        "enforce would have compacted it"
    );
    let received = metric(
        &proxy,
        "compactor_cohort_tokens_total",
        &[("cohort", "shadow"), ("stage", "received")],
    )
    .await;
    let would = metric(
        &proxy,
        "compactor_cohort_tokens_total",
        &[("cohort", "shadow"), ("stage", "forwarded")],
    )
    .await;
    assert!(
        would > 0.0 && would < received / 2.0,
        "would forward {would} of {received}"
    );
    // Nothing was compacted for real.
    assert_eq!(
        metric(
            &proxy,
            "compactor_compactions_total",
            &[("trigger", "messages"), ("outcome", "compacted")]
        )
        .await,
        0.0
    );
    assert_eq!(
        metric(&proxy, "compactor_tokens_saved_total", &[]).await,
        0.0
    );

    // The next request of the conversation: the shadow splices its own summary (no second
    // shadow summary is needed for two more messages), still forwarded as received.
    let mut longer = body.clone();
    let messages = longer["messages"].as_array_mut().expect("messages");
    messages.push(json!({"role": "assistant", "content": "done"}));
    messages.push(json!({"role": "user", "content": "next"}));
    let sent = Bytes::from(longer.to_string());
    send(&proxy, &longer, &[]).await;
    assert_eq!(mock.last_request().body, sent);
    assert_eq!(
        metric(&proxy, "compactor_cohort_compacted_requests_total", &shadow).await,
        2.0
    );
    assert_eq!(
        metric(&proxy, "compactor_cohort_conversations_total", &shadow).await,
        1.0,
        "one conversation, two requests"
    );
}

/// Which of `sessions` a proxy compacts (each a long conversation with its own session id).
async fn compacted_sessions(proxy: &TestProxy, sessions: &[String]) -> Vec<bool> {
    let mut out = Vec::new();
    for id in sessions {
        let got = send(
            proxy,
            &conversation(13, id),
            &[("x-compactor-session", id.as_str())],
        )
        .await;
        assert_eq!(got.status, 200);
        out.push(got.header("x-compactor-compacted") == Some("true"));
    }
    out
}

#[tokio::test]
async fn the_cohort_split_is_the_same_on_every_replica_and_after_a_restart() {
    let config = |mock: &MockUpstream| {
        format!(
            "{}{COMPACTS}sample_ratio = 0.5\n[summarizer]\nbackend = \"extractive\"\n",
            upstream_toml(&mock.url())
        )
    };
    let sessions: Vec<String> = (0..120).map(|i| format!("conversation-{i}")).collect();
    let mock = provider().await;
    let a = TestProxy::start(&config(&mock)).await;
    let b = TestProxy::start(&config(&mock)).await;
    let on_a = compacted_sessions(&a, &sessions).await;
    let on_b = compacted_sessions(&b, &sessions).await;
    assert_eq!(on_a, on_b, "two replicas split the same way");
    a.shutdown().await;
    let restarted = TestProxy::start(&config(&mock)).await;
    assert_eq!(
        compacted_sessions(&restarted, &sessions).await,
        on_a,
        "a restart keeps every conversation in its cohort"
    );
    let share = on_a.iter().filter(|c| **c).count() as f64 / sessions.len() as f64;
    assert!((0.35..=0.65).contains(&share), "half compacted: {share}");
    // Per cohort: the control requests were forwarded as received.
    let control = metric(
        &b,
        "compactor_cohort_requests_total",
        &[("cohort", "control")],
    )
    .await;
    let enforce = metric(
        &b,
        "compactor_cohort_requests_total",
        &[("cohort", "enforce")],
    )
    .await;
    assert_eq!(control + enforce, sessions.len() as f64);
    assert_eq!(
        enforce,
        on_a.iter().filter(|c| **c).count() as f64,
        "every conversation of the compacted cohort was compacted"
    );
    assert_eq!(
        metric(
            &b,
            "compactor_cohort_compacted_requests_total",
            &[("cohort", "control")]
        )
        .await,
        0.0
    );
    let tokens = |cohort: &'static str, stage: &'static str| {
        let b = &b;
        async move {
            metric(
                b,
                "compactor_cohort_tokens_total",
                &[("cohort", cohort), ("stage", stage)],
            )
            .await
        }
    };
    assert_eq!(
        tokens("control", "received").await,
        tokens("control", "forwarded").await
    );
    assert!(tokens("enforce", "forwarded").await < tokens("enforce", "received").await);
}

#[tokio::test]
async fn the_mode_header_overrides_the_configuration_and_is_never_forwarded() {
    let mock = provider().await;
    // Nothing sampled: only the header can make a request compacted.
    let proxy = TestProxy::start(&format!(
        "{}{COMPACTS}sample_ratio = 0.0\n[summarizer]\nbackend = \"extractive\"\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let body = conversation(21, "header");
    let sent = Bytes::from(body.to_string());

    let got = send(&proxy, &body, &[]).await;
    assert_eq!(
        got.header("x-compactor-compacted"),
        Some("false"),
        "control"
    );
    assert_eq!(mock.last_request().body, sent);

    let got = send(&proxy, &body, &[("x-compactor-mode", "enforce")]).await;
    assert_eq!(got.header("x-compactor-compacted"), Some("true"));
    let forwarded = mock.last_request();
    assert!(forwarded.body.len() < sent.len() / 2, "compacted");
    assert_eq!(forwarded.header("x-compactor-mode"), None, "stripped");

    let enforcing = TestProxy::start(&format!(
        "{}{COMPACTS}[summarizer]\nbackend = \"extractive\"\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let got = send(&enforcing, &body, &[("x-compactor-mode", "OFF")]).await;
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    assert_eq!(mock.last_request().body, sent, "opted out: as received");
    assert_eq!(mock.last_request().header("x-compactor-mode"), None);
    assert_eq!(
        metric(
            &enforcing,
            "compactor_cohort_requests_total",
            &[("cohort", "off")]
        )
        .await,
        1.0
    );
    // A value naming no mode is ignored, and stripped all the same.
    let got = send(&enforcing, &body, &[("x-compactor-mode", "sometimes")]).await;
    assert_eq!(got.header("x-compactor-compacted"), Some("true"));
    assert_eq!(mock.last_request().header("x-compactor-mode"), None);
    // Non-chat calls lose it too.
    TestClient::http1()
        .exchange(
            "GET",
            &enforcing.url("/v1/models"),
            &[("x-compactor-mode", "shadow")],
            Bytes::new(),
        )
        .await;
    assert_eq!(mock.last_request().path(), "/v1/models");
    assert_eq!(mock.last_request().header("x-compactor-mode"), None);
}

#[tokio::test]
async fn a_control_request_refused_for_length_reaches_the_agent_and_is_counted() {
    let mock = MockUpstream::start().await;
    mock.set_handler(|r| {
        if is_summary_request(r) {
            answer()
        } else {
            Reply::json(
                400,
                &json!({"error": {"message": "This model's maximum context length is 4096 tokens. However, your messages resulted in 6100 tokens.", "type": "invalid_request_error", "code": "context_length_exceeded"}}),
            )
        }
    });
    // Below every trigger: only the provider's refusal would make compactor act.
    let proxy = TestProxy::start(&format!(
        "{}[compaction]\nsample_ratio = 0.0\nmin_preserve_tokens = 20\nmax_preserve_tokens = 200\n\
         [summarizer]\nbackend = \"extractive\"\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let got = send(&proxy, &conversation(9, "refused"), &[]).await;
    assert_eq!(got.status, 400, "as without compactor");
    assert!(String::from_utf8_lossy(&got.body).contains("context_length_exceeded"));
    assert_eq!(agent_requests(&mock).len(), 1, "not retried");
    assert_eq!(
        metric(
            &proxy,
            "compactor_cohort_context_errors_total",
            &[("cohort", "control")]
        )
        .await,
        1.0
    );
    // The same refusal for a compacted conversation is compacted and retried, and counted in
    // its own cohort.
    let got = send(
        &proxy,
        &conversation(9, "refused"),
        &[("x-compactor-mode", "enforce")],
    )
    .await;
    assert_eq!(got.status, 400, "the provider refuses every size here");
    assert_eq!(agent_requests(&mock).len(), 3, "the original and one retry");
    assert_eq!(
        metric(
            &proxy,
            "compactor_cohort_context_errors_total",
            &[("cohort", "enforce")]
        )
        .await,
        1.0,
        "the refusal before the retry (the retry's answer reaches the agent as it is)"
    );
}

#[tokio::test]
async fn a_reload_moves_the_proxy_from_shadow_to_enforce() {
    use compactor::cohort::Cohort;
    use compactor::compaction::Attempts;
    use compactor::pipeline::{Outcome, RequestContext};
    use std::sync::Arc;

    let toml = |mode: &str| {
        format!(
            "[upstream]\nbase_url = \"http://127.0.0.1:9\"\n{COMPACTS}mode = \"{mode}\"\n\
             [summarizer]\nbackend = \"extractive\"\n"
        )
    };
    let config = |mode: &str| compactor::Config::from_toml(&toml(mode)).expect("config");
    let caller = Arc::new(compactor_plugin_api::Caller {
        upstream_base_url: "http://127.0.0.1:9".into(),
        api_prefix: "/v1".into(),
        credentials: Vec::new(),
        api: compactor_plugin_api::Api::ChatCompletions,
    });
    let body = Bytes::from(conversation(21, "reload").to_string());
    // What `pipeline` decides for the conversation.
    let handle = |pipeline: &Arc<compactor::pipeline::Pipeline>| {
        let (pipeline, caller, body) = (pipeline.clone(), caller.clone(), body.clone());
        async move {
            let attempts = Attempts::per_request();
            let context = RequestContext {
                caller: &caller,
                session_header: None,
                long_context: false,
                attempts: &attempts,
                mode: None,
            };
            pipeline
                .handle(
                    compactor::dialect::DialectKind::ChatCompletions,
                    &body,
                    &context,
                )
                .await
        }
    };
    let shadow = compactor::app::App::new(config("shadow")).expect("app");
    let watched = handle(&shadow.pipeline).await;
    assert_eq!(watched.cohort, Cohort::Shadow);
    assert!(matches!(watched.outcome, Outcome::Unchanged));
    let enforcing = shadow.reconfigure(config("enforce")).expect("reload");
    let compacted = handle(&enforcing.pipeline).await;
    assert_eq!(compacted.cohort, Cohort::Enforce);
    // A new summary: the shadow's own never reaches a request forwarded for real.
    assert!(
        matches!(compacted.outcome, Outcome::Rewritten { .. }),
        "{:?}",
        compacted.outcome
    );

    // A route's own settings are applied by a reload too.
    let routed = |mode: &str| {
        compactor::Config::from_toml(&format!(
            "{}[[routes]]\nprefix = \"/r\"\nbase_url = \"http://127.0.0.1:9\"\n\
             compaction = {{ mode = \"{mode}\" }}\n",
            toml("enforce")
        ))
        .expect("config")
    };
    let app = enforcing.reconfigure(routed("shadow")).expect("reload");
    assert!(Arc::ptr_eq(app.pipeline_for(None), &app.pipeline));
    assert!(!Arc::ptr_eq(app.pipeline_for(Some(0)), &app.pipeline));
    assert_eq!(
        handle(app.pipeline_for(Some(0))).await.cohort,
        Cohort::Shadow
    );
    let app = app.reconfigure(routed("enforce")).expect("reload");
    assert_eq!(
        handle(app.pipeline_for(Some(0))).await.cohort,
        Cohort::Enforce
    );
}

#[tokio::test]
async fn routes_carry_their_own_compaction_settings() {
    let mock = provider().await;
    let url = mock.url();
    let proxy = TestProxy::start(&format!(
        "{}{COMPACTS}[summarizer]\nbackend = \"extractive\"\n\
         [[routes]]\nprefix = \"/batch\"\nbase_url = \"{url}\"\n\
         [routes.compaction]\nenabled = false\n\
         [[routes]]\nprefix = \"/watch\"\nbase_url = \"{url}\"\n\
         compaction = {{ mode = \"shadow\" }}\n\
         [[routes]]\nprefix = \"/long\"\nbase_url = \"{url}\"\n\
         compaction = {{ max_messages = 100 }}\n\
         [[routes]]\nprefix = \"/plain\"\nbase_url = \"{url}\"\n",
        upstream_toml(&url)
    ))
    .await;
    for (path, compacted) in [
        ("/v1/chat/completions", true),
        ("/plain/v1/chat/completions", true),
        ("/batch/v1/chat/completions", false),
        ("/watch/v1/chat/completions", false),
        ("/long/v1/chat/completions", false),
    ] {
        // A conversation of its own per route (the routes share the stored summaries).
        let body = conversation(21, path);
        let sent = Bytes::from(body.to_string());
        let got = send_to(&proxy, path, &body, &[]).await;
        assert_eq!(got.status, 200, "{path}");
        let forwarded = mock.last_request();
        assert_eq!(
            forwarded.path(),
            "/v1/chat/completions",
            "{path}: prefix stripped"
        );
        assert_eq!(forwarded.body == sent, !compacted, "{path}");
        let header = if compacted { "true" } else { "false" };
        assert_eq!(got.header("x-compactor-compacted"), Some(header), "{path}");
    }
    // The shadow route decided (and would have compacted); the disabled one was not read.
    assert_eq!(
        metric(
            &proxy,
            "compactor_cohort_compacted_requests_total",
            &[("cohort", "shadow")]
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(
            &proxy,
            "compactor_cohort_requests_total",
            &[("cohort", "enforce")]
        )
        .await,
        3.0,
        "the default, /plain and /long (below its own message limit)"
    );
}
