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
    assert!(out.status.success(), "{script} failed: {}\n{stderr}", out.status);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{script} printed no JSON ({e}): {}\n{stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
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

/// Checks that `forwarded` is `sent` compacted: fewer items, one carrying the summary, the last
/// one (the user's latest turn) verbatim.
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
    let summaries = forwarded
        .iter()
        .filter(|m| texts(m).iter().any(|t| t.starts_with(SUMMARY_INTRO)))
        .count();
    assert_eq!(summaries, 1, "{what}: one summary in {forwarded:#?}");
    assert_eq!(forwarded.last(), sent.last(), "{what}: the latest turn verbatim");
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
    assert_eq!(sent["messages"], plain["sent"], "forwarded as the SDK sent it");
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
        assert_eq!(forwarded["stream"] == true, i == 3, "{key}: streamed or not");
    }
    proxy.shutdown().await;
}
