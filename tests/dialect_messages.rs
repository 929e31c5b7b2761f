//! Anthropic Messages through the real proxy: the real agent transcripts converted to the
//! Messages shape (system on top, `tool_use`/`tool_result` blocks, interleaved thinking, cache
//! markers, unknown fields) and replayed step by step against a mock provider that enforces
//! Anthropic's request rules and a small context window (`support::anthropic_rules`). Sent
//! straight to the mock the replay hits context-length errors; through compactor, with the
//! local `extractive` summarizer, it never does and no request is rejected. Every rewritten
//! request keeps every top-level field byte-identical and a verbatim tail, later requests of a
//! conversation reuse the stored summary (stable spliced prefix) until the next compaction,
//! and streamed responses pass through event by event.

mod support;

use std::sync::Arc;

use bytes::Bytes;
use compactor::compaction::prompt::SUMMARY_INTRO;
use serde_json::{json, Value};

use support::anthropic_rules::{
    check_messages, from_chat, raw_elements, rejection_body, top_level_fields,
};
use support::provider_rules::{self, Provider, Refusals, Rejection};
use support::{
    metric_value, transcript, upstream_toml, Exchange, MockUpstream, Reply, SseReader, TestClient,
    TestProxy,
};

/// Each fixture with the model it is replayed as and that model's context window, in the mock
/// provider's tokens (4 characters each): small enough that every session but the first
/// outgrows it (the function-calling ones inside one long tool loop).
const FIXTURES: [(&str, &str, usize); 4] = [
    (
        "swe-agent-function-calling-simple.json",
        "claude-tiny",
        1_800,
    ),
    (
        "swe-agent-marshmallow-function-calling.json",
        "claude-small",
        4_000,
    ),
    ("swe-agent-ctf-katy.json", "claude-test", 8_000),
    ("swe-agent-ctf-web.json", "claude-test", 8_000),
];

/// The model of the SSE and pass-through tests.
const MODEL: &str = "claude-test";

fn window_of(model: &str) -> usize {
    FIXTURES
        .iter()
        .find(|(_, m, _)| *m == model)
        .map_or(0, |(_, _, w)| *w)
}

/// A Claude Code–like request carrying `messages`: system blocks and tools with cache markers,
/// thinking enabled, metadata, and fields compactor knows nothing about.
fn request(model: &str, system: Option<Value>, mut messages: Vec<Value>, stream: bool) -> Vec<u8> {
    // Claude Code marks the end of the conversation for caching.
    if let Some(last) = messages
        .last_mut()
        .and_then(|m| m["content"].as_array_mut())
    {
        if let Some(block) = last.last_mut() {
            block["cache_control"] = json!({"type": "ephemeral"});
        }
    }
    let system_text = system
        .as_ref()
        .and_then(Value::as_str)
        .unwrap_or("You are an agent.");
    serde_json::to_vec(&json!({
        "model": model,
        "max_tokens": 64,
        "system": [
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}}
        ],
        "tools": [
            {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
            {"name": "Read", "description": "Read a file", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
        ],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "metadata": {"user_id": "user_abc_account_def_session_1234"},
        "stream": stream,
        "context_management": {"edits": []},
        "x_future_field": {"nested": [1, "two", null]},
        "messages": messages
    }))
    .expect("serialise")
}

/// The requests an agent sends while producing the fixture: before each assistant message,
/// everything before it.
fn steps(name: &str, model: &str) -> Vec<Vec<u8>> {
    let chat = transcript(name);
    (1..chat.len())
        .filter(|&i| chat[i]["role"] == "assistant")
        .map(|i| {
            let (system, messages) = from_chat(&chat[..i], true);
            request(model, system, messages, false)
        })
        .collect()
}

fn reply(text: &str) -> Value {
    json!({
        "id": "msg_mock", "type": "message", "role": "assistant", "model": MODEL,
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn", "usage": {"input_tokens": 10, "output_tokens": 5}
    })
}

/// Makes `mock` a strict Anthropic provider with the fixtures' models and windows.
fn strict_provider(mock: &MockUpstream) -> Arc<Refusals> {
    fn check(v: &Value) -> Result<(), Rejection> {
        check_messages(v, window_of(v["model"].as_str().unwrap_or("")))
    }
    let anthropic = Provider {
        path: "/v1/messages",
        check,
        rejection_body,
    };
    provider_rules::strict_provider(mock, anthropic, reply("Next step."))
}

async fn post(client: &TestClient, url: &str, key: &str, body: &[u8]) -> Exchange {
    let headers = [
        ("content-type", "application/json"),
        ("x-api-key", key),
        ("anthropic-version", "2023-06-01"),
    ];
    client
        .exchange("POST", url, &headers, Bytes::copy_from_slice(body))
        .await
}

/// The proxy with the fixtures' models (or `MODEL` with `window`) and the local summarizer.
fn proxy_toml(mock: &MockUpstream, window: Option<usize>) -> String {
    let mut toml = upstream_toml(&mock.url());
    match window {
        Some(w) => toml.push_str(&format!("[models.\"{MODEL}\"]\ncontext_window = {w}\n")),
        None => {
            for (_, model, w) in &FIXTURES[..3] {
                toml.push_str(&format!("[models.\"{model}\"]\ncontext_window = {w}\n"));
            }
        }
    }
    // Background summaries off: the replays count summaries against the compacted requests
    // they produced, step by step.
    toml.push_str("[compaction]\nbackground_ratio = 0\n[summarizer]\nbackend = \"extractive\"\n");
    toml
}

async fn metric(proxy: &TestProxy, name: &str, labels: &[(&str, &str)]) -> f64 {
    proxy.metric(name, labels).await.unwrap_or(0.0)
}

/// What one fixture's replay through the proxy showed.
#[derive(Default)]
struct Replay {
    requests: usize,
    compacted: usize,
    /// Compacted requests that kept the task (the opening) verbatim before the summary.
    openings_kept: usize,
    /// (compaction number, the summary text leading the forwarded messages) of every
    /// compacted request, in order.
    spliced: Vec<(u32, String)>,
}

/// Replays one fixture through the proxy, checking every forwarded request against what the
/// client sent.
async fn replay_through(proxy: &TestProxy, mock: &MockUpstream, name: &str, model: &str) -> Replay {
    let client = TestClient::http1();
    let url = proxy.url("/v1/messages");
    let key = format!("sk-ant-replay-{name}");
    let mut replay = Replay::default();
    for (step, body) in steps(name, model).into_iter().enumerate() {
        let what = format!("{name} step {step}");
        let seen = mock.request_count();
        let ex = post(&client, &url, &key, &body).await;
        assert_eq!(
            ex.status,
            200,
            "{what}: {} (compacted: {:?}, tokens {:?} -> {:?}, #{:?})",
            String::from_utf8_lossy(&ex.body),
            ex.header("x-compactor-compacted"),
            ex.header("x-compactor-tokens-before"),
            ex.header("x-compactor-tokens-after"),
            ex.header("x-compactor-compaction-num"),
        );
        let answer: Value = serde_json::from_slice(&ex.body).expect("JSON answer");
        assert_eq!(answer["content"][0]["text"], "Next step.", "{what}");
        replay.requests += 1;

        let received = mock.wait_for_requests(seen + 1).await;
        assert_eq!(received.len(), seen + 1, "{what}: one forwarded request");
        let forwarded = &received[seen];
        assert_eq!(forwarded.path(), "/v1/messages");
        assert_eq!(forwarded.header("x-api-key"), Some(key.as_str()));
        assert_eq!(forwarded.header("anthropic-version"), Some("2023-06-01"));
        if forwarded.body == body {
            assert_eq!(ex.header("x-compactor-compacted"), Some("false"), "{what}");
            continue;
        }
        assert_eq!(ex.header("x-compactor-compacted"), Some("true"), "{what}");
        replay.compacted += 1;

        // Every field but `messages` byte for byte, in order.
        let (sent_fields, out_fields) =
            (top_level_fields(&body), top_level_fields(&forwarded.body));
        assert_eq!(sent_fields.len(), out_fields.len(), "{what}");
        for ((ks, vs), (ko, vo)) in sent_fields.iter().zip(&out_fields) {
            assert_eq!(ks, ko, "{what}: field order");
            if ks != "messages" {
                assert_eq!(vs, vo, "{what}: {ks} untouched");
            }
        }
        // The summary leads; the tail is a verbatim suffix of what the client sent.
        let sent = raw_elements(&body, "messages");
        let out = raw_elements(&forwarded.body, "messages");
        let first: Value = serde_json::from_str(&out[0]).expect("message");
        assert_eq!(first["role"], "user", "{what}");
        // Standalone before an assistant message, or the first block of the kept user
        // message (whose own blocks, cache marker included, may differ from step to step);
        // after the task's blocks when the task (the opening) is kept verbatim.
        let blocks = |m: &Value| match &m["content"] {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b.clone(),
            _ => Vec::new(),
        };
        let opening = blocks(&serde_json::from_str(&sent[0]).expect("message"));
        let first_blocks = blocks(&first);
        let text_at = |i: usize| {
            first_blocks
                .get(i)
                .and_then(|b| b["text"].as_str())
                .unwrap_or_default()
                .to_owned()
        };
        let kept_opening = first_blocks.len() > opening.len()
            && first_blocks[..opening.len()] == opening[..]
            && text_at(opening.len()).starts_with(SUMMARY_INTRO);
        replay.openings_kept += usize::from(kept_opening);
        let at = if kept_opening { opening.len() } else { 0 };
        let summary = text_at(at);
        assert!(summary.starts_with(SUMMARY_INTRO), "{what}");
        assert!(
            summary.contains("(Summary of compaction #"),
            "{what}: {summary}"
        );
        let tail = &out[1..];
        assert_eq!(
            tail,
            &sent[sent.len() - tail.len()..],
            "{what}: verbatim tail"
        );
        let after_summary = &first_blocks[at + 1..];
        if !after_summary.is_empty() {
            // Merged into the first kept user message: its blocks follow the summary as sent.
            let kept: Value =
                serde_json::from_str(&sent[sent.len() - tail.len() - 1]).expect("message");
            assert_eq!(after_summary, &blocks(&kept)[..]);
            assert!(
                tail.len() + 1 < sent.len(),
                "{what}: something was compacted"
            );
        } else {
            assert!(tail.len() < sent.len(), "{what}: something was compacted");
        }
        let last: Value = serde_json::from_str(&out[out.len() - 1]).expect("message");
        let marked = last["content"]
            .as_array()
            .and_then(|b| b.last())
            .map(|b| b["cache_control"].clone());
        assert_eq!(
            marked,
            Some(json!({"type": "ephemeral"})),
            "{what}: cache marker kept"
        );
        let num = ex.compaction_num().expect("compaction number");
        replay.spliced.push((num, summary));
    }
    replay
}

#[tokio::test]
async fn replays_fit_the_window_and_reuse_their_summaries() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("compactor=debug")
        .with_test_writer()
        .try_init();
    let mock = MockUpstream::start().await;
    let refusals = strict_provider(&mock);

    // Straight to the provider: the window bites.
    let client = TestClient::http1();
    let direct_url = format!("{}/v1/messages", mock.url());
    for (name, model, _) in FIXTURES {
        for body in steps(name, model) {
            let ex = post(&client, &direct_url, "sk-direct", &body).await;
            assert!(
                ex.status == 200 || ex.status == 400,
                "{name}: {}",
                ex.status
            );
        }
    }
    let direct_errors = refusals.context_length();
    assert!(direct_errors > 0, "the window must bite without compactor");
    assert_eq!(
        refusals.invalid(),
        0,
        "the converted fixtures are valid: {:?}",
        refusals.reasons()
    );

    // Through compactor: never.
    let proxy = TestProxy::start(&proxy_toml(&mock, None)).await;
    let mut total = Replay::default();
    let mut max_num = 0;
    for (name, model, _) in FIXTURES {
        let replay = replay_through(&proxy, &mock, name, model).await;
        if name != FIXTURES[0].0 {
            assert!(replay.compacted > 0, "{name} was compacted");
        }
        // Session memory: numbers only grow, and between two compactions every request sends
        // the same spliced summary message (the provider's prompt cache keeps hitting).
        for pair in replay.spliced.windows(2) {
            let ((a, summary_a), (b, summary_b)) = (&pair[0], &pair[1]);
            assert!(b >= a, "{name}: compaction numbers go up: {a} then {b}");
            if a == b {
                assert_eq!(
                    summary_a, summary_b,
                    "{name}: stable spliced summary for #{a}"
                );
            }
        }
        max_num = max_num.max(replay.spliced.iter().map(|s| s.0).max().unwrap_or(0));
        total.requests += replay.requests;
        total.compacted += replay.compacted;
        total.openings_kept += replay.openings_kept;
    }
    let refused = refusals.reasons()[direct_errors..].to_vec();
    assert_eq!(refusals.invalid(), 0, "rejected: {refused:?}");
    assert_eq!(
        refusals.context_length(),
        direct_errors,
        "context-length errors through compactor: {refused:?}"
    );

    assert!(total.compacted > 0, "compaction happened");
    assert!(
        total.openings_kept > 0,
        "some compactions keep the task verbatim"
    );
    assert!(
        max_num >= 2,
        "later compactions refine earlier ones (reached #{max_num})"
    );
    let compactions: f64 = {
        let text = proxy.metrics().await;
        ["messages", "tokens"]
            .iter()
            .map(|t| {
                metric_value(
                    &text,
                    "compactor_compactions_total",
                    &[("trigger", t), ("outcome", "compacted")],
                )
                .unwrap_or(0.0)
            })
            .sum()
    };
    assert!(compactions >= 1.0);
    assert!(
        compactions < total.compacted as f64,
        "{compactions} compactions for {} compacted requests: the rest reused a summary",
        total.compacted
    );
    let summarizer_calls = metric(
        &proxy,
        "compactor_summarizer_requests_total",
        &[("backend", "extractive"), ("outcome", "ok")],
    )
    .await;
    assert!(
        summarizer_calls < total.compacted as f64,
        "{summarizer_calls} summaries for {} compacted requests",
        total.compacted
    );
    // (A late compaction of the longest session may fail once the extractive summary, which
    // carries every prior summary forward, outgrows the summarizer's half of this tiny
    // window: the request then goes out with the stored summary, which still fits.)
    for trigger in ["messages", "tokens"] {
        assert_eq!(
            metric(
                &proxy,
                "compactor_compactions_total",
                &[("trigger", trigger), ("outcome", "blank")]
            )
            .await,
            0.0,
            "{trigger}/blank"
        );
    }
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_compacted_stream_passes_through_event_by_event() {
    let mock = MockUpstream::start().await;
    // A window the marshmallow session outgrows at its last step.
    let proxy = TestProxy::start(&proxy_toml(&mock, Some(2_000))).await;
    let chat = transcript(FIXTURES[1].0);
    let (system, messages) = from_chat(&chat[..chat.len() - 1], true);
    let body = request(MODEL, system, messages, true);

    let events = [
        (
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": MODEL}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        ("ping", json!({"type": "ping"})),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ];
    let event = |(name, data): &(&str, Value)| format!("event: {name}\ndata: {data}");

    let (reply, sse) = Reply::sse_channel();
    mock.push(reply);
    let client = TestClient::http1();
    // compactor holds the stream (its head too) until the first content event, in case the
    // provider refuses the request for its length first: the preamble goes out with it.
    let url = proxy.url("/v1/messages");
    let (response, ()) = tokio::join!(
        client.request(
            "POST",
            &url,
            &[
                ("content-type", "application/json"),
                ("x-api-key", "sk-stream"),
            ],
            Bytes::from(body.clone()),
        ),
        async {
            for e in &events[..2] {
                sse.send(format!("{}\n\n", event(e)))
                    .await
                    .expect("proxy still reading");
            }
        }
    );
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert_eq!(response.headers()["x-compactor-compacted"], "true");
    let forwarded = mock.last_request();
    assert_ne!(forwarded.body, body, "the request was rewritten");
    let v: Value = serde_json::from_slice(&forwarded.body).expect("JSON");
    assert_eq!(check_messages(&v, usize::MAX), Ok(()));
    assert_eq!(v["stream"], true);

    let mut reader = SseReader::new(response);
    for e in &events[..2] {
        assert_eq!(reader.next_event().await, Some(event(e)));
    }
    // From then on, each event reaches the client before the next is written.
    for e in &events[2..] {
        sse.send(format!("{}\n\n", event(e)))
            .await
            .expect("proxy still reading");
        assert_eq!(reader.next_event().await, Some(event(e)));
    }
    sse.finish();
    assert_eq!(
        reader.next_event().await,
        None,
        "the stream ends with the upstream's"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn requests_it_does_not_understand_pass_through_byte_identical() {
    let mock = MockUpstream::start().await;
    let proxy = TestProxy::start(&proxy_toml(&mock, Some(1_000))).await;
    let client = TestClient::http1();
    // Too big for the window, but not a Messages request (a `tool` role in `messages`).
    let odd = serde_json::to_vec(&json!({
        "model": MODEL, "max_tokens": 10,
        "messages": [{"role": "tool", "content": "x".repeat(8_000)}, {"role": "user", "content": "hi"}]
    }))
    .expect("serialise");
    mock.push(Reply::json(200, &reply("ok")));
    let ex = post(&client, &proxy.url("/v1/messages"), "sk-odd", &odd).await;
    assert_eq!(ex.status, 200);
    assert_eq!(ex.header("x-compactor-compacted"), Some("false"));
    assert_eq!(mock.last_request().body, Bytes::from(odd));
    proxy.shutdown().await;
}
