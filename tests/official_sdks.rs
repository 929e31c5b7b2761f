//! The official Python SDKs against the real proxy: `openai` (Chat Completions and Responses)
//! and `anthropic` (Messages), at the versions pinned in `tests/sdk/requirements.txt`, installed
//! by `scripts/sdk-venv` into `.venv-sdk` (or the interpreter named by `COMPACTOR_SDK_PYTHON`).
//! One Python process per API (`tests/sdk/*.py`) makes four calls through compactor to a mock
//! provider answering in that API's real shapes: a tool loop turn, the next turn streamed, then
//! a long conversation that compacts (`max_messages = 12`, the local `extractive` summarizer,
//! background summaries off so compaction happens on the request path) and its next turn
//! streamed. Each test checks what the SDK parsed (tool calls, encrypted reasoning, streamed
//! text and tool input, usage, request ids and `x-compactor-compacted` off the raw response)
//! and what the provider received (path, credentials, the SDK's headers, the body as the SDK
//! sent it, or compacted: fewer messages, a summary, the last turn verbatim).

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use compactor::compaction::prompt::SUMMARY_INTRO;
use serde_json::{json, Value};
use support::{upstream_toml, MockUpstream, Recorded, Reply, TestProxy};

/// Compaction when a request holds more than 12 messages (the first two calls of each script
/// hold fewer), on the request path, with a small verbatim tail and no summarizer network.
const CONFIG: &str = "[compaction]\nmax_messages = 12\nbackground_ratio = 0\n\
                      min_preserve_tokens = 20\nmax_preserve_tokens = 200\n\
                      [summarizer]\nbackend = \"extractive\"\n";

/// What the scripts use as API key.
const KEY: &str = "sk-sdk-test-key";

/// The command that creates the SDK venv, for the failure message.
const SETUP: &str = "scripts/sdk-venv";

/// The Python with the pinned SDKs: `COMPACTOR_SDK_PYTHON`, else `.venv-sdk/bin/python`; panics
/// with the setup command when neither exists (no silent skip).
fn sdk_python() -> PathBuf {
    if let Some(p) = std::env::var_os("COMPACTOR_SDK_PYTHON") {
        let p = PathBuf::from(p);
        assert!(
            p.exists(),
            "COMPACTOR_SDK_PYTHON={} does not exist; run `{SETUP}` and unset it, or fix the path",
            p.display()
        );
        return p;
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv-sdk/bin/python");
    assert!(
        venv.exists(),
        "the official SDK tests need {}: run `{SETUP}` (creates the venv with the pinned openai \
         and anthropic packages) or set COMPACTOR_SDK_PYTHON",
        venv.display()
    );
    venv
}

/// Runs `tests/sdk/<script>` with the SDK venv and returns the JSON it prints. The environment
/// is cleared so no proxy, base URL or real key of the developer's shell reaches the SDK.
async fn run_sdk(script: &str, base_url: &str) -> Value {
    let python = sdk_python();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/sdk")
        .join(script);
    let child = tokio::process::Command::new(&python)
        .arg(&path)
        .arg(base_url)
        .arg(KEY)
        .env_clear()
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONIOENCODING", "utf-8")
        .kill_on_drop(true)
        .output();
    // Four calls of at most 15 s each (the scripts' SDK timeout); Python and SDK start-up on a
    // loaded 2-core box take a few seconds.
    let out = tokio::time::timeout(Duration::from_secs(90), child)
        .await
        .unwrap_or_else(|_| panic!("{script} did not finish within 90 s"))
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed: {}\n{stderr}",
        out.status
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{script} printed no JSON ({e}): {}\n{stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The version `tests/sdk/requirements.txt` pins `package` to.
fn pinned(package: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/requirements.txt");
    let text = std::fs::read_to_string(&path).expect("tests/sdk/requirements.txt");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{package}==")))
        .unwrap_or_else(|| panic!("{package} is not pinned in {}", path.display()))
        .trim()
        .to_owned()
}

/// Checks that the script ran the pinned SDK, not whatever an older venv holds.
fn assert_pinned(got: &Value, package: &str) {
    assert_eq!(
        got["sdk_version"].as_str(),
        Some(pinned(package).as_str()),
        "the venv's {package} is not the pinned version: run `{SETUP}`"
    );
}

fn body(r: &Recorded) -> Value {
    serde_json::from_slice(&r.body).expect("the upstream received JSON")
}

/// An SSE response of named events (`event:` and `data:` lines), as Anthropic and the Responses
/// API send them.
fn named_sse(events: &[(&str, Value)]) -> Reply {
    Reply::Chunks {
        status: 200,
        headers: vec![
            ("content-type".into(), "text/event-stream".into()),
            ("cache-control".into(), "no-cache".into()),
        ],
        chunks: events
            .iter()
            .map(|(name, data)| Bytes::from(format!("event: {name}\ndata: {data}\n\n")))
            .collect(),
    }
}

/// The texts of one message or input item: string content, or its blocks' `text`.
fn texts(item: &Value) -> Vec<&str> {
    match &item["content"] {
        Value::String(s) => vec![s.as_str()],
        Value::Array(blocks) => blocks.iter().filter_map(|b| b["text"].as_str()).collect(),
        _ => Vec::new(),
    }
}

/// Checks that `forwarded` is `sent` compacted: fewer items, exactly one carrying the summary,
/// and everything after it a verbatim tail of `sent` that ends with the user's latest turn.
fn assert_compacted(what: &str, sent: &Value, forwarded: &Value) {
    let (sent, forwarded) = (
        sent.as_array().expect("sent items"),
        forwarded.as_array().expect("forwarded items"),
    );
    assert!(
        forwarded.len() < sent.len(),
        "{what}: {} items forwarded of {}",
        forwarded.len(),
        sent.len()
    );
    let summaries: Vec<usize> = (0..forwarded.len())
        .filter(|&i| {
            texts(&forwarded[i])
                .iter()
                .any(|t| t.starts_with(SUMMARY_INTRO))
        })
        .collect();
    assert_eq!(summaries.len(), 1, "{what}: one summary in {forwarded:#?}");
    let tail = &forwarded[summaries[0] + 1..];
    assert!(
        !tail.is_empty(),
        "{what}: a verbatim tail after the summary"
    );
    assert_eq!(
        tail,
        &sent[sent.len() - tail.len()..],
        "{what}: verbatim tail"
    );
}

/// Checks the headers every request of an OpenAI SDK carries, as the provider received them.
fn assert_openai_headers(r: &Recorded, path: &str) {
    assert_eq!(r.method, "POST");
    assert_eq!(r.path_and_query, path);
    assert_eq!(r.header("authorization"), Some(&*format!("Bearer {KEY}")));
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert!(
        r.header("user-agent")
            .is_some_and(|ua| ua.starts_with("OpenAI/Python")),
        "{:?}",
        r.header("user-agent")
    );
    assert_eq!(r.header("x-stainless-lang"), Some("python"));
}

fn chat_completion(id: &str, message: Value, finish: &str) -> Reply {
    Reply::json(
        200,
        &json!({
            "id": id, "object": "chat.completion", "created": 1_700_000_000, "model": "gpt-4o-2024-08-06",
            "system_fingerprint": "fp_mock",
            "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 12, "total_tokens": 62}
        }),
    )
    .with_header("x-request-id", &format!("req_{id}"))
}

/// A streamed chat completion: each `delta` in its own chunk, then the finish reason, the usage
/// chunk (`stream_options.include_usage`) and `[DONE]`.
fn chat_stream(id: &str, deltas: &[Value], finish: &str) -> Reply {
    let chunk = |choices: Value, usage: Value| {
        json!({"id": id, "object": "chat.completion.chunk", "created": 1_700_000_000,
               "model": "gpt-4o-2024-08-06", "system_fingerprint": "fp_mock",
               "choices": choices, "usage": usage})
        .to_string()
    };
    let mut events: Vec<String> = deltas
        .iter()
        .map(|d| {
            chunk(
                json!([{"index": 0, "delta": d, "logprobs": null, "finish_reason": null}]),
                Value::Null,
            )
        })
        .collect();
    events.push(chunk(
        json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish}]),
        Value::Null,
    ));
    events.push(chunk(
        json!([]),
        json!({"prompt_tokens": 70, "completion_tokens": 9, "total_tokens": 79}),
    ));
    events.push("[DONE]".into());
    Reply::sse(&events)
}

#[tokio::test]
async fn openai_chat_completions() {
    let mock = MockUpstream::start().await;
    mock.push(chat_completion(
        "chatcmpl-1",
        json!({"role": "assistant", "content": null, "refusal": null, "tool_calls": [
            {"id": "call_2", "type": "function",
             "function": {"name": "shell", "arguments": "{\"cmd\": \"sed -i s/1/2/ a.py\"}"}}]}),
        "tool_calls",
    ));
    mock.push(chat_stream(
        "chatcmpl-2",
        &[
            json!({"role": "assistant", "content": ""}),
            json!({"content": "Patched, "}),
            json!({"content": "checking."}),
            json!({"tool_calls": [{"index": 0, "id": "call_3", "type": "function",
                                   "function": {"name": "shell", "arguments": ""}}]}),
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"cmd\": "}}]}),
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"pytest\"}"}}]}),
        ],
        "tool_calls",
    ));
    mock.push(chat_completion(
        "chatcmpl-3",
        json!({"role": "assistant", "content": "Module 13 is fine."}),
        "stop",
    ));
    mock.push(chat_stream(
        "chatcmpl-4",
        &[
            json!({"role": "assistant", "content": ""}),
            json!({"content": "Module 12 "}),
            json!({"content": "needs tests."}),
        ],
        "stop",
    ));
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
    let got = run_sdk("openai_chat.py", &proxy.url("/v1")).await;
    assert_pinned(&got, "openai");
    let received = mock.requests();
    assert_eq!(received.len(), 4, "one upstream request per SDK call");
    for r in &received {
        assert_openai_headers(r, "/v1/chat/completions");
    }

    // A tool loop turn: the tool call parsed, ids and usage as the provider sent them.
    let plain = &got["plain"];
    assert_eq!(plain["compacted"], "false");
    assert_eq!(plain["request_id"], "req_chatcmpl-1");
    assert_eq!(plain["id"], "chatcmpl-1");
    assert_eq!(plain["finish_reason"], "tool_calls");
    assert_eq!(
        plain["tool_calls"],
        json!([{"id": "call_2", "name": "shell", "arguments": {"cmd": "sed -i s/1/2/ a.py"}}])
    );
    assert_eq!(plain["total_tokens"], 62);
    let sent = body(&received[0]);
    assert_eq!(sent["model"], "gpt-4o");
    assert_eq!(
        sent["messages"], plain["sent"],
        "forwarded as the SDK sent it"
    );
    assert_eq!(sent["messages"][3]["role"], "tool");
    assert_eq!(sent["messages"][3]["tool_call_id"], "call_1");
    assert_eq!(sent["tools"][0]["function"]["name"], "shell");
    assert_ne!(sent["stream"], true);

    // The next turn streamed: text and tool call assembled from the deltas, usage chunk read.
    let streamed = &got["streamed"];
    assert_eq!(streamed["compacted"], "false");
    assert_eq!(streamed["chunks"], 8, "every chunk reached the SDK");
    assert_eq!(streamed["content"], "Patched, checking.");
    assert_eq!(streamed["finish_reason"], "tool_calls");
    assert_eq!(
        streamed["tool_calls"],
        json!([{"id": "call_3", "name": "shell", "arguments": {"cmd": "pytest"}}])
    );
    assert_eq!(streamed["total_tokens"], 79);
    let sent = body(&received[1]);
    assert_eq!(sent["stream"], true);
    assert_eq!(sent["stream_options"], json!({"include_usage": true}));
    assert_eq!(sent["messages"], streamed["sent"]);
    assert_eq!(sent["messages"][4]["tool_calls"][0]["id"], "call_2");
    assert_eq!(sent["messages"][5]["tool_call_id"], "call_2");

    // The long conversation: compacted on its way up, a normal answer on the way down.
    for (i, key, answer) in [
        (2, "compacted_plain", "Module 13 is fine."),
        (3, "compacted_streamed", "Module 12 needs tests."),
    ] {
        let call = &got[key];
        assert_eq!(call["compacted"], "true", "{key}");
        assert_eq!(call["content"], answer, "{key}");
        assert_eq!(call["finish_reason"], "stop", "{key}");
        let forwarded = body(&received[i]);
        assert_compacted(key, &call["sent"], &forwarded["messages"]);
        assert_eq!(
            forwarded["messages"][0], call["sent"][0],
            "{key}: system first"
        );
        assert_eq!(
            forwarded["stream"] == true,
            i == 3,
            "{key}: streamed or not"
        );
    }
    proxy.shutdown().await;
}

/// A Responses API `response` object, as `POST /v1/responses` answers and `response.completed`
/// carries it.
fn response_object(id: &str, status: &str, output: Value) -> Value {
    json!({
        "id": id, "object": "response", "created_at": 1_700_000_000, "status": status,
        "background": false, "error": null, "incomplete_details": null,
        "instructions": "You are Codex, a coding agent.", "max_output_tokens": null,
        "model": "gpt-5-codex", "output": output, "parallel_tool_calls": true,
        "previous_response_id": null, "reasoning": {"effort": "low", "summary": null},
        "store": false, "temperature": 1.0, "text": {"format": {"type": "text"}},
        "tool_choice": "auto", "tools": [], "top_p": 1.0, "truncation": "disabled",
        "usage": if status == "completed" {
            json!({"input_tokens": 120, "input_tokens_details": {"cached_tokens": 0},
                   "output_tokens": 30, "output_tokens_details": {"reasoning_tokens": 10},
                   "total_tokens": 150})
        } else {
            Value::Null
        },
        "metadata": {}
    })
}

fn output_message(id: &str, text: &str) -> Value {
    json!({"type": "message", "id": id, "status": "completed", "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

/// A streamed response answering `text`: the event sequence the API sends for one message.
fn responses_stream(id: &str, text: [&str; 2]) -> Reply {
    let whole = text.concat();
    let events = [
        (
            "response.created",
            json!({"type": "response.created", "response": response_object(id, "in_progress", json!([]))}),
        ),
        (
            "response.in_progress",
            json!({"type": "response.in_progress", "response": response_object(id, "in_progress", json!([]))}),
        ),
        (
            "response.output_item.added",
            json!({"type": "response.output_item.added", "output_index": 0,
                   "item": {"type": "message", "id": "msg_s", "status": "in_progress", "role": "assistant", "content": []}}),
        ),
        (
            "response.content_part.added",
            json!({"type": "response.content_part.added", "item_id": "msg_s", "output_index": 0, "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": []}}),
        ),
        (
            "response.output_text.delta",
            json!({"type": "response.output_text.delta", "item_id": "msg_s", "output_index": 0, "content_index": 0, "delta": text[0]}),
        ),
        (
            "response.output_text.delta",
            json!({"type": "response.output_text.delta", "item_id": "msg_s", "output_index": 0, "content_index": 0, "delta": text[1]}),
        ),
        (
            "response.output_text.done",
            json!({"type": "response.output_text.done", "item_id": "msg_s", "output_index": 0, "content_index": 0, "text": whole}),
        ),
        (
            "response.content_part.done",
            json!({"type": "response.content_part.done", "item_id": "msg_s", "output_index": 0, "content_index": 0,
                   "part": {"type": "output_text", "text": whole, "annotations": []}}),
        ),
        (
            "response.output_item.done",
            json!({"type": "response.output_item.done", "output_index": 0, "item": output_message("msg_s", &whole)}),
        ),
        (
            "response.completed",
            json!({"type": "response.completed",
                   "response": response_object(id, "completed", json!([output_message("msg_s", &whole)]))}),
        ),
    ];
    let events: Vec<(&str, Value)> = events
        .into_iter()
        .enumerate()
        .map(|(n, (name, mut data))| {
            data["sequence_number"] = json!(n);
            (name, data)
        })
        .collect();
    named_sse(&events)
}

#[tokio::test]
async fn openai_responses() {
    let mock = MockUpstream::start().await;
    mock.push(
        Reply::json(
            200,
            &response_object(
                "resp_1",
                "completed",
                json!([
                    {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAAAB-enc-2"},
                    {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "shell",
                     "arguments": "{\"cmd\": \"python -m pytest\"}", "status": "completed"}
                ]),
            ),
        )
        .with_header("x-request-id", "req_resp_1"),
    );
    mock.push(responses_stream("resp_2", ["All tests ", "pass."]));
    mock.push(Reply::json(
        200,
        &response_object(
            "resp_3",
            "completed",
            json!([output_message("msg_3", "Module 12 is fine.")]),
        ),
    ));
    mock.push(responses_stream("resp_4", ["Module 11 ", "needs tests."]));
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
    let got = run_sdk("openai_responses.py", &proxy.url("/v1")).await;
    assert_pinned(&got, "openai");
    let received = mock.requests();
    assert_eq!(received.len(), 4, "one upstream request per SDK call");
    for r in &received {
        assert_openai_headers(r, "/v1/responses");
        let sent = body(r);
        assert_eq!(sent["store"], false);
        assert_eq!(sent["include"], json!(["reasoning.encrypted_content"]));
        assert_eq!(sent["instructions"], "You are Codex, a coding agent.");
        assert_eq!(sent["tools"][0]["name"], "shell");
    }

    // A tool loop turn: encrypted reasoning and the function call parsed as sent.
    let plain = &got["plain"];
    assert_eq!(plain["compacted"], "false");
    assert_eq!(plain["request_id"], "req_resp_1");
    assert_eq!(plain["id"], "resp_1");
    assert_eq!(plain["output_types"], json!(["reasoning", "function_call"]));
    assert_eq!(
        plain["reasoning"],
        json!([{"id": "rs_2", "encrypted_content": "gAAAAB-enc-2"}])
    );
    assert_eq!(
        plain["calls"],
        json!([{"call_id": "call_2", "name": "shell", "arguments": {"cmd": "python -m pytest"}}])
    );
    assert_eq!(plain["output_text"], "");
    assert_eq!(plain["total_tokens"], 150);
    let sent = body(&received[0]);
    assert_eq!(sent["input"], plain["sent"], "forwarded as the SDK sent it");
    assert_eq!(sent["input"][1]["encrypted_content"], "gAAAAB-enc-1");
    assert_eq!(sent["input"][3]["type"], "function_call_output");
    assert_ne!(sent["stream"], true);

    // The next turn streamed: every event typed by the SDK, the text assembled, the final
    // response read off `response.completed`.
    let streamed = &got["streamed"];
    assert_eq!(streamed["compacted"], "false");
    assert_eq!(
        streamed["events"],
        json!([
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ])
    );
    assert_eq!(streamed["deltas"], "All tests pass.");
    assert_eq!(streamed["output_text"], "All tests pass.");
    assert_eq!(streamed["status"], "completed");
    assert_eq!(streamed["total_tokens"], 150);
    let sent = body(&received[1]);
    assert_eq!(sent["stream"], true);
    assert_eq!(sent["input"], streamed["sent"]);
    // The answer's reasoning went back with its encrypted content, and the call's output.
    assert_eq!(
        sent["input"][4],
        json!({"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAAAB-enc-2"})
    );
    assert_eq!(sent["input"][5]["call_id"], "call_2");
    assert_eq!(
        sent["input"][6],
        json!({"type": "function_call_output", "call_id": "call_2", "output": "3 passed"})
    );

    // The long conversation: compacted on its way up, a normal answer on the way down.
    for (i, key, answer) in [
        (2, "compacted_plain", "Module 12 is fine."),
        (3, "compacted_streamed", "Module 11 needs tests."),
    ] {
        let call = &got[key];
        assert_eq!(call["compacted"], "true", "{key}");
        assert_eq!(call["output_text"], answer, "{key}");
        assert_eq!(call["status"], "completed", "{key}");
        let forwarded = body(&received[i]);
        assert_compacted(key, &call["sent"], &forwarded["input"]);
        assert_eq!(
            forwarded["stream"] == true,
            i == 3,
            "{key}: streamed or not"
        );
    }
    proxy.shutdown().await;
}

fn anthropic_message(id: &str, content: Value, stop: &str) -> Reply {
    Reply::json(
        200,
        &json!({
            "id": id, "type": "message", "role": "assistant", "model": "claude-sonnet-4-5-20250929",
            "content": content, "stop_reason": stop, "stop_sequence": null,
            "usage": {"input_tokens": 100, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 80, "output_tokens": 20, "service_tier": "standard"}
        }),
    )
    .with_header("request-id", &format!("req_{id}"))
}

/// A streamed message: text in two deltas, then (with `tool`) a tool use whose input arrives as
/// two `input_json_delta` pieces; `ping` events between, as Anthropic sends them.
fn anthropic_stream(id: &str, text: [&str; 2], tool: Option<(&str, [&str; 2])>) -> Reply {
    let mut events = vec![
        (
            "message_start",
            json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": "claude-sonnet-4-5-20250929",
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 120, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": 0, "output_tokens": 1}}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        ("ping", json!({"type": "ping"})),
    ];
    for t in text {
        events.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}),
        ));
    }
    events.push((
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
    ));
    if let Some((tool_id, input)) = tool {
        events.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": 1,
                   "content_block": {"type": "tool_use", "id": tool_id, "name": "bash", "input": {}}}),
        ));
        for piece in input {
            events.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1,
                       "delta": {"type": "input_json_delta", "partial_json": piece}}),
            ));
        }
        events.push((
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        ));
    }
    let stop = if tool.is_some() {
        "tool_use"
    } else {
        "end_turn"
    };
    events.push((
        "message_delta",
        json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null},
               "usage": {"output_tokens": 25}}),
    ));
    events.push(("message_stop", json!({"type": "message_stop"})));
    named_sse(&events).with_header("request-id", &format!("req_{id}"))
}

#[tokio::test]
async fn anthropic_messages() {
    let mock = MockUpstream::start().await;
    mock.push(anthropic_message(
        "msg_1",
        json!([
            {"type": "text", "text": "Running the failing ones again."},
            {"type": "tool_use", "id": "toolu_2", "name": "bash", "input": {"command": "pytest -x"}}
        ]),
        "tool_use",
    ));
    mock.push(anthropic_stream(
        "msg_2",
        ["All tests ", "pass now."],
        Some(("toolu_3", ["{\"command\": \"git", " diff\"}"])),
    ));
    mock.push(anthropic_message(
        "msg_3",
        json!([{"type": "text", "text": "Module 13 is fine."}]),
        "end_turn",
    ));
    mock.push(anthropic_stream(
        "msg_4",
        ["Module 12 ", "needs tests."],
        None,
    ));
    let proxy = TestProxy::start(&format!("{}{CONFIG}", upstream_toml(&mock.url()))).await;
    let got = run_sdk("anthropic_messages.py", &proxy.url("")).await;
    assert_pinned(&got, "anthropic");
    let received = mock.requests();
    assert_eq!(received.len(), 4, "one upstream request per SDK call");
    for r in &received {
        assert_eq!(r.method, "POST");
        assert_eq!(r.path_and_query, "/v1/messages");
        // anthropic 2.x sends the API key as a bearer token, no longer as `x-api-key`.
        assert_eq!(r.header("authorization"), Some(&*format!("Bearer {KEY}")));
        assert_eq!(r.header("x-api-key"), None);
        // The API version the SDK pins (2026-10-21 for anthropic 2.16), as the SDK sent it.
        let version = got["anthropic_version"]
            .as_str()
            .expect("the SDK's API version");
        assert_eq!(version.len(), "2023-06-01".len(), "{version}");
        assert_eq!(r.header("anthropic-version"), Some(version));
        assert!(
            r.header("user-agent")
                .is_some_and(|ua| ua.starts_with("Anthropic/Python")),
            "{:?}",
            r.header("user-agent")
        );
        let sent = body(r);
        assert_eq!(sent["model"], "claude-sonnet-4-5");
        assert_eq!(sent["max_tokens"], 1024);
        // System as blocks, the cache marker on the second one, untouched even when compacted.
        assert_eq!(sent["system"].as_array().map(Vec::len), Some(2));
        assert_eq!(
            sent["system"][1]["cache_control"],
            json!({"type": "ephemeral"})
        );
        assert_eq!(sent["tools"][0]["name"], "bash");
    }

    // A tool loop turn: text and tool use parsed, usage with the cache read, the request id.
    let plain = &got["plain"];
    assert_eq!(plain["compacted"], "false");
    assert_eq!(plain["request_id"], "req_msg_1");
    assert_eq!(plain["id"], "msg_1");
    assert_eq!(
        plain["content"],
        json!([
            {"type": "text", "text": "Running the failing ones again."},
            {"type": "tool_use", "id": "toolu_2", "name": "bash", "input": {"command": "pytest -x"}}
        ])
    );
    assert_eq!(plain["stop_reason"], "tool_use");
    assert_eq!(
        plain["usage"],
        json!({"input_tokens": 100, "output_tokens": 20, "cache_read_input_tokens": 80})
    );
    let sent = body(&received[0]);
    assert_eq!(
        sent["messages"], plain["sent"],
        "forwarded as the SDK sent it"
    );
    assert_eq!(sent["messages"][2]["content"][0]["tool_use_id"], "toolu_1");
    assert_ne!(sent["stream"], true);

    // The next turn through `messages.stream`: the text stream, and the final message with the
    // tool input assembled from its JSON pieces.
    let streamed = &got["streamed"];
    assert_eq!(streamed["compacted"], "false");
    assert_eq!(streamed["request_id"], "req_msg_2");
    assert_eq!(streamed["text"], "All tests pass now.");
    assert_eq!(streamed["id"], "msg_2");
    assert_eq!(
        streamed["content"],
        json!([
            {"type": "text", "text": "All tests pass now."},
            {"type": "tool_use", "id": "toolu_3", "name": "bash", "input": {"command": "git diff"}}
        ])
    );
    assert_eq!(streamed["stop_reason"], "tool_use");
    assert_eq!(
        streamed["usage"],
        json!({"input_tokens": 120, "output_tokens": 25})
    );
    let sent = body(&received[1]);
    assert_eq!(sent["stream"], true);
    assert_eq!(sent["messages"], streamed["sent"]);
    assert_eq!(sent["messages"][3]["content"][1]["id"], "toolu_2");
    assert_eq!(sent["messages"][4]["content"][0]["tool_use_id"], "toolu_2");

    // The long conversation: compacted on its way up, a normal answer on the way down.
    for (i, key, answer) in [
        (2, "compacted_plain", "Module 13 is fine."),
        (3, "compacted_streamed", "Module 12 needs tests."),
    ] {
        let call = &got[key];
        assert_eq!(call["compacted"], "true", "{key}");
        assert_eq!(
            call["content"],
            json!([{"type": "text", "text": answer}]),
            "{key}"
        );
        assert_eq!(call["stop_reason"], "end_turn", "{key}");
        let forwarded = body(&received[i]);
        assert_compacted(key, &call["sent"], &forwarded["messages"]);
        assert_eq!(forwarded["messages"][0]["role"], "user", "{key}");
        assert_eq!(
            forwarded["stream"] == true,
            i == 3,
            "{key}: streamed or not"
        );
    }
    proxy.shutdown().await;
}
