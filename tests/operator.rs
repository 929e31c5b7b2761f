//! Operator experience through the real proxy: exact metric values after known traffic,
//! usage read from JSON and SSE responses, calibration moving the token trigger, and the
//! `x-compactor-*` response headers.

mod support;

use serde_json::{json, Value};
use support::provider_rules::chat_tokens;
use support::{upstream_toml, MockUpstream, Recorded, Reply, TestClient, TestProxy};

const CHAT: &str = "/v1/chat/completions";

/// A conversation of `turns` user/assistant turns of `chars` characters each: runs of 15
/// letters and a digit, which compactor's estimate weighs at a quarter token per character,
/// as the mock counts.
fn conversation(topic: &str, turns: usize, chars: usize) -> Value {
    let mut messages = vec![json!({"role": "system", "content": format!("Topic: {topic}.")})];
    let text: String = "yyyyyyyyyyyyyyy1".chars().cycle().take(chars).collect();
    for i in 0..turns {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": text}));
    }
    json!({"model": "calib-model", "messages": messages})
}

/// A completion whose usage reports `factor` × the mock's own count of the prompt.
fn completion_with_usage(request: &Recorded, factor: usize) -> Reply {
    let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
    let prompt = chat_tokens(&body) * factor;
    Reply::json(
        200,
        &json!({
            "id": "c", "object": "chat.completion", "model": "calib-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 7, "total_tokens": prompt + 7,
                      "prompt_tokens_details": {"cached_tokens": 10}}
        }),
    )
}

fn proxy_config(mock: &MockUpstream, calibration: bool) -> String {
    format!(
        "{}[compaction]\ncalibration = {calibration}\nbackground_ratio = 0\nmin_preserve_tokens = 100\n\
         [summarizer]\nbackend = \"extractive\"\n\
         [models.\"calib-model\"]\ncontext_window = 10000\n",
        upstream_toml(&mock.url())
    )
}

#[tokio::test]
async fn usage_from_json_and_sse_responses_is_counted_exactly() {
    let mock = MockUpstream::start().await;
    mock.set_handler(|r| completion_with_usage(r, 1));
    let proxy = TestProxy::start(&proxy_config(&mock, true)).await;
    let client = TestClient::http1();
    for topic in ["a", "b", "c"] {
        let response = client
            .post_json(&proxy.url(CHAT), &conversation(topic, 3, 400))
            .await;
        assert_eq!(response.status(), 200);
        support::body_bytes(response).await;
    }
    // Three JSON responses: 7 output tokens each, 10 cached each.
    proxy
        .wait_metric(
            "compactor_upstream_usage_tokens_total",
            &[("kind", "output")],
            21.0,
        )
        .await;
    let cache = proxy
        .metric(
            "compactor_upstream_usage_tokens_total",
            &[("kind", "cache_read")],
        )
        .await;
    assert_eq!(cache, Some(30.0));
    let received = proxy
        .metric(
            "compactor_request_tokens_count",
            &[("dialect", "chat_completions"), ("stage", "received")],
        )
        .await;
    assert_eq!(received, Some(3.0));
    assert_eq!(
        proxy
            .metric(
                "compactor_overhead_seconds_count",
                &[("route", "chat_completions")]
            )
            .await,
        Some(3.0)
    );
    assert_eq!(
        proxy
            .metric("compactor_estimate_error_ratio_count", &[])
            .await,
        Some(3.0)
    );

    // An SSE stream whose last chunk carries usage (stream_options.include_usage).
    mock.set_handler(|_| {
        Reply::sse(&[
            r#"{"choices":[{"index":0,"delta":{"content":"hi"}}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":50,"completion_tokens":5,"total_tokens":55}}"#,
            "[DONE]",
        ])
    });
    let response = client
        .post_json(&proxy.url(CHAT), &conversation("sse", 3, 400))
        .await;
    support::body_bytes(response).await;
    proxy
        .wait_metric(
            "compactor_upstream_usage_tokens_total",
            &[("kind", "output")],
            26.0,
        )
        .await;
}

/// The provider counts twice what compactor estimates: after one observed response, a request
/// at ~70% of the threshold by the raw estimate is over it once calibrated, and compacts.
#[tokio::test]
async fn calibration_moves_the_token_trigger() {
    for calibration in [true, false] {
        let mock = MockUpstream::start().await;
        mock.set_handler(|r| completion_with_usage(r, 2));
        let proxy = TestProxy::start(&proxy_config(&mock, calibration)).await;
        let client = TestClient::http1();
        // Threshold 0.85 × 10,000 = 8,500 tokens; each request is ~6,000 by the raw estimate.
        let first = client
            .post_json(&proxy.url(CHAT), &conversation("first", 6, 4000))
            .await;
        assert_eq!(first.headers()["x-compactor-compacted"], "false");
        // Not compacted: both estimates are the raw estimate of the request, no number.
        let h = first.headers();
        assert_eq!(
            h["x-compactor-tokens-before"],
            h["x-compactor-tokens-after"]
        );
        let raw: usize = h["x-compactor-tokens-before"]
            .to_str()
            .expect("ascii")
            .parse()
            .expect("number");
        assert!((5_000..7_000).contains(&raw), "{raw}");
        assert!(!h.contains_key("x-compactor-compaction-num"));
        support::body_bytes(first).await;
        proxy
            .wait_metric("compactor_estimate_error_ratio_count", &[], 1.0)
            .await;

        let second = client
            .post_json(&proxy.url(CHAT), &conversation("second", 6, 4000))
            .await;
        let compacted = second.headers()["x-compactor-compacted"] == "true";
        assert_eq!(compacted, calibration, "calibration = {calibration}");
        if compacted {
            let h = second.headers();
            let before: usize = h["x-compactor-tokens-before"]
                .to_str()
                .expect("ascii")
                .parse()
                .expect("number");
            let after: usize = h["x-compactor-tokens-after"]
                .to_str()
                .expect("ascii")
                .parse()
                .expect("number");
            assert!(after < before && before > 5_000, "{before} -> {after}");
            assert_eq!(h["x-compactor-compaction-num"], "1");
            assert!(h.contains_key("x-compactor-session"));
            assert_eq!(
                proxy
                    .metric(
                        "compactor_compactions_total",
                        &[("trigger", "tokens"), ("outcome", "compacted")]
                    )
                    .await,
                Some(1.0)
            );
        }
    }
}

/// SDKs ask for gzip, so providers compress JSON: the compressed bytes reach the client
/// unchanged and the usage inside is still counted.
#[tokio::test]
async fn usage_is_read_from_gzip_compressed_responses() {
    use std::io::Write;
    let completion = json!({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 321, "completion_tokens": 9, "total_tokens": 330}
    });
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder
        .write_all(completion.to_string().as_bytes())
        .expect("compress");
    let gzipped = encoder.finish().expect("compress");
    let mock = MockUpstream::start().await;
    let reply = gzipped.clone();
    mock.set_handler(move |_| {
        Reply::bytes(200, "application/json", reply.clone()).with_header("content-encoding", "gzip")
    });
    let proxy = TestProxy::start(&proxy_config(&mock, true)).await;
    let response = TestClient::http1()
        .post_json(&proxy.url(CHAT), &conversation("gzip", 3, 100))
        .await;
    assert_eq!(response.headers()["content-encoding"], "gzip");
    assert_eq!(
        support::body_bytes(response).await.as_ref(),
        gzipped.as_slice()
    );
    proxy
        .wait_metric(
            "compactor_upstream_usage_tokens_total",
            &[("kind", "input")],
            321.0,
        )
        .await;
    assert_eq!(
        proxy
            .metric(
                "compactor_upstream_usage_tokens_total",
                &[("kind", "output")]
            )
            .await,
        Some(9.0)
    );
}

/// A freshly started proxy, before any traffic, already exports every labelled counter for
/// each of its known label values at 0, so dashboards (`config/grafana/compactor.json` queries
/// `compactor_upstream_errors_total` by `kind`) and `rate()` see a series from the start.
#[tokio::test]
async fn a_fresh_proxy_exports_its_labelled_counters_at_zero() {
    let mock = MockUpstream::start().await;
    let proxy = TestProxy::start(&proxy_config(&mock, true)).await;
    let mut expected: Vec<(&str, Vec<(&str, &str)>)> = Vec::new();
    for kind in ["connect", "timeout", "protocol"] {
        expected.push(("compactor_upstream_errors_total", vec![("kind", kind)]));
    }
    for trigger in ["messages", "tokens", "manual"] {
        for outcome in ["compacted", "failed", "blank", "breaker", "panic"] {
            expected.push((
                "compactor_compactions_total",
                vec![("trigger", trigger), ("outcome", outcome)],
            ));
        }
    }
    for outcome in ["panic", "server_state"] {
        expected.push((
            "compactor_compactions_total",
            vec![("trigger", "none"), ("outcome", outcome)],
        ));
    }
    for result in ["hit", "miss"] {
        expected.push((
            "compactor_checkpoint_lookups_total",
            vec![("result", result)],
        ));
    }
    for result in ["ok", "error"] {
        expected.push(("compactor_config_reloads_total", vec![("result", result)]));
    }
    for kind in ["input", "output", "cache_read", "cache_write"] {
        expected.push((
            "compactor_upstream_usage_tokens_total",
            vec![("kind", kind)],
        ));
    }
    for outcome in [
        "ok",
        "fallback_ok",
        "timeout",
        "transport",
        "status",
        "invalid",
        "blank",
        "config",
        "too_large",
    ] {
        expected.push((
            "compactor_summarizer_requests_total",
            vec![("backend", "extractive"), ("outcome", outcome)],
        ));
    }
    for route in ["chat_completions", "messages", "responses"] {
        for class in ["1xx", "2xx", "3xx", "4xx", "5xx"] {
            expected.push((
                "compactor_requests_total",
                vec![
                    ("route", route),
                    ("method", "POST"),
                    ("status_class", class),
                ],
            ));
        }
    }
    for method in [
        "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "other",
    ] {
        expected.push((
            "compactor_requests_total",
            vec![
                ("route", "other"),
                ("method", method),
                ("status_class", "5xx"),
            ],
        ));
    }

    let text = proxy.metrics().await;
    for (name, labels) in &expected {
        assert_eq!(
            support::metric_value(&text, name, labels),
            Some(0.0),
            "{name}{labels:?} is not exported as 0:\n{text}"
        );
    }
    assert!(mock.requests().is_empty(), "no traffic was sent");
}

/// A JSON completion of `model` whose usage reports 100,000 input tokens, 80,000 of them read
/// from the cache, and 2,000 output tokens.
fn billed_completion(model: &str) -> Reply {
    Reply::json(
        200,
        &json!({
            "id": "c", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 100_000, "completion_tokens": 2_000, "total_tokens": 102_000,
                      "prompt_tokens_details": {"cached_tokens": 80_000}}
        }),
    )
}

#[tokio::test]
async fn what_the_provider_billed_is_priced_from_usage_and_unpriced_models_count_nothing() {
    let mock = MockUpstream::start().await;
    mock.set_handler(|r| {
        let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        billed_completion(body["model"].as_str().unwrap_or(""))
    });
    let toml = format!(
        "{}[models.\"priced-model\"]\ncontext_window = 200000\n\
         price = {{ input = 2.0, output = 8.0, cache_read = 0.5 }}\n\
         [models.\"unpriced-model\"]\ncontext_window = 200000\n",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();
    for model in ["unpriced-model", "priced-model"] {
        let mut request = conversation(model, 3, 100);
        request["model"] = json!(model);
        let response = client.post_json(&proxy.url(CHAT), &request).await;
        assert_eq!(response.status(), 200);
        support::body_bytes(response).await;
    }
    // Both responses' usage is read; only the priced model's is billed.
    proxy
        .wait_metric(
            "compactor_upstream_usage_tokens_total",
            &[("kind", "output")],
            4_000.0,
        )
        .await;
    let cost = |kind: &'static str| {
        let proxy = &proxy;
        async move {
            proxy
                .metric(
                    "compactor_cost_usd_total",
                    &[("dialect", "chat_completions"), ("kind", kind)],
                )
                .await
                .unwrap_or_else(|| panic!("compactor_cost_usd_total{{kind={kind}}} is exported"))
        }
    };
    // 20,000 uncached at $2/M, 80,000 cached at $0.5/M, 2,000 output at $8/M, no cache writes
    // (priced at input when written: none were).
    for (kind, usd) in [
        ("input", 0.04),
        ("cache_read", 0.04),
        ("cache_write", 0.0),
        ("output", 0.016),
    ] {
        let got = cost(kind).await;
        assert!((got - usd).abs() < 1e-9, "{kind}: {got} != {usd}");
    }
}

#[tokio::test]
async fn what_the_agents_requests_would_have_cost_without_compactor_is_priced_beside_the_bill() {
    let mock = MockUpstream::start().await;
    // Usage as the mock counts the prompt, no cache fields: what is sent is what is billed.
    mock.set_handler(|r| {
        let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        let prompt = chat_tokens(&body);
        Reply::json(
            200,
            &json!({
                "id": "c", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": 10, "total_tokens": prompt + 10}
            }),
        )
    });
    let toml = format!(
        "{}[compaction]\nbackground_ratio = 0\nmin_preserve_tokens = 100\nmax_preserve_tokens = 300\n\
         [summarizer]\nbackend = \"extractive\"\n\
         [models.\"priced-model\"]\ncontext_window = 200000\nprice = {{ input = 2.0, output = 8.0, cache_read = 0.2 }}\n\
         [models.\"small-priced\"]\ncontext_window = 2000\nprice = {{ input = 2.0, output = 8.0 }}\n",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();
    let send = |model: &'static str, request: Value| {
        let (client, proxy) = (&client, &proxy);
        async move {
            let mut request = request;
            request["model"] = json!(model);
            let response = client.post_json(&proxy.url(CHAT), &request).await;
            assert_eq!(response.status(), 200);
            support::body_bytes(response).await;
        }
    };
    let usd = |name: &'static str, labels: &'static [(&'static str, &'static str)]| {
        let proxy = &proxy;
        async move { proxy.metric(name, labels).await.expect("exported") }
    };
    let billed = || async {
        let mut sum = 0.0;
        for kind in ["input", "cache_read", "cache_write", "output"] {
            sum += proxy
                .metric(
                    "compactor_cost_usd_total",
                    &[("dialect", "chat_completions"), ("kind", kind)],
                )
                .await
                .expect("exported");
        }
        sum
    };
    const WITHOUT: &str = "compactor_cost_without_compactor_usd_total";
    const DIALECT: &[(&str, &str)] = &[("dialect", "chat_completions")];

    // A first request forwarded unchanged, nothing cached: the same either way.
    send("priced-model", conversation("a", 3, 100)).await;
    proxy
        .wait_metric(
            "compactor_upstream_usage_tokens_total",
            &[("kind", "output")],
            10.0,
        )
        .await;
    let (with, without) = (billed().await, usd(WITHOUT, DIALECT).await);
    assert!(
        with > 0.0 && (with - without).abs() < 1e-9,
        "{with} vs {without}"
    );

    // A conversation that grows: without compactor its start would be read from the
    // provider's cache (this mock bills no cache reads): priced lower than what was billed.
    // A new conversation, large enough for a provider to cache its start (1,024 tokens on).
    let mut grown = conversation("c", 3, 6_000);
    let mut messages = grown["messages"].as_array().cloned().unwrap_or_default();
    send("priced-model", grown.clone()).await;
    proxy
        .wait_metric(
            "compactor_upstream_usage_tokens_total",
            &[("kind", "output")],
            20.0,
        )
        .await;
    let (with, without) = (billed().await, usd(WITHOUT, DIALECT).await);
    messages.push(json!({"role": "assistant", "content": "ok"}));
    messages.push(json!({"role": "user", "content": "and the next step?"}));
    grown["messages"] = json!(messages);
    send("priced-model", grown).await;
    proxy
        .wait_metric(
            "compactor_upstream_usage_tokens_total",
            &[("kind", "output")],
            30.0,
        )
        .await;
    let second_with = billed().await - with;
    let second_without = usd(WITHOUT, DIALECT).await - without;
    assert!(
        second_without < second_with,
        "a repeated prefix is a cache read: {second_without} vs {second_with}"
    );

    // A request over its model's window, compacted: without compactor the provider would have
    // refused it, so it is counted and not priced.
    let before = usd(WITHOUT, DIALECT).await;
    send("small-priced", conversation("b", 12, 1_200)).await;
    proxy
        .wait_metric(
            "compactor_upstream_usage_tokens_total",
            &[("kind", "output")],
            40.0,
        )
        .await;
    assert_eq!(
        usd("compactor_over_window_without_compactor_total", DIALECT).await,
        1.0
    );
    assert_eq!(usd(WITHOUT, DIALECT).await, before);

    // The admin API shows the same per conversation: the three sessions' totals add up to
    // the counters (recorded off the response path: read until they arrive).
    let (with, without) = (billed().await, usd(WITHOUT, DIALECT).await);
    let input_tokens = usd(
        "compactor_upstream_usage_tokens_total",
        &[("kind", "input")],
    )
    .await;
    assert!(input_tokens > 0.0);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (status, text) = client.get_text(&proxy.admin_url("/sessions")).await;
        assert_eq!(status, 200);
        let listed: Value = serde_json::from_str(&text).expect("json");
        let sessions = listed["sessions"].as_array().cloned().unwrap_or_default();
        let total = |field: &str| -> f64 {
            sessions
                .iter()
                .map(|s| s["cost"][field].as_f64().unwrap_or(0.0))
                .sum()
        };
        let settled = (total("usd") - with).abs() < 1e-9
            && (total("without_compactor_usd") - without).abs() < 1e-9
            && total("over_window_without_compactor") == 1.0
            && total("input_tokens") == input_tokens;
        if settled {
            assert_eq!(sessions.len(), 3, "{listed}");
            let over: Vec<&Value> = sessions
                .iter()
                .filter(|s| s["cost"]["over_window_without_compactor"] == 1)
                .collect();
            assert_eq!(
                over.len(),
                1,
                "the over-window conversation alone: {listed}"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "sessions' costs {} / {} never reached {with} / {without}: {listed}",
            total("usd"),
            total("without_compactor_usd")
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
