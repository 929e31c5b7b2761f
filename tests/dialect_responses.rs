//! OpenAI Responses through the real proxy: the real agent transcripts converted to Codex-like
//! `input` items (`reasoning`, `function_call`, `function_call_output`, output messages) and
//! replayed step by step against a mock provider that enforces the Responses rules and a small
//! context window (`support::responses_rules`). Sent straight to the mock the replay hits
//! context-length errors; through compactor, with the local `extractive` summarizer, it never
//! does and no request is rejected. Every rewritten request keeps `instructions` and every
//! other field byte-identical and a verbatim tail; later requests reuse the stored summary.
//! A request whose history lives on OpenAI's side (`previous_response_id`) passes through
//! byte-identical and is counted as `server_state`; streamed responses pass through event by
//! event.

mod support;

use std::sync::Arc;

use bytes::Bytes;
use compactor::compaction::prompt::SUMMARY_INTRO;
use serde_json::{json, Value};

use support::anthropic_rules::{raw_elements, top_level_fields};
use support::provider_rules::{self, Provider, Refusals, Rejection};
use support::responses_rules::{check_responses, from_chat, rejection_body};
use support::{
    metric_value, transcript, upstream_toml, Exchange, MockUpstream, Reply, SseReader, TestClient,
    TestProxy,
};

/// Each fixture with the model it is replayed as and that model's window (mock tokens).
const FIXTURES: [(&str, &str, usize); 4] = [
    (
        "swe-agent-function-calling-simple.json",
        "codex-test-tiny",
        1_800,
    ),
    (
        "swe-agent-marshmallow-function-calling.json",
        "codex-test-small",
        4_000,
    ),
    ("swe-agent-ctf-katy.json", "codex-test", 8_000),
    ("swe-agent-ctf-web.json", "codex-test", 8_000),
];

/// The model of the single-request tests.
const MODEL: &str = "codex-test";

fn window_of(model: &str) -> usize {
    FIXTURES
        .iter()
        .find(|(_, m, _)| *m == model)
        .map_or(0, |(_, _, w)| *w)
}

/// A Codex-like stateless request: instructions, tools, reasoning settings, encrypted
/// reasoning carried in `input`, and fields compactor knows nothing about.
fn request(model: &str, instructions: Option<Value>, input: Vec<Value>, stream: bool) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": model,
        "instructions": instructions.unwrap_or_else(|| json!("You are Codex.")),
        "input": input,
        "tools": [{"type": "function", "name": "shell", "description": "Run a command",
                   "parameters": {"type": "object", "properties": {"command": {"type": "array"}}}}],
        "tool_choice": "auto",
        "parallel_tool_calls": true,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": false,
        "include": ["reasoning.encrypted_content"],
        "max_output_tokens": 64,
        "prompt_cache_key": "0199-session-key",
        "stream": stream,
        "x_future_field": {"nested": [1, "two", null]}
    }))
    .expect("serialise")
}

fn steps(name: &str, model: &str) -> Vec<Vec<u8>> {
    let chat = transcript(name);
    (1..chat.len())
        .filter(|&i| chat[i]["role"] == "assistant")
        .map(|i| {
            let (instructions, input) = from_chat(&chat[..i]);
            request(model, instructions, input, false)
        })
        .collect()
}

fn response(text: &str) -> Value {
    json!({
        "id": "resp_mock", "object": "response", "status": "completed", "model": MODEL,
        "output": [{"type": "message", "id": "msg_mock", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}
    })
}

/// Makes `mock` a strict Responses provider with the fixtures' models and windows.
fn strict_provider(mock: &MockUpstream) -> Arc<Refusals> {
    fn check(v: &Value) -> Result<(), Rejection> {
        check_responses(v, window_of(v["model"].as_str().unwrap_or("")))
    }
    let openai = Provider {
        path: "/v1/responses",
        check,
        rejection_body,
    };
    provider_rules::strict_provider(mock, openai, response("Next step."))
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

#[derive(Default)]
struct Replay {
    compacted: usize,
    /// Compacted requests that kept a head (instructions, the task) before the summary.
    openings_kept: usize,
    /// (compaction number, the summary item) of every compacted request, in order.
    spliced: Vec<(u32, String)>,
}

async fn replay_through(proxy: &TestProxy, mock: &MockUpstream, name: &str, model: &str) -> Replay {
    let client = TestClient::http1();
    let url = proxy.url("/v1/responses");
    let auth = format!("Bearer sk-replay-{name}");
    let mut replay = Replay::default();
    for (step, body) in steps(name, model).into_iter().enumerate() {
        let what = format!("{name} step {step}");
        let seen = mock.request_count();
        let ex = post(&client, &url, &auth, &body).await;
        assert_eq!(
            ex.status,
            200,
            "{what}: {} (compacted: {:?}, tokens {:?} -> {:?})",
            String::from_utf8_lossy(&ex.body),
            ex.header("x-compactor-compacted"),
            ex.header("x-compactor-tokens-before"),
            ex.header("x-compactor-tokens-after"),
        );
        let answer: Value = serde_json::from_slice(&ex.body).expect("JSON answer");
        assert_eq!(
            answer["output"][0]["content"][0]["text"], "Next step.",
            "{what}"
        );

        let received = mock.wait_for_requests(seen + 1).await;
        assert_eq!(received.len(), seen + 1, "{what}: one forwarded request");
        let forwarded = &received[seen];
        assert_eq!(forwarded.path(), "/v1/responses");
        assert_eq!(forwarded.header("authorization"), Some(auth.as_str()));
        if forwarded.body == body {
            assert_eq!(ex.header("x-compactor-compacted"), Some("false"), "{what}");
            continue;
        }
        assert_eq!(ex.header("x-compactor-compacted"), Some("true"), "{what}");
        replay.compacted += 1;

        let (sent_fields, out_fields) =
            (top_level_fields(&body), top_level_fields(&forwarded.body));
        assert_eq!(sent_fields.len(), out_fields.len(), "{what}");
        for ((ks, vs), (ko, vo)) in sent_fields.iter().zip(&out_fields) {
            assert_eq!(ks, ko, "{what}: field order");
            if ks != "input" {
                assert_eq!(vs, vo, "{what}: {ks} untouched");
            }
        }
        let sent = raw_elements(&body, "input");
        let out = raw_elements(&forwarded.body, "input");
        // The instructions and the task (the opening) are kept verbatim before the summary
        // when they fit.
        let head = out
            .iter()
            .position(|item| item.contains(SUMMARY_INTRO))
            .expect("a summary item");
        assert_eq!(out[..head], sent[..head], "{what}: the head verbatim");
        replay.openings_kept += usize::from(head > 0);
        let summary: Value = serde_json::from_str(&out[head]).expect("item");
        assert_eq!(summary["type"], "message", "{what}");
        assert_eq!(summary["role"], "user", "{what}");
        assert_eq!(summary["content"][0]["type"], "input_text", "{what}");
        let text = summary["content"][0]["text"]
            .as_str()
            .expect("summary text");
        assert!(text.starts_with(SUMMARY_INTRO), "{what}");
        let tail = &out[head + 1..];
        assert!(!tail.is_empty() && tail.len() < sent.len() - head, "{what}");
        assert_eq!(
            tail,
            &sent[sent.len() - tail.len()..],
            "{what}: verbatim tail"
        );
        let num = ex.compaction_num().expect("compaction number");
        replay.spliced.push((num, out[head].clone()));
    }
    replay
}

#[tokio::test]
async fn replays_fit_the_window_and_reuse_their_summaries() {
    let mock = MockUpstream::start().await;
    let refusals = strict_provider(&mock);

    let client = TestClient::http1();
    let direct_url = format!("{}/v1/responses", mock.url());
    for (name, model, _) in FIXTURES {
        for body in steps(name, model) {
            let ex = post(&client, &direct_url, "Bearer sk-direct", &body).await;
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

    let proxy = TestProxy::start(&proxy_toml(&mock, None)).await;
    let (mut compacted, mut max_num, mut openings_kept) = (0, 0, 0);
    for (name, model, _) in FIXTURES {
        let replay = replay_through(&proxy, &mock, name, model).await;
        if name != FIXTURES[0].0 {
            assert!(replay.compacted > 0, "{name} was compacted");
        }
        for pair in replay.spliced.windows(2) {
            let ((a, item_a), (b, item_b)) = (&pair[0], &pair[1]);
            assert!(b >= a, "{name}: compaction numbers go up: {a} then {b}");
            if a == b {
                assert_eq!(item_a, item_b, "{name}: stable spliced summary for #{a}");
            }
        }
        max_num = max_num.max(replay.spliced.iter().map(|s| s.0).max().unwrap_or(0));
        compacted += replay.compacted;
        openings_kept += replay.openings_kept;
    }
    assert!(openings_kept > 0, "some compactions keep the task verbatim");
    let refused = refusals.reasons()[direct_errors..].to_vec();
    assert_eq!(refusals.invalid(), 0, "rejected: {refused:?}");
    assert_eq!(
        refusals.context_length(),
        direct_errors,
        "context-length errors through compactor: {refused:?}"
    );
    assert!(
        max_num >= 2,
        "later compactions refine earlier ones (reached #{max_num})"
    );
    let text = proxy.metrics().await;
    let compactions: f64 = ["messages", "tokens"]
        .iter()
        .map(|t| {
            metric_value(
                &text,
                "compactor_compactions_total",
                &[("trigger", t), ("outcome", "compacted")],
            )
            .unwrap_or(0.0)
        })
        .sum();
    assert!(compactions >= 1.0);
    assert!(
        compactions < compacted as f64,
        "{compactions} compactions for {compacted} compacted requests: the rest reused a summary"
    );
    let summarizer_calls = metric_value(
        &text,
        "compactor_summarizer_requests_total",
        &[("backend", "extractive"), ("outcome", "ok")],
    )
    .unwrap_or(0.0);
    assert!(
        summarizer_calls < compacted as f64,
        "{summarizer_calls} summaries for {compacted} compacted requests"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn server_held_conversations_pass_through_byte_identical() {
    // The whole history held by OpenAI.
    server_held_passes_through(|v| v["previous_response_id"] = json!("resp_0123456789")).await;
    // The AI SDK with `store` on: every earlier output of the model sent as a reference to the
    // item OpenAI stored. A summary could not hold what they stand for, and an output whose
    // call is a reference could not be paired with it.
    server_held_passes_through(|v| {
        v["store"] = json!(true);
        for item in v["input"].as_array_mut().expect("input") {
            let stored = item["role"] == "assistant"
                || matches!(item["type"].as_str(), Some("reasoning" | "function_call"));
            if stored {
                let id = item["id"].clone();
                *item = json!({"type": "item_reference", "id": id});
            }
        }
    })
    .await;
}

async fn server_held_passes_through(hold: impl FnOnce(&mut Value)) {
    let mock = MockUpstream::start().await;
    let proxy = TestProxy::start(&proxy_toml(&mock, Some(1_000))).await;
    let client = TestClient::http1();
    // Far over the window, but the history is OpenAI's: nothing to compact here.
    let chat = transcript(FIXTURES[3].0);
    let (instructions, input) = from_chat(&chat);
    let mut v: Value =
        serde_json::from_slice(&request(MODEL, instructions, input, false)).expect("JSON");
    hold(&mut v);
    let body = serde_json::to_vec(&v).expect("serialise");
    mock.push(Reply::json(200, &response("ok")));
    let ex = post(
        &client,
        &proxy.url("/v1/responses"),
        "Bearer sk-state",
        &body,
    )
    .await;
    assert_eq!(ex.status, 200);
    assert_eq!(ex.header("x-compactor-compacted"), Some("false"));
    assert_eq!(mock.last_request().body, Bytes::from(body));
    assert_eq!(
        metric(
            &proxy,
            "compactor_compactions_total",
            &[("trigger", "none"), ("outcome", "server_state")]
        )
        .await,
        1.0
    );
    for trigger in ["messages", "tokens"] {
        assert_eq!(
            metric(
                &proxy,
                "compactor_compactions_total",
                &[("trigger", trigger), ("outcome", "compacted")]
            )
            .await,
            0.0
        );
    }
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_compacted_stream_passes_through_event_by_event() {
    let mock = MockUpstream::start().await;
    let proxy = TestProxy::start(&proxy_toml(&mock, Some(2_000))).await;
    let chat = transcript(FIXTURES[1].0);
    let (instructions, input) = from_chat(&chat[..chat.len() - 1]);
    let body = request(MODEL, instructions, input, true);

    let events = [
        (
            "response.created",
            json!({"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1", "status": "in_progress"}}),
        ),
        (
            "response.output_item.added",
            json!({"type": "response.output_item.added", "sequence_number": 1, "output_index": 0, "item": {"type": "message", "role": "assistant", "content": []}}),
        ),
        (
            "response.output_text.delta",
            json!({"type": "response.output_text.delta", "sequence_number": 2, "output_index": 0, "content_index": 0, "delta": "Hel"}),
        ),
        (
            "response.output_text.delta",
            json!({"type": "response.output_text.delta", "sequence_number": 3, "output_index": 0, "content_index": 0, "delta": "lo"}),
        ),
        (
            "response.completed",
            json!({"type": "response.completed", "sequence_number": 4, "response": {"id": "resp_1", "status": "completed"}}),
        ),
    ];
    let event = |(name, data): &(&str, Value)| format!("event: {name}\ndata: {data}");

    let (reply, sse) = Reply::sse_channel();
    mock.push(reply);
    let client = TestClient::http1();
    // compactor holds the stream (its head too) until the first content event, in case the
    // provider refuses the request for its length first: the preamble goes out with it.
    let url = proxy.url("/v1/responses");
    let (response, ()) = tokio::join!(
        client.request(
            "POST",
            &url,
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer sk-stream"),
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
    assert_eq!(check_responses(&v, usize::MAX), Ok(()));

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
