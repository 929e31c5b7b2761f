//! Real agent transcripts replayed step by step through the real proxy against a mock provider
//! that enforces OpenAI's request rules and a small context window
//! (`support::provider_rules`). The same replay sent straight to the mock hits context-length
//! errors; through compactor it never does, no request is rejected, and every rewritten
//! request keeps the system prompt first and a verbatim suffix of what the client sent.
//!
//! Two summarizers: `extractive` (local) and the zero-config `openai` backend, which asks the
//! same mock provider, with the caller's credentials and model, for the summary.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use compactor::compaction::prompt::SUMMARY_INTRO;
use serde_json::{json, Value};

use support::provider_rules::{check_chat, rejection_body, Refusals};
use support::summary_calls::{completion, is_summary_request, received_since, summary_prompt};
use support::{
    transcript, upstream_toml, Exchange, MockUpstream, Recorded, Reply, TestClient, TestProxy,
    TRANSCRIPTS,
};

/// The mock provider's context window, in its own tokens (4 characters each). Three of the four
/// replays outgrow it; the longest ends near 10,750 tokens.
const WINDOW: usize = 4_000;

/// The defaults (a verbatim tail of at least 2,000 tokens) are sized for 128k windows; a
/// 4,000-token window needs a smaller tail, as an operator serving such a model would set.
///
/// Background summaries are off: each step's summarizer calls are attributed to the step that
/// made them, which a summary made off the request path would blur (tests/background_summaries.rs
/// covers those).
const SMALL_TAIL: &str =
    "[compaction]\nmin_preserve_tokens = 500\nmax_preserve_tokens = 1500\nbackground_ratio = 0\n";

/// What the `openai` summarizer's mock provider answers.
const MOCK_SUMMARY: &str = "MOCK-SUMMARY-4471: the agent is working through the task; \
keep going from the latest messages.";

const COMPACTIONS: &str = "compactor_compactions_total";

/// The requests an agent sends while producing `messages`: before each assistant message, a
/// request carrying everything before it.
fn steps(messages: &[Value]) -> Vec<Vec<u8>> {
    messages
        .iter()
        .enumerate()
        .filter(|(i, m)| *i > 0 && m["role"] == "assistant")
        .map(|(i, _)| {
            serde_json::to_vec(&json!({"model": "gpt-4o", "messages": messages[..i]}))
                .expect("serialise")
        })
        .collect()
}

/// What the mock provider refused.
#[derive(Default)]
struct Refused {
    /// Every refusal, by kind.
    rules: Refusals,
    /// Refusals of the summarizer's own requests (counted in `rules` as well).
    summary_requests: AtomicUsize,
}

/// Makes `mock` a strict provider with `window` tokens: summary requests get `summary`, valid
/// chat requests that fit get a completion, anything else the provider's 400.
fn strict_provider(mock: &MockUpstream, window: usize, summary: &'static str) -> Arc<Refused> {
    let refused = Arc::new(Refused::default());
    let r = refused.clone();
    mock.set_handler(move |req: &Recorded| {
        let v = serde_json::from_slice::<Value>(&req.body).unwrap_or(Value::Null);
        let summarizing = summary_prompt(&v).is_some();
        match check_chat(&v, window) {
            Ok(()) if summarizing => Reply::json(200, &completion(summary)),
            Ok(()) => Reply::json(200, &completion("Next step.")),
            Err(rejection) => {
                r.rules.record(&rejection);
                if summarizing {
                    r.summary_requests.fetch_add(1, Ordering::SeqCst);
                }
                Reply::json(400, &rejection_body(&rejection))
            }
        }
    });
    refused
}

async fn post(client: &TestClient, url: &str, auth: &str, body: &[u8]) -> Exchange {
    let headers = [
        ("content-type", "application/json"),
        ("authorization", auth),
    ];
    client
        .exchange("POST", url, &headers, Bytes::copy_from_slice(body))
        .await
}

fn messages_of(body: &[u8]) -> Vec<Value> {
    let v: Value = serde_json::from_slice(body).expect("JSON body");
    v["messages"].as_array().expect("messages").clone()
}

/// Sends every replay straight to the provider; returns its context-length errors per fixture.
async fn replay_direct(mock: &MockUpstream, refusals: &Refusals) -> Vec<(String, usize)> {
    let client = TestClient::http1();
    let url = format!("{}/v1/chat/completions", mock.url());
    let mut per_fixture = Vec::new();
    for name in TRANSCRIPTS {
        let before = refusals.context_length();
        for body in steps(&transcript(name)) {
            let ex = post(&client, &url, "Bearer sk-direct", &body).await;
            assert!(
                ex.status == 200 || ex.status == 400,
                "{name}: {}",
                ex.status
            );
        }
        per_fixture.push((name.to_string(), refusals.context_length() - before));
    }
    assert_eq!(refusals.invalid(), 0, "the fixtures themselves are valid");
    per_fixture
}

/// What a replay through the proxy saw.
#[derive(Default)]
struct Through {
    requests: usize,
    compacted: usize,
    /// Compacted requests that kept the task (the opening) verbatim.
    openings_kept: usize,
    /// Summary requests the provider received, with the Authorization of the client whose
    /// request they compacted.
    summary_requests: Vec<(String, Recorded)>,
    /// `compactor_compactions_total{outcome="failed"}` at the end.
    failed: f64,
}

/// Replays every fixture through `proxy`; checks each forwarded request against what the
/// client sent. `summary_marker` is a string the summary message must contain.
async fn replay_through(proxy: &TestProxy, mock: &MockUpstream, summary_marker: &str) -> Through {
    let client = TestClient::http1();
    let url = proxy.url("/v1/chat/completions");
    let mut through = Through::default();
    for name in TRANSCRIPTS {
        let auth = format!("Bearer sk-replay-{name}");
        for (step, body) in steps(&transcript(name)).into_iter().enumerate() {
            let seen = mock.requests().len();
            let ex = post(&client, &url, &auth, &body).await;
            let what = format!("{name} step {step}");
            if ex.status != 200 {
                let metrics: Vec<String> = proxy
                    .metrics()
                    .await
                    .lines()
                    .filter(|l| l.starts_with(COMPACTIONS))
                    .map(str::to_owned)
                    .collect();
                let last = mock.last_request();
                let sizes: Vec<(String, usize)> = messages_of(&last.body)
                    .iter()
                    .map(|m| (m["role"].to_string(), m.to_string().len()))
                    .collect();
                panic!(
                    "{what}: {} {}\ncompacted: {:?}\n{metrics:#?}\nforwarded: {sizes:?}",
                    ex.status,
                    String::from_utf8_lossy(&ex.body),
                    ex.headers.get("x-compactor-compacted"),
                );
            }
            let v: Value = serde_json::from_slice(&ex.body).expect("completion JSON");
            assert_eq!(
                v["choices"][0]["message"]["content"], "Next step.",
                "{what}"
            );
            through.requests += 1;

            // Everything the provider received for this step: summary requests, then the one
            // forwarded request.
            let (summaries, forwarded) = received_since(mock, seen);
            assert_eq!(forwarded.len(), 1, "{what}: one forwarded request");
            let forwarded = &forwarded[0];
            assert_eq!(forwarded.path(), "/v1/chat/completions", "{what}");
            assert_eq!(forwarded.header("authorization"), Some(auth.as_str()));
            through
                .summary_requests
                .extend(summaries.into_iter().map(|r| (auth.clone(), r)));

            let compacted = ex.header("x-compactor-compacted");
            if forwarded.body == body {
                assert_eq!(compacted, Some("false"), "{what}");
                continue;
            }
            assert_eq!(compacted, Some("true"), "{what}: rewritten");
            through.compacted += 1;
            let sent = messages_of(&body);
            let out = messages_of(&forwarded.body);
            assert_eq!(out[0], sent[0], "{what}: system message kept first");
            // The task (the opening) stays verbatim after it, unless it cannot fit the window
            // beside the tail and is summarised too.
            let head = if out[1] == sent[1] { 2 } else { 1 };
            through.openings_kept += usize::from(head == 2);
            assert_eq!(out[head]["role"], "user", "{what}");
            let summary = out[head]["content"].as_str().expect("summary text");
            assert!(summary.starts_with(SUMMARY_INTRO), "{what}");
            assert!(summary.contains(summary_marker), "{what}: {summary}");
            let tail = &out[head + 1..];
            assert!(!tail.is_empty(), "{what}: a tail is kept");
            assert!(
                tail.len() < sent.len() - head,
                "{what}: something was compacted"
            );
            assert_eq!(
                tail,
                &sent[sent.len() - tail.len()..],
                "{what}: the tail is a verbatim suffix of what the client sent"
            );
        }
    }
    through
}

/// Sum of `compactor_compactions_total` over both automatic triggers for one outcome.
async fn compactions(proxy: &TestProxy, outcome: &str) -> f64 {
    let text = proxy.metrics().await;
    ["messages", "tokens"]
        .iter()
        .map(|t| {
            support::metric_value(&text, COMPACTIONS, &[("trigger", t), ("outcome", outcome)])
                .unwrap_or(0.0)
        })
        .sum()
}

fn proxy_toml(mock: &MockUpstream, summarizer: &str) -> String {
    format!(
        "{}[models.\"gpt-4o\"]\ncontext_window = {WINDOW}\n{SMALL_TAIL}{summarizer}",
        upstream_toml(&mock.url()),
    )
}

/// The direct replay hits the window; the replay through compactor never does.
async fn direct_fails_proxied_fits(summarizer: &str, marker: &str) -> Through {
    let mock = MockUpstream::start().await;
    let refused = strict_provider(&mock, WINDOW, MOCK_SUMMARY);
    let refusals = &refused.rules;

    let direct = replay_direct(&mock, &refused.rules).await;
    let total: usize = direct.iter().map(|(_, n)| n).sum();
    assert!(
        total > 0,
        "the window must bite without compactor: {direct:?}"
    );
    for (name, n) in &direct {
        if name != TRANSCRIPTS[0] {
            assert!(*n > 0, "{name} outgrows the window directly: {direct:?}");
        }
    }

    let (invalid, context) = (refusals.invalid(), refusals.context_length());
    let proxy = TestProxy::start(&proxy_toml(&mock, summarizer)).await;
    let mut through = replay_through(&proxy, &mock, marker).await;
    let reasons = refusals.reasons()[total..].to_vec();
    assert_eq!(refusals.invalid() - invalid, 0, "rejected: {reasons:?}");
    assert_eq!(
        refusals.context_length() - context,
        0,
        "context-length errors: {reasons:?}"
    );
    assert_eq!(refused.summary_requests.load(Ordering::SeqCst), 0);

    assert!(through.compacted > 0, "at least one request was compacted");
    assert!(
        through.openings_kept > 0,
        "some compacted requests keep the task verbatim"
    );
    let counted = compactions(&proxy, "compacted").await;
    assert!(counted > 0.0, "compactions counted");
    assert!(
        counted <= through.compacted as f64,
        "{counted} compactions for {} rewritten requests",
        through.compacted
    );
    // A compaction may still fail (and forward a valid, fitting request); a blank one may not.
    through.failed = compactions(&proxy, "failed").await;
    assert_eq!(compactions(&proxy, "blank").await, 0.0);
    proxy.shutdown().await;
    through
}

#[tokio::test]
async fn replays_fit_the_window_with_the_extractive_summarizer() {
    // The extractive summary's budget follows `summarizer.openai.max_tokens` (the engine's
    // summary budget for every backend): 400 tokens in a 4,000-token window.
    let through = direct_fails_proxied_fits(
        "[summarizer]\nbackend = \"extractive\"\n[summarizer.openai]\nmax_tokens = 400\n",
        "(Summary of compaction #",
    )
    .await;
    assert!(through.summary_requests.is_empty(), "extractive is local");
}

#[tokio::test]
async fn replays_fit_the_window_with_the_zero_config_openai_summarizer() {
    let through = direct_fails_proxied_fits("", MOCK_SUMMARY).await;
    assert_eq!(through.failed, 0.0, "every due compaction happened");
    assert!(
        !through.summary_requests.is_empty(),
        "the provider wrote the summaries"
    );
    for (client_auth, r) in &through.summary_requests {
        assert_eq!(r.path(), "/v1/chat/completions");
        assert_eq!(
            r.header("authorization"),
            Some(client_auth.as_str()),
            "the client's own credentials"
        );
        let v: Value = serde_json::from_slice(&r.body).expect("JSON");
        assert_eq!(v["model"], "gpt-4o", "the client's model");
        assert_eq!(v["stream"], false);
        let prompt = v["messages"][1]["content"].as_str().expect("prompt");
        assert!(prompt.contains("<conversation>"), "{prompt}");
    }
}

/// `n` turns after a short system prompt, alternating user / assistant, 400 characters each
/// (100 tokens for compactor's estimator and the mock alike: the mock counts four characters
/// per token, and this mix of letters, spaces, digits and a comma weighs as much).
fn long_turns(n: usize) -> Vec<Value> {
    let mut m = vec![json!({"role": "system", "content": "Be brief."})];
    for i in 0..n {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        let text: String = format!("{role} turn {i}: ")
            .chars()
            .chain("lorem ipsum dolor sit amet, 42 ".chars().cycle())
            .take(400)
            .collect();
        m.push(json!({"role": role, "content": text}));
    }
    m
}

/// The second compaction of a conversation refines the stored summary. Its rewrite must be
/// judged against what would otherwise be forwarded (the request with the stored summary
/// spliced in), not against the request minus that summary: here the refinement removes
/// ~1,200 tokens from the spliced request, yet is refused as "not smaller" and the oversized
/// spliced request goes upstream instead.
#[tokio::test]
async fn a_refinement_that_shrinks_the_spliced_request_is_used() {
    // Trigger at 0.85 × 3,000 = 2,550 estimated tokens.
    const SMALL_WINDOW: usize = 3_000;
    // ~1,200 tokens: large next to the turns each refinement adds.
    let summary: &'static str = Box::leak(
        "Summary (turns 1-38): the user and the assistant exchanged turns. "
            .repeat(73)
            .into_boxed_str(),
    );
    let mock = MockUpstream::start().await;
    let refused = strict_provider(&mock, SMALL_WINDOW, summary);
    let proxy = TestProxy::start(&format!(
        "{}[models.\"gpt-4o\"]\ncontext_window = {SMALL_WINDOW}\n\
         [compaction]\nmin_preserve_tokens = 200\nmax_preserve_tokens = 200\nbackground_ratio = 0\n\
         [summarizer.openai]\nmax_tokens = 600\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let client = TestClient::http1();
    let url = proxy.url("/v1/chat/completions");
    let all = long_turns(38);

    // 2,600 tokens: the first compaction stores a checkpoint.
    let first = serde_json::to_vec(&json!({"model": "gpt-4o", "messages": all[..27]})).unwrap();
    let ex = post(&client, &url, "Bearer sk-refine", &first).await;
    assert_eq!(ex.status, 200);
    assert_eq!(ex.header("x-compactor-compacted"), Some("true"));
    assert_eq!(compactions(&proxy, "compacted").await, 1.0);

    // Twelve turns later the spliced request (summary + tail + new turns) trips the trigger
    // again; refining the summary over the older of those turns brings it back down.
    let second = serde_json::to_vec(&json!({"model": "gpt-4o", "messages": all[..39]})).unwrap();
    let ex = post(&client, &url, "Bearer sk-refine", &second).await;
    assert_eq!(ex.status, 200, "{}", String::from_utf8_lossy(&ex.body));
    let forwarded = mock
        .requests()
        .into_iter()
        .filter(|r| !is_summary_request(r))
        .last()
        .expect("forwarded");
    let v: Value = serde_json::from_slice(&forwarded.body).expect("JSON");
    let tokens = support::provider_rules::chat_tokens(&v);
    assert_eq!(
        compactions(&proxy, "failed").await,
        0.0,
        "the refinement was refused; {tokens} tokens forwarded"
    );
    assert_eq!(compactions(&proxy, "compacted").await, 2.0);
    assert!(tokens < 2_550, "back under the trigger: {tokens}");
    assert_eq!(refused.rules.context_length() + refused.rules.invalid(), 0);
    proxy.shutdown().await;
}
