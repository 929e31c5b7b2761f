//! Background summaries, through the real proxy: a conversation past the soft watermark
//! (`compaction.background_ratio` of the trigger) goes upstream at once while its summary is
//! made off the request path; the request that later crosses the trigger splices it without
//! waiting, or goes on as it is while it is still being made (never starting a second; one
//! too close to the window waits for it, see the pipeline's tests); a history edited
//! meanwhile throws the background result away.

mod support;

use std::sync::Arc;

use bytes::Bytes;
use serde_json::{json, Value};
use support::summary_calls::{completion, summary_prompt, Summaries};
use support::{upstream_toml, Exchange, MockUpstream, Recorded, Reply, TestClient, TestProxy};

/// Compact above 10 messages, so the watermark (0.7) is above 7; summaries from the mock.
fn config(mock: &MockUpstream) -> String {
    format!(
        "{}[compaction]\nmax_messages = 10\nbackground_ratio = 0.7\nmin_preserve_tokens = 20\n\
         max_preserve_tokens = 200\n\
         [summarizer]\nbackend = \"openai\"\nmax_concurrent = 1\n",
        upstream_toml(&mock.url())
    )
}

/// A provider whose summaries (`SUMMARY-<n>`) are held until the test releases them.
#[derive(Default)]
struct Provider {
    summarizer: Summaries,
}

impl Provider {
    async fn start() -> (MockUpstream, Arc<Provider>) {
        let mock = MockUpstream::start().await;
        let provider = Arc::new(Provider::default());
        provider.summarizer.hold();
        let p = provider.clone();
        mock.set_handler(move |r| p.answer(r));
        (mock, provider)
    }

    fn answer(&self, r: &Recorded) -> Reply {
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        if summary_prompt(&v).is_none() {
            return Reply::json(200, &completion("Next step."));
        }
        self.summarizer.answer(completion)
    }

    fn summaries(&self) -> usize {
        self.summarizer.count()
    }

    /// Sends every held summary.
    async fn release(&self) {
        self.summarizer.release().await;
    }
}

/// A system message and `n - 1` alternating turns; `edit` changes turn 2's words.
fn conversation(n: usize, edit: bool) -> Vec<Value> {
    let mut m = vec![json!({"role": "system", "content": "You are a careful assistant."})];
    for i in 1..n {
        let role = if i % 2 == 1 { "user" } else { "assistant" };
        let words = if edit && i == 2 {
            "edited words"
        } else {
            "words"
        };
        m.push(json!({"role": role, "content": format!("turn {i}: {}", words.repeat(20))}));
    }
    m
}

async fn send(proxy: &TestProxy, messages: &[Value]) -> Exchange {
    TestClient::http1()
        .exchange(
            "POST",
            &proxy.url("/v1/chat/completions"),
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer sk-background"),
                ("x-session-id", "conversation-1"),
            ],
            Bytes::from(json!({"model": "gpt-4o", "messages": messages}).to_string()),
        )
        .await
}

/// The agent's chat requests the mock received (summaries left out).
fn chats(mock: &MockUpstream) -> Vec<Value> {
    mock.requests()
        .iter()
        .filter_map(|r| serde_json::from_slice::<Value>(&r.body).ok())
        .filter(|v| summary_prompt(v).is_none())
        .collect()
}

fn text_of(v: &Value) -> String {
    v["messages"].to_string()
}

async fn metric(proxy: &TestProxy, name: &str, labels: &[(&str, &str)]) -> f64 {
    proxy.metric(name, labels).await.unwrap_or(-1.0)
}

/// Waits until the mock has received `n` summarizer calls.
async fn summary_requested(mock: &MockUpstream, provider: &Provider, n: usize) {
    while provider.summaries() < n {
        let seen = mock.request_count();
        mock.wait_for_requests(seen + 1).await;
    }
}

#[tokio::test]
async fn a_summary_made_in_the_background_is_spliced_without_waiting() {
    let (mock, provider) = Provider::start().await;
    let proxy = TestProxy::start(&config(&mock)).await;

    // Past the watermark (9 > 7), under the trigger: forwarded as sent, while the summary is
    // still being made (it is held).
    let early = conversation(9, false);
    let got = send(&proxy, &early).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    assert_eq!(
        chats(&mock).last().map(text_of),
        Some(json!(early).to_string())
    );
    summary_requested(&mock, &provider, 1).await;
    provider.release().await;
    proxy
        .wait_metric(
            "compactor_background_compactions_total",
            &[("outcome", "stored")],
            1.0,
        )
        .await;

    // Still under the trigger: the staged summary is not spliced yet (the provider's cache of
    // this prefix keeps hitting).
    let growing = conversation(10, false);
    let got = send(&proxy, &growing).await;
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    assert_eq!(
        chats(&mock).last().map(text_of),
        Some(json!(growing).to_string())
    );

    // Crossing the trigger (11 > 10): spliced at once, no second summary.
    let crossing = conversation(11, false);
    let got = send(&proxy, &crossing).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("x-compactor-compacted"), Some("true"));
    assert_eq!(got.header("x-compactor-compaction-num"), Some("1"));
    let forwarded = chats(&mock).last().cloned().expect("forwarded");
    assert!(text_of(&forwarded).contains("SUMMARY-1"), "{forwarded}");
    let kept = forwarded["messages"].as_array().map_or(0, Vec::len);
    assert!(kept <= 10, "under the trigger after the splice: {kept}");
    assert_eq!(
        forwarded["messages"].as_array().and_then(|m| m.last()),
        crossing.last(),
        "latest turn verbatim"
    );
    assert_eq!(provider.summaries(), 1);
    assert_eq!(
        metric(
            &proxy,
            "compactor_summarizer_wait_seconds_bucket",
            &[("le", "0.001")]
        )
        .await,
        1.0,
        "the crossing request waited for no summary"
    );

    // Promoted: the next request splices it too (whatever its size), and it was one
    // compaction. (The next stage's summary may be under way in the background already.)
    let got = send(&proxy, &conversation(12, false)).await;
    assert_eq!(got.header("x-compactor-compaction-num"), Some("1"));
    let forwarded = chats(&mock).last().cloned().expect("forwarded");
    assert!(text_of(&forwarded).contains("SUMMARY-1"), "{forwarded}");
    assert_eq!(
        metric(
            &proxy,
            "compactor_compactions_total",
            &[("trigger", "messages"), ("outcome", "compacted")]
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn a_request_crossing_the_trigger_while_the_summary_is_made_goes_on_and_a_later_one_splices_it(
) {
    let (mock, provider) = Provider::start().await;
    let proxy = TestProxy::start(&config(&mock)).await;
    let got = send(&proxy, &conversation(9, false)).await;
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    summary_requested(&mock, &provider, 1).await;

    // Over the trigger (11 > 10 messages) while the summary is held, but far below the
    // window: the request goes upstream as it is, without waiting and without a second
    // summary (this call returns while the summary is still held).
    let got = send(&proxy, &conversation(11, false)).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    assert_eq!(chats(&mock).len(), 2);
    assert_eq!(
        metric(&proxy, "compactor_compactions_deferred_total", &[]).await,
        1.0
    );
    assert_eq!(provider.summaries(), 1);

    provider.release().await;
    proxy
        .wait_metric(
            "compactor_background_compactions_total",
            &[("outcome", "stored")],
            1.0,
        )
        .await;
    let got = send(&proxy, &conversation(12, false)).await;
    assert_eq!(got.header("x-compactor-compacted"), Some("true"));
    let forwarded = chats(&mock).last().cloned().expect("forwarded");
    assert!(text_of(&forwarded).contains("SUMMARY-1"), "{forwarded}");
    assert_eq!(provider.summaries(), 1, "one summary for one compaction");
}

#[tokio::test]
async fn an_edited_history_discards_the_background_summary() {
    let (mock, provider) = Provider::start().await;
    let proxy = TestProxy::start(&config(&mock)).await;
    send(&proxy, &conversation(9, false)).await;
    summary_requested(&mock, &provider, 1).await;

    // The person edits an early turn while the summary is being made.
    let got = send(&proxy, &conversation(9, true)).await;
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    provider.release().await;
    proxy
        .wait_metric(
            "compactor_background_compactions_total",
            &[("outcome", "discarded")],
            1.0,
        )
        .await;

    // The edited conversation crossing the trigger gets a summary of its own history.
    let summaries = provider.summaries();
    let crossing = conversation(11, true);
    let p = send(&proxy, &crossing);
    let (got, ()) = tokio::join!(p, async {
        summary_requested(&mock, &provider, summaries + 1).await;
        provider.release().await;
    });
    assert_eq!(got.status, 200);
    assert_eq!(got.header("x-compactor-compacted"), Some("true"));
    let forwarded = text_of(&chats(&mock).last().cloned().expect("forwarded"));
    assert!(!forwarded.contains("SUMMARY-1"), "discarded: {forwarded}");
    assert!(
        forwarded.contains(&format!("SUMMARY-{}", summaries + 1)),
        "{forwarded}"
    );
}

#[tokio::test]
async fn beyond_max_concurrent_a_background_summary_is_not_started() {
    let (mock, provider) = Provider::start().await;
    let proxy = TestProxy::start(&config(&mock)).await;
    send(&proxy, &conversation(9, false)).await;
    summary_requested(&mock, &provider, 1).await;

    // Another conversation past the watermark while the only slot is taken.
    let other: Vec<Value> = conversation(9, false)
        .into_iter()
        .map(|mut m| {
            if let Some(text) = m["content"].as_str() {
                m["content"] = json!(format!("other {text}"));
            }
            m
        })
        .collect();
    let got = TestClient::http1()
        .exchange(
            "POST",
            &proxy.url("/v1/chat/completions"),
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer sk-background"),
                ("x-session-id", "conversation-2"),
            ],
            Bytes::from(json!({"model": "gpt-4o", "messages": other}).to_string()),
        )
        .await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("x-compactor-compacted"), Some("false"));
    assert_eq!(
        metric(
            &proxy,
            "compactor_background_compactions_total",
            &[("outcome", "busy")]
        )
        .await,
        1.0
    );
    assert_eq!(provider.summaries(), 1);
    provider.release().await;
}

/// The sum of a histogram's `_sum` samples whose labels include `labels`.
fn histogram_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let sum = format!("{name}_sum");
    text.lines()
        .filter_map(support::metrics::parse_sample_line)
        .filter(|(n, l, _)| {
            *n == sum
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| v)
        .sum()
}

#[tokio::test]
async fn tokens_saved_is_received_minus_forwarded_whatever_made_the_request_smaller() {
    // Summaries answered at once; background summaries on (the default), `hybrid` masking
    // (the default) has no tool outputs to mask here, so what makes requests smaller is a
    // summary made ahead, spliced from the store on the requests after it.
    let mock = MockUpstream::start().await;
    let provider = Arc::new(Provider::default());
    let p = provider.clone();
    mock.set_handler(move |r| p.answer(r));
    let proxy = TestProxy::start(&config(&mock)).await;
    let full = conversation(30, false);
    for n in (3..=full.len()).step_by(2) {
        let got = send(&proxy, &full[..n]).await;
        assert_eq!(got.status, 200);
        proxy
            .wait_metric("compactor_background_compactions_running", &[], 0.0)
            .await;
    }
    let text = proxy.metrics().await;
    let tokens = "compactor_request_tokens";
    let received = histogram_sum(&text, tokens, &[("stage", "received")]);
    let forwarded = histogram_sum(&text, tokens, &[("stage", "forwarded")]);
    let saved = support::metric_value(&text, "compactor_tokens_saved_total", &[])
        .expect("compactor_tokens_saved_total exported");
    assert!(
        metric(
            &proxy,
            "compactor_background_compactions_total",
            &[("outcome", "stored")]
        )
        .await
            >= 1.0,
        "a summary was made ahead"
    );
    assert!(saved > 0.0);
    assert_eq!(
        saved,
        received - forwarded,
        "every token not forwarded is counted saved"
    );
    proxy.shutdown().await;
}
