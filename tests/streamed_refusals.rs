//! Refusals for length streamed inside a `200`, through the real proxy: OpenAI Responses'
//! `response.failed`, Anthropic's `error` event and a Chat Completions error chunk, each sent
//! after the stream's preamble. compactor holds a chat stream back until its first content
//! event, so such a refusal is compacted and sent again like a 400 and the client sees only the
//! second answer; a stream whose content comes passes byte for byte, preamble included; one
//! that ends, breaks off, grows past the bound or stalls during its preamble passes as it is;
//! and a refusal that cannot be retried reaches the client as the provider streamed it.

mod support;

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use support::summary_calls::is_summary_request;
use support::{upstream_toml, MockUpstream, Recorded, Reply, TestClient, TestProxy};

/// No trigger fires (a large message limit, the default window); the `extractive` summarizer
/// needs no network.
const CONFIG: &str = "[compaction]\nmax_messages = 1000\nmin_preserve_tokens = 20\n\
                      max_preserve_tokens = 200\n[summarizer]\nbackend = \"extractive\"\n";

/// Summaries from the caller's provider (the mock), so the test counts every call.
const LLM_SUMMARIES: &str = "[compaction]\nmax_messages = 1000\nmin_preserve_tokens = 20\n\
                             max_preserve_tokens = 200\n[summarizer]\nbackend = \"openai\"\n";

/// The three chat dialects, each with a request too long for the provider, the size above
/// which the provider refuses, and its streams.
#[derive(Clone, Copy, Debug)]
enum Dialect {
    Responses,
    Messages,
    Chat,
}

const DIALECTS: [Dialect; 3] = [Dialect::Responses, Dialect::Messages, Dialect::Chat];

impl Dialect {
    fn path(self) -> &'static str {
        match self {
            Dialect::Responses => "/v1/responses",
            Dialect::Messages => "/v1/messages",
            Dialect::Chat => "/v1/chat/completions",
        }
    }

    /// The `route` label of its requests.
    fn route(self) -> &'static str {
        match self {
            Dialect::Responses => "responses",
            Dialect::Messages => "messages",
            Dialect::Chat => "chat_completions",
        }
    }

    /// The body field holding the conversation.
    fn field(self) -> &'static str {
        match self {
            Dialect::Responses => "input",
            Dialect::Messages | Dialect::Chat => "messages",
        }
    }

    /// The most items the provider's window takes.
    fn limit(self) -> usize {
        match self {
            Dialect::Responses | Dialect::Chat => 12,
            Dialect::Messages => 10,
        }
    }

    /// A streaming request of `turns` turns (each one or more items), over the limit at 9.
    fn request(self, turns: usize) -> Value {
        let words = "the parser drops trailing commas ".repeat(6);
        match self {
            Dialect::Responses => {
                let mut items =
                    vec![json!({"type": "message", "role": "developer", "content": "Be brief."})];
                for i in 0..turns * 2 / 3 {
                    items.push(json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": format!("task {i}: {words}")}]}));
                    items.push(json!({"type": "function_call", "call_id": format!("call_{i}"), "name": "shell", "arguments": "{\"command\":[\"ls\"]}"}));
                    items.push(json!({"type": "function_call_output", "call_id": format!("call_{i}"), "output": words.repeat(8)}));
                }
                items.push(json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "summarise"}]}));
                json!({"model": "gpt-5-codex", "store": false, "stream": true, "input": items})
            }
            Dialect::Messages => {
                let mut messages = Vec::new();
                for i in 0..turns.div_ceil(2) {
                    messages.push(json!({"role": "user", "content": [{"type": "text", "text": format!("step {i}: {words}")}]}));
                    messages.push(json!({"role": "assistant", "content": [{"type": "text", "text": format!("done {i}: {}", words.repeat(8))}]}));
                }
                messages.push(json!({"role": "user", "content": "now run the tests"}));
                json!({"model": "claude-sonnet-4-5", "max_tokens": 1024, "stream": true,
                       "system": "You are Claude Code.", "messages": messages})
            }
            Dialect::Chat => {
                let mut messages =
                    vec![json!({"role": "system", "content": "You are a careful assistant."})];
                for i in 0..turns * 2 + 1 {
                    let role = if i % 2 == 0 { "user" } else { "assistant" };
                    messages.push(json!({"role": role, "content": format!("turn {i}: {}", "words ".repeat(40))}));
                }
                json!({"model": "gpt-4o", "stream": true, "messages": messages})
            }
        }
    }

    /// How many conversation items a request the provider received holds.
    fn items(self, r: &Recorded) -> usize {
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        v[self.field()].as_array().map_or(0, Vec::len)
    }

    /// The events a stream starts with, which carry nothing the agent needs yet.
    fn preamble(self) -> Vec<String> {
        match self {
            Dialect::Responses => vec![
                event(
                    "response.created",
                    &json!({"type": "response.created", "sequence_number": 0,
                    "response": {"id": "resp_1", "object": "response", "status": "in_progress",
                                 "instructions": "You are Codex.", "output": [], "error": null}}),
                ),
                event(
                    "response.in_progress",
                    &json!({"type": "response.in_progress", "sequence_number": 1,
                    "response": {"id": "resp_1", "object": "response", "status": "in_progress",
                                 "output": [], "error": null}}),
                ),
            ],
            Dialect::Messages => vec![
                event(
                    "message_start",
                    &json!({"type": "message_start", "message": {"id": "msg_1",
                    "type": "message", "role": "assistant", "content": [], "model": "claude-sonnet-4-5",
                    "usage": {"input_tokens": 25, "output_tokens": 1}}}),
                ),
                event("ping", &json!({"type": "ping"})),
            ],
            Dialect::Chat => vec![
                ": OPENROUTER PROCESSING\n\n".to_owned(),
                data(
                    &json!({"id": "c1", "object": "chat.completion.chunk", "created": 1,
                    "model": "gpt-4o", "choices": [{"index": 0,
                    "delta": {"role": "assistant", "content": "", "refusal": null},
                    "logprobs": null, "finish_reason": null}]}),
                ),
            ],
        }
    }

    /// The refusal for length the provider streams after the preamble.
    fn refusal(self) -> String {
        match self {
            Dialect::Responses => event(
                "response.failed",
                &json!({"type": "response.failed", "sequence_number": 2,
                "response": {"id": "resp_1", "object": "response", "status": "failed", "output": [],
                    "error": {"code": "context_length_exceeded",
                              "message": "Your input exceeds the context window of this model. Please adjust your input and try again."}}}),
            ),
            Dialect::Messages => event(
                "error",
                &json!({"type": "error", "error": {"type": "invalid_request_error",
                "message": "prompt is too long: 208317 tokens > 200000 maximum"}}),
            ),
            Dialect::Chat => data(
                &json!({"error": {"message": "This model's maximum context length is 4096 tokens. However, your messages resulted in 6100 tokens. Please reduce the length of the messages.",
                "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}),
            ),
        }
    }

    /// The content events of an answer that says `text`, to the end of the stream.
    fn content(self, text: &str) -> Vec<String> {
        match self {
            Dialect::Responses => vec![
                event(
                    "response.output_item.added",
                    &json!({"type": "response.output_item.added", "sequence_number": 2,
                    "output_index": 0, "item": {"id": "msg_1", "type": "message", "role": "assistant", "content": []}}),
                ),
                event(
                    "response.output_text.delta",
                    &json!({"type": "response.output_text.delta", "sequence_number": 3,
                    "output_index": 0, "content_index": 0, "delta": text}),
                ),
                event(
                    "response.completed",
                    &json!({"type": "response.completed", "sequence_number": 4,
                    "response": {"id": "resp_1", "object": "response", "status": "completed", "output": [],
                                 "usage": {"input_tokens": 900, "output_tokens": 2, "total_tokens": 902}}}),
                ),
            ],
            Dialect::Messages => vec![
                event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}),
                ),
                event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": text}}),
                ),
                event(
                    "content_block_stop",
                    &json!({"type": "content_block_stop", "index": 0}),
                ),
                event(
                    "message_delta",
                    &json!({"type": "message_delta",
                    "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}}),
                ),
                event("message_stop", &json!({"type": "message_stop"})),
            ],
            Dialect::Chat => vec![
                data(
                    &json!({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
                    "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]}),
                ),
                data(
                    &json!({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
                ),
                "data: [DONE]\n\n".to_owned(),
            ],
        }
    }

    /// A whole answer saying `text`: the preamble, then content.
    fn answer(self, text: &str) -> Vec<String> {
        let mut events = self.preamble();
        events.extend(self.content(text));
        events
    }

    /// A whole refusal: the preamble, then the refusal (Chat Completions streams end with
    /// `[DONE]` even then).
    fn refused(self) -> Vec<String> {
        let mut events = self.preamble();
        events.push(self.refusal());
        if let Dialect::Chat = self {
            events.push("data: [DONE]\n\n".to_owned());
        }
        events
    }
}

/// Whether the mock's request is a summarizer call, on any wire (a Responses caller's summary
/// is asked for over Responses; every compaction prompt starts with `<task>`).
fn summarizer_call(r: &Recorded) -> bool {
    is_summary_request(r) || String::from_utf8_lossy(&r.body).contains("<task>")
}

/// The agent's own requests the mock received, in order.
fn agent_requests(mock: &MockUpstream) -> Vec<Recorded> {
    mock.requests()
        .into_iter()
        .filter(|r| !summarizer_call(r))
        .collect()
}

/// The summarizer calls the mock received.
fn summarizer_calls(mock: &MockUpstream) -> usize {
    mock.requests()
        .iter()
        .filter(|r| summarizer_call(r))
        .count()
}

fn event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

fn data(data: &Value) -> String {
    format!("data: {data}\n\n")
}

/// An SSE reply written as these chunks, the first event split in two so that events cross
/// frames as they do on the wire.
fn sse(events: &[String]) -> Reply {
    let mut chunks: Vec<Bytes> = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if i == 0 && e.len() > 10 {
            let (a, b) = e.split_at(10);
            chunks.push(Bytes::copy_from_slice(a.as_bytes()));
            chunks.push(Bytes::copy_from_slice(b.as_bytes()));
        } else {
            chunks.push(Bytes::from(e.clone()));
        }
    }
    Reply::Chunks {
        status: 200,
        headers: vec![
            (
                "content-type".into(),
                "text/event-stream; charset=utf-8".into(),
            ),
            ("cache-control".into(), "no-cache".into()),
        ],
        chunks,
    }
}

fn concat(events: &[String]) -> String {
    events.concat()
}

/// The answer to a summarizer call (`LLM_SUMMARIES`).
fn summary() -> Reply {
    Reply::json(
        200,
        &json!({"id": "s", "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "The user set up a parser."}}]}),
    )
}

/// A summary far longer than any window: a compaction with it is never smaller than what it
/// replaces, so every attempt is a call that fails.
fn endless_summary() -> Reply {
    Reply::json(
        200,
        &json!({"id": "s", "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "long summary ".repeat(4000)}}]}),
    )
}

fn headers(dialect: Dialect) -> Vec<(&'static str, &'static str)> {
    let mut h = vec![("content-type", "application/json")];
    match dialect {
        Dialect::Messages => h.push(("x-api-key", "sk-stream")),
        _ => h.push(("authorization", "Bearer sk-stream")),
    }
    h
}

async fn send(proxy: &TestProxy, dialect: Dialect, body: &Value) -> support::Exchange {
    TestClient::http1()
        .exchange(
            "POST",
            &proxy.url(dialect.path()),
            &headers(dialect),
            Bytes::from(body.to_string()),
        )
        .await
}

async fn metric(proxy: &TestProxy, name: &str, labels: &[(&str, &str)]) -> f64 {
    proxy.metric(name, labels).await.unwrap_or(0.0)
}

async fn retries(proxy: &TestProxy, outcome: &str, via: &str) -> f64 {
    metric(
        proxy,
        "compactor_retries_total",
        &[
            ("reason", "context_length"),
            ("outcome", outcome),
            ("via", via),
        ],
    )
    .await
}

async fn requests(proxy: &TestProxy, dialect: Dialect, class: &str) -> f64 {
    metric(
        proxy,
        "compactor_requests_total",
        &[
            ("route", dialect.route()),
            ("method", "POST"),
            ("status_class", class),
        ],
    )
    .await
}

#[tokio::test]
async fn a_streamed_refusal_for_length_is_compacted_and_retried_in_every_dialect() {
    for dialect in DIALECTS {
        let mock = MockUpstream::start().await;
        mock.set_handler(move |r| {
            if dialect.items(r) <= dialect.limit() {
                sse(&dialect.answer("fits"))
            } else {
                sse(&dialect.refused())
            }
        });
        let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
        let body = dialect.request(9);
        let got = send(&proxy, dialect, &body).await;
        let text = String::from_utf8_lossy(&got.body).into_owned();
        assert_eq!(got.status, 200, "{dialect:?}: {text}");
        assert_eq!(
            got.header("x-compactor-retried"),
            Some("true"),
            "{dialect:?}: {text}"
        );
        assert_eq!(
            got.header("x-compactor-compacted"),
            Some("true"),
            "{dialect:?}"
        );
        assert_eq!(
            text,
            concat(&dialect.answer("fits")),
            "{dialect:?}: the client sees the retry's stream, and only it"
        );

        let sent = agent_requests(&mock);
        assert_eq!(sent.len(), 2, "{dialect:?}: the original, then the retry");
        assert!(dialect.items(&sent[0]) > dialect.limit(), "{dialect:?}");
        assert!(
            dialect.items(&sent[1]) <= dialect.limit(),
            "{dialect:?}: the retry fits"
        );
        let retried: Value = serde_json::from_slice(&sent[1].body).expect("JSON");
        assert_eq!(retried["stream"], true, "{dialect:?}");

        assert_eq!(
            retries(&proxy, "retried", "stream").await,
            1.0,
            "{dialect:?}"
        );
        assert_eq!(
            retries(&proxy, "retried", "status").await,
            0.0,
            "{dialect:?}"
        );
        assert_eq!(
            metric(
                &proxy,
                "compactor_compactions_total",
                &[("trigger", "overflow"), ("outcome", "compacted")]
            )
            .await,
            1.0,
            "{dialect:?}"
        );
        // The client got the retry's success.
        assert_eq!(requests(&proxy, dialect, "2xx").await, 1.0, "{dialect:?}");
        assert_eq!(requests(&proxy, dialect, "4xx").await, 0.0, "{dialect:?}");
        proxy.shutdown().await;
    }
}

#[tokio::test]
async fn a_stream_whose_content_comes_passes_through_byte_for_byte() {
    for dialect in DIALECTS {
        let mock = MockUpstream::start().await;
        mock.set_handler(move |_| sse(&dialect.answer("hello there")));
        let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
        let got = send(&proxy, dialect, &dialect.request(3)).await;
        assert_eq!(got.status, 200, "{dialect:?}");
        assert_eq!(
            got.header("content-type"),
            Some("text/event-stream; charset=utf-8")
        );
        assert_eq!(got.header("x-compactor-retried"), None, "{dialect:?}");
        assert_eq!(
            got.body.as_ref(),
            concat(&dialect.answer("hello there")).as_bytes(),
            "{dialect:?}: preamble and content, every byte in order"
        );
        assert_eq!(mock.request_count(), 1, "{dialect:?}");
        assert_eq!(requests(&proxy, dialect, "2xx").await, 1.0, "{dialect:?}");
        proxy.shutdown().await;
    }
}

/// The head itself waits for the first content event (a retry's answer could need another),
/// and then the held bytes and the rest of the stream follow as they come.
#[tokio::test]
async fn the_response_head_waits_for_the_first_content_event() {
    let dialect = Dialect::Responses;
    let mock = MockUpstream::start().await;
    let (reply, sender) = Reply::sse_channel();
    mock.push(reply);
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
    let url = proxy.url(dialect.path());
    let body = dialect.request(3).to_string();
    let client = tokio::spawn(async move {
        TestClient::http1()
            .request("POST", &url, &headers(dialect), body)
            .await
    });
    for e in dialect.preamble() {
        sender.send(e).await.expect("the proxy reads the preamble");
    }
    // Not a synchronisation sleep: the head must not come however long the preamble waits.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !client.is_finished(),
        "the head was sent before any content event"
    );
    let content = dialect.content("late");
    sender.send(content[0].clone()).await.expect("content");
    let response = support::within("the head once content came", client)
        .await
        .expect("client task");
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let first = support::within("the held bytes", body.frame())
        .await
        .expect("a frame")
        .expect("data")
        .into_data()
        .expect("data frame");
    assert_eq!(
        first,
        format!("{}{}", concat(&dialect.preamble()), content[0]),
        "the held bytes come at once"
    );
    for e in &content[1..] {
        sender.send(e.clone()).await.expect("the rest");
    }
    sender.finish();
    let rest = support::within("the rest", body.collect())
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(rest, concat(&content[1..]).as_bytes());
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_stream_that_ends_or_breaks_off_in_its_preamble_passes_as_it_is() {
    for dialect in DIALECTS {
        // It ends.
        let mock = MockUpstream::start().await;
        mock.set_handler(move |_| sse(&dialect.preamble()));
        let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
        let got = send(&proxy, dialect, &dialect.request(3)).await;
        assert_eq!(got.status, 200, "{dialect:?}");
        assert_eq!(
            got.body.as_ref(),
            concat(&dialect.preamble()).as_bytes(),
            "{dialect:?}"
        );
        assert_eq!(mock.request_count(), 1, "{dialect:?}");
        proxy.shutdown().await;

        // It breaks off: the client gets the held bytes, then the cut.
        let mock = MockUpstream::start().await;
        let chunks: Vec<Bytes> = dialect.preamble().into_iter().map(Bytes::from).collect();
        mock.set_handler(move |_| Reply::ResetAfter {
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            chunks: chunks.clone(),
        });
        let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
        let response = TestClient::http1()
            .request(
                "POST",
                &proxy.url(dialect.path()),
                &headers(dialect),
                dialect.request(3).to_string(),
            )
            .await;
        assert_eq!(response.status(), 200, "{dialect:?}");
        let mut body = response.into_body();
        let mut got = Vec::new();
        let mut cut = false;
        while let Some(frame) = support::within("a frame", body.frame()).await {
            match frame {
                Ok(frame) => got.extend_from_slice(&frame.into_data().unwrap_or_default()),
                Err(_) => {
                    cut = true;
                    break;
                }
            }
        }
        assert!(
            cut,
            "{dialect:?}: the cut reaches the client: {}",
            String::from_utf8_lossy(&got)
        );
        assert_eq!(got, concat(&dialect.preamble()).as_bytes(), "{dialect:?}");
        proxy
            .wait_metric(
                "compactor_upstream_errors_total",
                &[("kind", "stream_cut")],
                1.0,
            )
            .await;
        assert_eq!(mock.request_count(), 1, "{dialect:?}");
        proxy.shutdown().await;
    }
}

/// A preamble past the hold's bound (256 KiB) is released as it is: a refusal after it is not
/// seen, and reaches the client as streamed.
#[tokio::test]
async fn a_preamble_over_the_bound_passes_as_it_is() {
    let dialect = Dialect::Responses;
    let instructions = "Follow the repository's conventions. ".repeat(8 * 1024);
    assert!(instructions.len() > 256 * 1024);
    let mut events = vec![event(
        "response.created",
        &json!({"type": "response.created", "sequence_number": 0,
                "response": {"id": "resp_1", "status": "in_progress", "instructions": instructions}}),
    )];
    events.push(dialect.refusal());
    let stream = events.clone();
    let mock = MockUpstream::start().await;
    mock.set_handler(move |_| sse(&stream));
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
    let got = send(&proxy, dialect, &dialect.request(9)).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("x-compactor-retried"), None);
    assert_eq!(got.body.as_ref(), concat(&events).as_bytes(), "every byte");
    assert_eq!(mock.request_count(), 1, "no retry");
    assert_eq!(retries(&proxy, "retried", "stream").await, 0.0);
    proxy.shutdown().await;
}

/// A preamble that stalls is held for at most the upstream response timeout: then the client
/// gets the head and the bytes so far, and the rest as the provider sends it.
#[tokio::test]
async fn a_slow_preamble_passes_after_the_response_timeout() {
    let dialect = Dialect::Messages;
    let mock = MockUpstream::start().await;
    let (reply, sender) = Reply::sse_channel();
    mock.push(reply);
    let toml = format!(
        "{}response_timeout_secs = 0.3\n{CONFIG}",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();
    let url = proxy.url(dialect.path());
    let body = dialect.request(9).to_string();
    let headers = headers(dialect);
    let request = client.request("POST", &url, &headers, body);
    let preamble = dialect.preamble();
    let send_preamble = async {
        for e in &preamble {
            sender
                .send(e.clone())
                .await
                .expect("the proxy reads the preamble");
        }
    };
    let (response, ()) = support::within("the head while the preamble stalls", async {
        tokio::join!(request, send_preamble)
    })
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers().get("x-compactor-retried"), None);
    let mut body = response.into_body();
    let first = support::within("the held bytes", body.frame())
        .await
        .expect("a frame")
        .expect("data")
        .into_data()
        .expect("data frame");
    assert_eq!(first, concat(&preamble));
    // Too late to be retried: the refusal goes to the client as it comes.
    sender.send(dialect.refusal()).await.expect("the refusal");
    sender.finish();
    let rest = support::within("the rest", body.collect())
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(rest, dialect.refusal().as_bytes());
    assert_eq!(mock.request_count(), 1, "no retry");
    proxy.shutdown().await;
}

/// When the request already made every summarizer call it may, a streamed refusal reaches the
/// client as the provider streamed it, and counts as a refusal, not a success.
#[tokio::test]
async fn a_streamed_refusal_that_cannot_be_retried_reaches_the_client_as_streamed() {
    for dialect in DIALECTS {
        let mock = MockUpstream::start().await;
        mock.set_handler(move |r| {
            if summarizer_call(r) {
                endless_summary()
            } else {
                sse(&dialect.refused())
            }
        });
        // The trigger fires on the request (over `max_messages`) and its three attempts each
        // get a summary too long to help: the compaction after the refusal has no call left.
        let config = LLM_SUMMARIES.replace("max_messages = 1000", "max_messages = 8");
        let proxy = TestProxy::start(&format!("{}{config}", upstream_toml(&mock.url()))).await;
        let got = send(&proxy, dialect, &dialect.request(9)).await;
        assert_eq!(got.status, 200, "{dialect:?}");
        assert_eq!(got.header("x-compactor-retried"), None, "{dialect:?}");
        assert_eq!(
            got.body.as_ref(),
            concat(&dialect.refused()).as_bytes(),
            "{dialect:?}: the refusal as streamed"
        );
        assert_eq!(
            agent_requests(&mock).len(),
            1,
            "{dialect:?}: not sent again"
        );
        assert_eq!(
            retries(&proxy, "not_compacted", "stream").await,
            1.0,
            "{dialect:?}"
        );
        assert_eq!(
            metric(
                &proxy,
                "compactor_compactions_total",
                &[("trigger", "overflow"), ("outcome", "failed")]
            )
            .await,
            1.0,
            "{dialect:?}"
        );
        assert_eq!(requests(&proxy, dialect, "4xx").await, 1.0, "{dialect:?}");
        assert_eq!(requests(&proxy, dialect, "2xx").await, 0.0, "{dialect:?}");
        proxy.shutdown().await;
    }
}

/// Compactions after streamed refusals that cannot help (every summary too long) open the
/// conversation's breaker; once open, later streamed refusals pass on without a summarizer
/// call.
#[tokio::test]
async fn streamed_refusals_that_cannot_be_cured_open_the_session_breaker() {
    let dialect = Dialect::Messages;
    let mock = MockUpstream::start().await;
    mock.set_handler(move |r| {
        if summarizer_call(r) {
            endless_summary()
        } else {
            sse(&dialect.refused())
        }
    });
    let proxy = TestProxy::start(&format!("{}{LLM_SUMMARIES}", upstream_toml(&mock.url()))).await;
    let mut body = dialect.request(9);
    let mut calls = Vec::new();
    for turn in 0..5 {
        let got = send(&proxy, dialect, &body).await;
        assert_eq!(got.status, 200, "turn {turn}");
        assert_eq!(got.body.as_ref(), concat(&dialect.refused()).as_bytes());
        calls.push(summarizer_calls(&mock));
        let messages = body["messages"].as_array_mut().expect("messages");
        messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
        messages.push(json!({"role": "user", "content": format!("question {turn}")}));
    }
    assert!(calls[0] > 0, "the first refusal is compacted: {calls:?}");
    assert_eq!(
        calls[2], calls[4],
        "no call once the breaker is open: {calls:?}"
    );
    assert_eq!(
        metric(
            &proxy,
            "compactor_compactions_total",
            &[("trigger", "overflow"), ("outcome", "breaker")]
        )
        .await,
        2.0
    );
    assert_eq!(
        metric(&proxy, "compactor_breaker_open_total", &[]).await,
        1.0
    );
    assert_eq!(retries(&proxy, "not_compacted", "stream").await, 5.0);
    assert_eq!(requests(&proxy, dialect, "4xx").await, 5.0);
    proxy.shutdown().await;
}

/// A retry whose own stream is refused for its length again is a failure of the
/// conversation's breaker, as on the 400 path: after three, the breaker opens.
#[tokio::test]
async fn retries_refused_again_in_a_stream_open_the_session_breaker() {
    let dialect = Dialect::Chat;
    let mock = MockUpstream::start().await;
    mock.set_handler(move |r| {
        if summarizer_call(r) {
            summary()
        } else {
            sse(&dialect.refused())
        }
    });
    let proxy = TestProxy::start(&format!("{}{LLM_SUMMARIES}", upstream_toml(&mock.url()))).await;
    let mut body = dialect.request(9);
    let mut calls = Vec::new();
    for turn in 0..5 {
        let got = send(&proxy, dialect, &body).await;
        assert_eq!(got.status, 200, "turn {turn}");
        assert_eq!(
            got.body.as_ref(),
            concat(&dialect.refused()).as_bytes(),
            "turn {turn}: the last refusal, as streamed"
        );
        calls.push(summarizer_calls(&mock));
        let messages = body["messages"].as_array_mut().expect("messages");
        messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
        messages.push(json!({"role": "user", "content": format!("question {turn}")}));
    }
    assert_eq!(
        retries(&proxy, "retried", "stream").await,
        3.0,
        "three smaller requests were sent: {calls:?}"
    );
    assert_eq!(
        calls[2], calls[4],
        "no call once the breaker is open: {calls:?}"
    );
    assert_eq!(
        metric(&proxy, "compactor_breaker_open_total", &[]).await,
        1.0
    );
    // Every answer the client got was a refusal for length.
    assert_eq!(requests(&proxy, dialect, "4xx").await, 5.0);
    assert_eq!(requests(&proxy, dialect, "2xx").await, 0.0);
    proxy.shutdown().await;
}

/// A request compactor could not send again (here: compaction is off) is not held: its head
/// and preamble reach the client at once, content or not.
#[tokio::test]
async fn a_stream_that_could_not_be_retried_is_not_held() {
    let dialect = Dialect::Chat;
    let mock = MockUpstream::start().await;
    let (reply, sender) = Reply::sse_channel();
    mock.push(reply);
    let toml = format!(
        "{}[compaction]\nenabled = false\n",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();
    let url = proxy.url(dialect.path());
    let headers = headers(dialect);
    let request = client.request("POST", &url, &headers, dialect.request(9).to_string());
    let preamble = dialect.preamble();
    let send_preamble = async {
        for e in &preamble {
            sender
                .send(e.clone())
                .await
                .expect("the proxy reads the preamble");
        }
    };
    let (response, ()) = support::within("the head with no content yet", async {
        tokio::join!(request, send_preamble)
    })
    .await;
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut got = Vec::new();
    while got.len() < concat(&preamble).len() {
        let frame = support::within("the preamble", body.frame())
            .await
            .expect("a frame")
            .expect("data");
        got.extend_from_slice(&frame.into_data().unwrap_or_default());
    }
    assert_eq!(got, concat(&preamble).as_bytes());
    sender.send(dialect.refusal()).await.expect("the refusal");
    sender.finish();
    let rest = support::within("the rest", body.collect())
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(rest, dialect.refusal().as_bytes());
    assert_eq!(mock.request_count(), 1);
    assert_eq!(retries(&proxy, "not_compacted", "stream").await, 0.0);
    assert_eq!(requests(&proxy, dialect, "2xx").await, 1.0);
    proxy.shutdown().await;
}
