//! The summarizer chain as `summarizer::build` assembles it from configuration: fallback
//! order, per-attempt timeouts, the `compactor_summarizer_*` metrics, and logs that never
//! carry credentials. Real sockets (the shared mock upstream) and real processes.

mod support;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use compactor::config::Config;
use compactor::metrics::Metrics;
use compactor::summarizer;
use compactor_plugin_api::{Caller, Entry, Part, Role, SummarizeError, SummaryRequest};
use compactor_plugin_testing::caller;
use serde_json::json;

use support::{metric_value, MockUpstream, Reply};

const REQUESTS: &str = "compactor_summarizer_requests_total";
const DURATION_COUNT: &str = "compactor_summarizer_duration_seconds_count";

fn request(caller: Caller) -> SummaryRequest {
    SummaryRequest {
        in_conversation: None,
        prompt: "<task>Summarize</task><conversation>PROMPT-BODY-7731</conversation>".into(),
        prior_summary: None,
        entries: vec![
            Entry {
                role: Role::User,
                parts: vec![Part::Text {
                    text: "Refactor the config loader".into(),
                }],
            },
            Entry {
                role: Role::Assistant,
                parts: vec![Part::Text {
                    text: "Reading src/config.rs first.".into(),
                }],
            },
        ],
        read_files: vec!["src/config.rs".into()],
        modified_files: vec![],
        instructions: None,
        compaction_num: 1,
        model: Some("gpt-4o-mini".into()),
        max_output_tokens: 2000,
        timeout: Duration::from_secs(20),
        caller,
    }
}

fn setup(toml: &str) -> (Arc<dyn compactor_plugin_api::Summarizer>, Arc<Metrics>) {
    let config = Config::from_toml(toml).expect("config");
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let s = summarizer::build(&config, metrics.clone()).expect("build");
    (s, metrics)
}

fn count(metrics: &Metrics, backend: &str, outcome: &str) -> f64 {
    metric_value(
        &metrics.render(),
        REQUESTS,
        &[("backend", backend), ("outcome", outcome)],
    )
    .unwrap_or(0.0)
}

fn completion(text: &str) -> Reply {
    Reply::json(200, &support::summary_calls::completion(text))
}

#[tokio::test]
async fn a_failing_exec_falls_back_to_extractive() {
    let (s, metrics) = setup(
        "[summarizer]\nbackend = \"exec\"\nfallback = [\"extractive\"]\n\
         [summarizer.exec]\ncommand = \"/bin/sh\"\nargs = [\"-c\", \"cat >/dev/null; exit 1\"]\n",
    );
    let summary = s
        .summarize(&request(Caller::default()))
        .await
        .expect("the fallback answers");
    assert!(
        summary.text.contains("1. Refactor the config loader"),
        "{}",
        summary.text
    );
    assert_eq!(count(&metrics, "exec", "status"), 1.0);
    assert_eq!(count(&metrics, "extractive", "fallback_ok"), 1.0);
    assert_eq!(count(&metrics, "extractive", "ok"), 0.0);
    let text = metrics.render();
    assert_eq!(
        metric_value(&text, DURATION_COUNT, &[("backend", "exec")]),
        Some(1.0)
    );
    assert_eq!(
        metric_value(&text, DURATION_COUNT, &[("backend", "extractive")]),
        Some(1.0)
    );
}

#[tokio::test]
async fn an_openai_500_falls_back_in_order_and_the_primary_counts_ok_when_it_answers() {
    let mock = MockUpstream::start().await;
    mock.push(Reply::status(500));
    mock.push(completion("summary from the model"));
    let (s, metrics) = setup("[summarizer]\nbackend = \"openai\"\nfallback = [\"extractive\"]\n");
    let req = request(caller(&mock.url(), &[("authorization", "Bearer sk-x")]));

    let first = s.summarize(&req).await.expect("fallback answers");
    assert!(
        first.text.contains("1. Primary Request and Intent:"),
        "{}",
        first.text
    );
    assert_eq!(count(&metrics, "openai", "status"), 1.0);
    assert_eq!(count(&metrics, "extractive", "fallback_ok"), 1.0);

    let second = s.summarize(&req).await.expect("primary answers");
    assert_eq!(second.text, "summary from the model");
    assert_eq!(count(&metrics, "openai", "ok"), 1.0);
    assert_eq!(
        count(&metrics, "extractive", "fallback_ok"),
        1.0,
        "not tried again"
    );
    assert_eq!(mock.request_count(), 2);
    assert_eq!(mock.requests()[1].path(), "/v1/chat/completions");
}

#[tokio::test]
async fn each_attempt_is_bounded_by_the_configured_timeout() {
    let mock = MockUpstream::start().await;
    mock.push(Reply::Stall);
    let (s, metrics) = setup(
        "[summarizer]\nbackend = \"openai\"\nfallback = [\"extractive\"]\ntimeout_secs = 0.5\n",
    );
    let started = Instant::now();
    let summary = s
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect("the fallback answers");
    assert!(!summary.text.is_empty());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(count(&metrics, "openai", "timeout"), 1.0);
    assert_eq!(count(&metrics, "extractive", "fallback_ok"), 1.0);
}

#[tokio::test]
async fn when_every_backend_fails_the_last_error_is_returned() {
    let mock = MockUpstream::start().await;
    mock.push(Reply::status(503));
    let (s, metrics) = setup(
        "[summarizer]\nbackend = \"openai\"\nfallback = [\"exec\"]\n\
         [summarizer.exec]\ncommand = \"/bin/sh\"\n\
         args = [\"-c\", \"cat >/dev/null; echo '{\\\"summary\\\": \\\"  \\\"}'\"]\n",
    );
    let err = s
        .summarize(&request(caller(&mock.url(), &[])))
        .await
        .expect_err("all fail");
    assert!(matches!(err, SummarizeError::Blank), "{err:?}");
    assert_eq!(count(&metrics, "openai", "status"), 1.0);
    assert_eq!(count(&metrics, "exec", "blank"), 1.0);
}

/// A `MakeWriter` target: every formatted event lands in one shared buffer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned()
    }
}

#[tokio::test]
async fn failures_are_logged_without_credentials_or_the_prompt() {
    const CALLER_SECRET: &str = "sk-caller-secret-5f0c2e";
    const ENV_SECRET: &str = "sk-env-secret-93ad71";
    const ENV_VAR: &str = "COMPACTOR_TEST_SUMMARIZER_LOG_KEY";
    // The provider echoes the key it was given, as OpenAI's 401 does.
    let mock = MockUpstream::start().await;
    mock.set_handler(|r| {
        let auth = r.header("authorization").unwrap_or_default().to_owned();
        Reply::json(
            401,
            &json!({"error": {"message": format!("Incorrect API key provided: {auth}"),
                              "type": "invalid_request_error"}}),
        )
    });
    // Only this test reads or writes this variable.
    std::env::set_var(ENV_VAR, ENV_SECRET);

    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    // The caller's own credential (zero configuration) ...
    let (s, metrics) = setup("[summarizer]\nbackend = \"openai\"\n");
    let req = request(caller(
        &mock.url(),
        &[("authorization", &format!("Bearer {CALLER_SECRET}"))],
    ));
    let err = s.summarize(&req).await.expect_err("401");
    assert!(
        matches!(err, SummarizeError::Status { status: 401, .. }),
        "{err:?}"
    );
    assert!(!err.to_string().contains(CALLER_SECRET), "{err}");
    // ... and a configured key.
    let (s, _) = setup(&format!(
        "[summarizer]\nbackend = \"openai\"\n[summarizer.openai]\nbase_url = \"{}/v1\"\n\
         api_key_env = \"{ENV_VAR}\"\n",
        mock.url()
    ));
    let err = s.summarize(&req).await.expect_err("401");
    assert!(!err.to_string().contains(ENV_SECRET), "{err}");

    assert_eq!(
        mock.requests()[1].header("authorization"),
        Some(&*format!("Bearer {ENV_SECRET}"))
    );
    assert_eq!(count(&metrics, "openai", "status"), 1.0);
    let text = logs.text();
    assert!(
        text.contains("summarizer failed"),
        "nothing captured: {text}"
    );
    assert!(text.contains("status") && text.contains("openai"), "{text}");
    assert!(text.contains("[redacted]"), "{text}");
    for secret in [CALLER_SECRET, ENV_SECRET, "PROMPT-BODY-7731"] {
        assert!(
            !text.contains(secret),
            "`{secret}` leaked into the logs:\n{text}"
        );
    }
}
