//! The `compactor compact` command: the real binary run over real transcripts with the
//! `extractive` summarizer. stdout is the request with a summary, as the `summarize` strategy
//! makes it for a conversation's first request (smaller, valid, tail verbatim; the original
//! bytes when nothing triggers), stderr names the trigger, the token
//! estimates, the boundary and the summary; invalid input exits non-zero with a clear message.

mod support;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use serde_json::{json, Value};

use support::provider_rules::check_chat;

/// Small limits so the fixtures trigger, and a summarizer that needs no network (the default
/// of `compact` too: the configured backend is used only when `--summarizer` names it).
const CONFIG: &str = "[compaction]\nmax_messages = 10\nmin_preserve_tokens = 50\n\
                      max_preserve_tokens = 400\n[summarizer]\nbackend = \"extractive\"\n";

/// `{"model": "gpt-4o", "messages": <the fixture's messages>}`.
fn fixture_request(name: &str) -> Value {
    json!({"model": "gpt-4o", "messages": support::transcript(name)})
}

/// Runs `compactor <args>` in `dir` (no `COMPACTOR_*` variables) with `stdin` piped in.
fn compactor(dir: &Path, args: &[&str], stdin: &[u8]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_compactor"));
    command
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, _) in std::env::vars() {
        if key.starts_with("COMPACTOR_") || key == "RUST_LOG" {
            command.env_remove(key);
        }
    }
    let mut child = command.spawn().expect("spawn compactor");
    let mut pipe = child.stdin.take().expect("stdin");
    pipe.write_all(stdin).expect("write stdin");
    drop(pipe);
    child.wait_with_output().expect("compactor output")
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write file");
    path.display().to_string()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The number after `label` on the stderr line starting with `line`.
fn number_after(text: &str, line: &str, label: &str) -> usize {
    let l = text
        .lines()
        .find(|l| l.starts_with(line))
        .unwrap_or_else(|| panic!("no `{line}` line in:\n{text}"));
    let rest = &l[l
        .find(label)
        .unwrap_or_else(|| panic!("no `{label}` in {l}"))
        + label.len()..];
    let digits: String = rest
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no number after `{label}` in {l}"))
}

/// The fixture whose one task message outweighs everything after it.
const TASK_DOMINATED: &str = "swe-agent-function-calling-simple.json";

#[test]
fn every_fixture_is_compacted_into_a_smaller_valid_request_with_a_verbatim_tail() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(dir.path(), "compactor.toml", CONFIG.as_bytes());
    for name in support::TRANSCRIPTS {
        let request = fixture_request(name);
        let original = request["messages"].as_array().expect("messages").clone();
        let bytes = serde_json::to_vec_pretty(&request).expect("serialise");
        let file = write(dir.path(), "request.json", &bytes);

        let out = compactor(dir.path(), &["compact", "--config", &config, &file], b"");
        let err = stderr(&out);
        assert!(out.status.success(), "{name}: {err}");

        let forwarded: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{name}: stdout is not JSON ({e}):\n{err}"));
        assert!(out.stdout.len() < bytes.len(), "{name}: not smaller");
        assert_eq!(forwarded["model"], "gpt-4o", "{name}");
        let messages = forwarded["messages"].as_array().expect("messages");
        assert!(messages.len() < original.len(), "{name}");
        assert!(messages.len() <= 10, "{name}: {} messages", messages.len());
        check_chat(&forwarded, usize::MAX).unwrap_or_else(|e| panic!("{name}: {e:?}"));
        // The system prompt and the task (the opening, before the model's first reply) are
        // kept verbatim, even where the task outweighs everything after it.
        assert_eq!(
            messages[..2],
            original[..2],
            "{name}: system prompt and task first"
        );
        assert_eq!(messages[2]["role"], "user", "{name}");
        let summary = messages[2]["content"].as_str().expect("summary text");
        assert!(summary.contains("1. Primary Request and Intent"), "{name}");
        let tail = &messages[3..];
        assert!(!tail.is_empty(), "{name}: a tail is kept");
        // At least the latest user turn is kept: in the head or the tail, or verbatim in the
        // summary.
        let last_user = original
            .iter()
            .rev()
            .find(|m| m["role"] == "user")
            .expect("a user turn");
        if !messages.contains(last_user) {
            let text = last_user["content"].as_str().expect("text").trim();
            let pinned = format!("<latest-user-message>\n{text}\n</latest-user-message>");
            assert!(
                summary.contains(&pinned),
                "{name}: latest user turn neither kept nor pinned"
            );
        }
        assert_eq!(
            tail,
            &original[original.len() - tail.len()..],
            "{name}: tail verbatim"
        );

        // stderr: trigger, both estimates, the boundary and the summary itself.
        assert!(err.contains("trigger: messages\n"), "{name}: {err}");
        let pre = number_after(&err, "tokens:", "tokens:");
        let post = number_after(&err, "tokens:", "->");
        assert!(post < pre, "{name}: {err}");
        assert_eq!(
            number_after(&err, "boundary:", "boundary:"),
            original.len() - 2 - tail.len(),
            "{name}: compacted count: {err}"
        );
        assert_eq!(
            number_after(&err, "boundary:", "compacted,"),
            2 + tail.len(),
            "{name}: kept count: {err}"
        );
        let printed = err
            .split_once("summary:\n")
            .unwrap_or_else(|| panic!("{name}: no summary in {err}"))
            .1;
        assert!(
            printed.starts_with("(Summary of compaction #1"),
            "{name}: {err}"
        );
        assert!(
            summary.contains(printed.trim_end()),
            "{name}: the printed summary is the one in the request"
        );
    }
}

#[test]
fn the_token_trigger_uses_the_configured_window() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Messages no longer trigger; a 6,000-token window (threshold 0.85 × 6,000 = 5,100) does.
    let config = write(
        dir.path(),
        "compactor.toml",
        format!(
            "{}[models.\"gpt-4o\"]\ncontext_window = 6000\n",
            CONFIG.replace("max_messages = 10", "max_messages = 50")
        )
        .as_bytes(),
    );
    // The marshmallow run up to its long test output: 16 messages, ~5,550 tokens.
    let mut request = fixture_request("swe-agent-marshmallow-function-calling.json");
    let first: Vec<Value> = request["messages"].as_array().expect("messages")[..16].to_vec();
    request["messages"] = Value::Array(first.clone());
    let bytes = serde_json::to_vec(&request).expect("serialise");

    let out = compactor(dir.path(), &["compact", "--config", &config], &bytes);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("trigger: tokens\n"), "{err}");
    assert!(err.contains("context window 6000"), "{err}");
    let pre = number_after(&err, "tokens:", "tokens:");
    let post = number_after(&err, "tokens:", "->");
    assert!(pre >= 5_100 && post < 5_100, "{err}");
    let forwarded: Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    check_chat(&forwarded, 6_000).unwrap_or_else(|e| panic!("{e:?}"));
    let messages = forwarded["messages"].as_array().expect("messages");
    let tail = &messages[2..];
    assert_eq!(tail, &first[first.len() - tail.len()..], "tail verbatim");
}

/// A first try as a new user makes it: the shipped summarizer default (`auto`, the caller's
/// provider) left alone, no network, no credentials. `compact` summarises locally unless told
/// otherwise, and says so.
#[test]
fn a_first_try_needs_no_network() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(
        dir.path(),
        "compactor.toml",
        b"[upstream]\nbase_url = \"http://127.0.0.1:9\"\n\
          [compaction]\nmax_messages = 10\nmin_preserve_tokens = 50\n",
    );
    let bytes = serde_json::to_vec(&fixture_request("swe-agent-ctf-katy.json")).expect("json");
    let out = compactor(dir.path(), &["compact", "--config", &config], &bytes);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(out.stdout.len() < bytes.len(), "compacted: {err}");
    assert!(err.contains("summary:"), "{err}");
}

#[test]
fn a_small_request_comes_back_byte_identical_from_stdin() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(dir.path(), "compactor.toml", CONFIG.as_bytes());
    // Odd whitespace, key order and escapes: any re-serialisation would show.
    let body = b"{ \"messages\" : [ {\"role\":\"system\",\"content\":\"be brief\"},\n\t\
                 {\"role\":\"user\", \"content\":\"caf\\u00e9?\"} ],\"model\":\"gpt-4o\",\
                 \"temperature\": 0.50 }\n";
    for args in [
        vec!["compact", "--config", config.as_str()],
        vec!["compact", "--config", config.as_str(), "-"],
    ] {
        let out = compactor(dir.path(), &args, body);
        let err = stderr(&out);
        assert!(out.status.success(), "{err}");
        assert_eq!(out.stdout, body.to_vec(), "byte-identical");
        assert!(err.contains("trigger: no trigger"), "{err}");
        assert!(err.contains("tokens: "), "{err}");
        assert!(!err.contains("summary:"), "{err}");
    }
}

#[test]
fn invalid_input_exits_non_zero_with_a_clear_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(dir.path(), "compactor.toml", CONFIG.as_bytes());
    for (body, expected) in [
        (&b"this is not json"[..], "not a Chat Completions request"),
        (b"{\"model\":\"gpt-4o\"}", "no single `messages`"),
        (b"[1, 2]", "not a Chat Completions request"),
        (
            b"{\"model\":\"gpt-4o\",\"messages\":[{\"role\":\"narrator\",\"content\":\"x\"}]}",
            "message 0: unknown role",
        ),
        (b"", "not a Chat Completions request"),
    ] {
        let out = compactor(dir.path(), &["compact", "--config", &config], body);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{body:?}: {err}");
        assert!(out.stdout.is_empty(), "{body:?}: nothing on stdout");
        assert!(err.starts_with("error: "), "{err}");
        assert!(err.contains(expected), "{body:?}: {err}");
    }
    let missing = dir.path().join("missing.json").display().to_string();
    let out = compactor(dir.path(), &["compact", "--config", &config, &missing], b"");
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("missing.json"), "{}", stderr(&out));
    let out = compactor(
        dir.path(),
        &["compact", "--config", &config, "--summarizer", "nope"],
        b"{}",
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("summarizer.backend"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_failed_compaction_prints_the_original_and_exits_2() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(
        dir.path(),
        "compactor.toml",
        "[compaction]\nmax_messages = 10\n[summarizer]\nbackend = \"exec\"\n\
         [summarizer.exec]\ncommand = \"/bin/sh\"\n\
         args = [\"-c\", \"cat >/dev/null; echo '{\\\"summary\\\": \\\"   \\\"}'\"]\n"
            .as_bytes(),
    );
    let bytes = serde_json::to_vec(&fixture_request("swe-agent-ctf-katy.json")).expect("json");
    let out = compactor(
        dir.path(),
        &["compact", "--config", &config, "--summarizer", "exec"],
        &bytes,
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(out.stdout, bytes, "the original, byte for byte");
    assert!(err.contains("trigger: messages"), "{err}");
    assert!(err.contains("compaction failed (blank)"), "{err}");
}

/// An Anthropic Messages request in Claude Code's shape (system blocks with `cache_control`,
/// user turns of blocks) and a Responses request in Codex's (input items with function calls,
/// `store: false`): `--dialect` reads each, compacts it, and forwards every field but the
/// conversation byte for byte.
#[test]
fn messages_and_responses_requests_are_compacted_with_their_dialect() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(dir.path(), "compactor.toml", CONFIG.as_bytes());
    let words = "the parser drops trailing commas in nested arrays ".repeat(12);

    let mut turns = Vec::new();
    for i in 0..8 {
        turns.push(json!({"role": "user", "content": [
            {"type": "text", "text": format!("<system-reminder>ctx {i}</system-reminder>")},
            {"type": "text", "text": format!("step {i}: {words}")}]}));
        turns.push(json!({"role": "assistant", "content": [
            {"type": "text", "text": format!("done {i}: {words}")}]}));
    }
    turns.push(json!({"role": "user", "content": "Now run the tests."}));
    let system =
        r#"[{"type":"text","text":"You are Claude Code.","cache_control":{"type":"ephemeral"}}]"#;
    let messages_body = format!(
        r#"{{"model":"claude-sonnet-4-5","max_tokens":1024,"system":{system},"messages":{}, "stream":true}}"#,
        serde_json::to_string(&turns).expect("turns")
    );

    let mut items = vec![json!({"type": "message", "role": "developer", "content": "Be brief."})];
    for i in 0..7 {
        items.push(json!({"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": format!("task {i}: {words}")}]}));
        items.push(
            json!({"type": "reasoning", "id": format!("rs_{i}"), "summary": [],
            "encrypted_content": "gAAAA".repeat(20)}),
        );
        items.push(
            json!({"type": "function_call", "call_id": format!("call_{i}"),
            "name": "shell", "arguments": "{\"command\":[\"ls\"]}"}),
        );
        items.push(
            json!({"type": "function_call_output", "call_id": format!("call_{i}"),
            "output": words.clone()}),
        );
    }
    items.push(json!({"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Summarise the failures."}]}));
    let responses_body = format!(
        r#"{{"model":"gpt-5-codex","instructions":"You are Codex.","input":{},"store":false,"include":["reasoning.encrypted_content"]}}"#,
        serde_json::to_string(&items).expect("items")
    );

    for (dialect, body, conversation, kept) in [
        (
            "messages",
            &messages_body,
            "messages",
            format!(r#""system":{system}"#),
        ),
        (
            "responses",
            &responses_body,
            "input",
            r#""store":false,"include":["reasoning.encrypted_content"]"#.to_string(),
        ),
    ] {
        let file = write(dir.path(), &format!("{dialect}.json"), body.as_bytes());
        let out = compactor(
            dir.path(),
            &["compact", "--config", &config, "--dialect", dialect, &file],
            b"",
        );
        let err = stderr(&out);
        assert!(out.status.success(), "{dialect}: {err}");
        assert!(err.contains("trigger: messages\n"), "{dialect}: {err}");
        let text = String::from_utf8(out.stdout.clone()).expect("utf-8");
        assert!(
            text.contains(&kept),
            "{dialect}: fields kept byte for byte: {text}"
        );
        let forwarded: Value = serde_json::from_str(&text).expect("stdout is JSON");
        let original: Value = serde_json::from_str(body).expect("JSON");
        let (before, after) = (
            original[conversation].as_array().expect("conversation"),
            forwarded[conversation].as_array().expect("conversation"),
        );
        assert!(after.len() < before.len(), "{dialect}: smaller");
        assert_eq!(
            after.last(),
            before.last(),
            "{dialect}: the latest turn verbatim"
        );
        match dialect {
            "messages" => support::anthropic_rules::check_messages(&forwarded, 200_000),
            _ => support::responses_rules::check_responses(&forwarded, 200_000),
        }
        .unwrap_or_else(|e| panic!("{dialect}: {e:?}"));
    }

    // A Chat Completions body is not an Anthropic Messages request (a `system` role).
    let chat = serde_json::to_vec(&fixture_request(TASK_DOMINATED)).expect("chat");
    let out = compactor(
        dir.path(),
        &["compact", "--config", &config, "--dialect", "messages"],
        &chat,
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("not an Anthropic Messages request"),
        "{}",
        stderr(&out)
    );
}
