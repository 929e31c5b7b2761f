//! The engine's rules seen through the whole request flow: triggers, fail-open paths, the
//! person's latest words pinned, and fixtures replayed through the pipeline.
use super::*;
use crate::compaction::engine::{LATEST_USER_CLOSE, LATEST_USER_OPEN};
use crate::testing::{
    body, caller, chat, check_openai_pairing, compactions, compactor, config, messages_of,
    FakeSummarizer, Reply, SMALL,
};
use serde_json::{json, Value};
use std::time::Instant;

/// An agent run: one task, then tool calls and their results only.
fn agent_run(from: usize, rounds: usize) -> Vec<Value> {
    let mut m = Vec::new();
    for i in from..from + rounds {
        let id = format!("call_{i}");
        m.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": id,
            "type": "function", "function": {"name": "bash",
            "arguments": format!("{{\"command\": \"cat f{i}.rs\"}}")}}]}),
        );
        m.push(json!({"role": "tool", "tool_call_id": id, "content": "x".repeat(60)}));
    }
    m
}

#[test]
fn process_is_send_so_the_proxy_can_await_it_anywhere() {
    fn assert_send<T: Send>(_: &T) {}
    let (c, _) = compactor(&config(""), FakeSummarizer::text("s"));
    let caller = caller();
    let fut = c.process(DialectKind::ChatCompletions, b"{}", &caller);
    assert_send(&fut);
}

#[tokio::test]
async fn the_latest_user_turn_is_kept_verbatim_when_its_turn_is_compacted() {
    let fake = FakeSummarizer::text("Work so far.");
    let (c, _) = compactor(&config(SMALL), fake);
    // The opening (before the model's first reply) is kept verbatim; the task comes in the
    // person's next turn, which is compacted.
    let task = "TASK: fix the parser in src/p.rs";
    let mut m = vec![
        json!({"role": "system", "content": "You are an agent."}),
        json!({"role": "user", "content": "hello"}),
        json!({"role": "assistant", "content": "Hello. What shall I do?"}),
        json!({"role": "user", "content": task}),
    ];
    m.extend(agent_run(0, 8));
    let pin = format!("{LATEST_USER_OPEN}\n{task}\n{LATEST_USER_CLOSE}");

    let out = c
        .process(
            DialectKind::ChatCompletions,
            &body("tiny", m.clone()),
            &caller(),
        )
        .await;
    let Outcome::Rewritten {
        body: b, result, ..
    } = out
    else {
        panic!("expected a rewrite, got {out:?}");
    };
    let sent = messages_of(&b);
    assert_eq!(sent[1], m[1], "the opening is kept");
    assert!(
        sent[3..].iter().all(|x| x["content"] != task),
        "the task message itself was compacted"
    );
    let summary = sent[2]["content"].as_str().expect("summary text");
    assert!(summary.contains(&pin), "{summary}");
    assert!(result.summary.contains(&pin));

    // The next compaction of the conversation no longer sees the task (it is spliced
    // away), and still carries it, exactly once.
    m.extend(agent_run(8, 8));
    let out = c
        .process(DialectKind::ChatCompletions, &body("tiny", m), &caller())
        .await;
    let Outcome::Rewritten { result, .. } = out else {
        panic!("expected a second compaction, got {out:?}");
    };
    assert_eq!(result.compaction_num, 2);
    assert_eq!(
        result.summary.matches(LATEST_USER_OPEN).count(),
        1,
        "{}",
        result.summary
    );
    assert!(result.summary.contains(&pin));
}

#[tokio::test]
async fn below_both_triggers_nothing_happens() {
    let fake = FakeSummarizer::text("S");
    let (c, metrics) = compactor(&config(SMALL), fake.clone());
    let out = c
        .process(
            DialectKind::ChatCompletions,
            &body("tiny", chat(4)),
            &caller(),
        )
        .await;
    assert!(matches!(out, Outcome::Unchanged));
    assert!(fake.requests().is_empty());
    assert_eq!(metrics.request_tokens_estimated.get_sample_count(), 1);
    assert_eq!(metrics.compaction_duration.get_sample_count(), 0);
}

#[tokio::test]
async fn message_trigger_rewrites_and_counts() {
    let fake = FakeSummarizer::text("The user chatted.");
    let (c, metrics) = compactor(&config(SMALL), fake.clone());
    let original = chat(12);
    let out = c
        .process(
            DialectKind::ChatCompletions,
            &body("tiny", original.clone()),
            &caller(),
        )
        .await;
    let Outcome::Rewritten {
        body,
        result,
        trigger,
    } = out
    else {
        panic!("expected a rewrite, got {out:?}");
    };
    assert_eq!(trigger, Trigger::Messages);
    assert_eq!(result.summary, "The user chatted.");
    assert_eq!(result.compaction_num, 1);
    assert!(result.post_tokens < result.pre_tokens);
    let messages = messages_of(&body);
    assert_eq!(messages[0], original[0], "system prompt kept");
    assert_eq!(messages[1], original[1], "the opening kept");
    assert_eq!(messages[2]["role"], "user");
    let summary = messages[2]["content"].as_str().expect("string");
    assert!(summary.starts_with(crate::compaction::prompt::SUMMARY_INTRO));
    assert!(summary.contains("The user chatted."));
    let tail = &messages[3..];
    assert_eq!(
        tail,
        &original[original.len() - tail.len()..],
        "tail verbatim"
    );
    assert!(messages.len() <= 10);
    assert_eq!(compactions(&metrics, "messages", "compacted"), 1);
    assert_eq!(
        metrics.tokens_saved.get(),
        (result.pre_tokens - result.post_tokens) as u64
    );
    assert_eq!(metrics.compaction_duration.get_sample_count(), 1);
    let requests = fake.requests();
    assert_eq!(requests.len(), 1);
    assert!(requests[0].prompt.contains("<user>\nmessage 2 "));
    assert!(
        !requests[0].prompt.contains("message 0 "),
        "the opening is kept, not summarised"
    );
    assert_eq!(requests[0].compaction_num, 1);
    assert_eq!(requests[0].model.as_deref(), Some("tiny"));
}

#[tokio::test]
async fn token_trigger_uses_the_models_window_and_reserved_output() {
    let fake = FakeSummarizer::text("short");
    let (c, metrics) = compactor(&config(SMALL), fake.clone());
    // 6 messages of ~200 tokens: 1,200 ≥ 0.85 × 1,000.
    let messages: Vec<Value> = (0..6)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": "y".repeat(800)})
        })
        .collect();
    let out = c
        .process(
            DialectKind::ChatCompletions,
            &body("tiny", messages.clone()),
            &caller(),
        )
        .await;
    assert!(
        matches!(
            out,
            Outcome::Rewritten {
                trigger: Trigger::Tokens,
                ..
            }
        ),
        "{out:?}"
    );
    assert_eq!(compactions(&metrics, "tokens", "compacted"), 1);

    // The same request for an unknown model (128k default window) is left alone...
    let out = c
        .process(
            DialectKind::ChatCompletions,
            &body("other", messages[..2].to_vec()),
            &caller(),
        )
        .await;
    assert!(matches!(out, Outcome::Unchanged));
    // ...and a small one trips the trigger once its output reservation is counted.
    let b = json!({"model": "tiny", "max_completion_tokens": 400, "messages": messages[..4]});
    let out = c
        .process(
            DialectKind::ChatCompletions,
            b.to_string().as_bytes(),
            &caller(),
        )
        .await;
    assert!(
        matches!(
            out,
            Outcome::Rewritten {
                trigger: Trigger::Tokens,
                ..
            }
        ),
        "{out:?}"
    );
}

#[tokio::test]
async fn summarizer_failures_forward_the_original() {
    for (reply, outcome) in [(Reply::Error, "failed"), (Reply::Blank, "blank")] {
        let fake = FakeSummarizer::new(vec![reply]);
        let (c, metrics) = compactor(&config(SMALL), fake);
        let out = c
            .process(
                DialectKind::ChatCompletions,
                &body("tiny", chat(12)),
                &caller(),
            )
            .await;
        assert!(matches!(out, Outcome::Failed));
        assert_eq!(compactions(&metrics, "messages", outcome), 1, "{outcome}");
        assert_eq!(metrics.tokens_saved.get(), 0);
    }
}

#[tokio::test]
async fn a_hanging_summarizer_times_out() {
    let fake = FakeSummarizer::new(vec![Reply::Hang]);
    let cfg = config(&format!("{SMALL}[summarizer]\ntimeout_secs = 0.05\n"));
    let (c, metrics) = compactor(&cfg, fake);
    let started = Instant::now();
    let out = c
        .process(
            DialectKind::ChatCompletions,
            &body("tiny", chat(12)),
            &caller(),
        )
        .await;
    assert!(matches!(out, Outcome::Failed));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(compactions(&metrics, "messages", "failed"), 1);
}

#[tokio::test]
async fn bodies_it_does_not_understand_pass_through_uncounted() {
    let fake = FakeSummarizer::text("S");
    let (c, metrics) = compactor(&config(SMALL), fake.clone());
    for b in [
        &b"not json"[..],
        b"{\"model\":\"tiny\"}",
        b"[1,2]",
        b"{\"messages\": 5}",
    ] {
        let out = c.process(DialectKind::ChatCompletions, b, &caller()).await;
        assert!(matches!(out, Outcome::Unchanged));
    }
    let big = body("tiny", chat(40));
    // A `developer` role is no Messages role (a `system` one is: a system turn); a Chat body
    // has no Responses `input`.
    let mut developer = chat(40);
    developer[0]["role"] = json!("developer");
    for (d, b) in [
        (DialectKind::Messages, body("tiny", developer)),
        (DialectKind::Responses, big.clone()),
    ] {
        assert!(matches!(
            c.process(d, &b, &caller()).await,
            Outcome::Unchanged
        ));
    }
    let disabled = config("[compaction]\nenabled = false\nmax_messages = 10\n");
    let (off, _) = compactor(&disabled, fake.clone());
    assert!(matches!(
        off.process(DialectKind::ChatCompletions, &big, &caller())
            .await,
        Outcome::Unchanged
    ));
    assert!(fake.requests().is_empty());
    assert_eq!(compactions(&metrics, "messages", "failed"), 0);
}

#[tokio::test]
async fn an_unknown_role_fails_open_and_counts() {
    let fake = FakeSummarizer::text("S");
    let (c, metrics) = compactor(&config(SMALL), fake);
    let mut m = chat(12);
    m[3] = json!({"role": "narrator", "content": "?"});
    let out = c
        .process(DialectKind::ChatCompletions, &body("tiny", m), &caller())
        .await;
    assert!(matches!(out, Outcome::Failed));
    assert_eq!(compactions(&metrics, "messages", "failed"), 1);
}

#[tokio::test]
async fn a_summary_that_would_grow_the_request_is_not_used() {
    let fake = FakeSummarizer::text(&"long ".repeat(2_000));
    let (c, metrics) = compactor(&config(SMALL), fake);
    let out = c
        .process(
            DialectKind::ChatCompletions,
            &body("tiny", chat(12)),
            &caller(),
        )
        .await;
    assert!(matches!(out, Outcome::Failed));
    assert_eq!(compactions(&metrics, "messages", "failed"), 1);
}

#[tokio::test]
async fn nothing_to_compact_is_a_failure() {
    let fake = FakeSummarizer::text("S");
    let (c, metrics) = compactor(&config(SMALL), fake.clone());
    let m = vec![
        json!({"role": "system", "content": "s"}),
        json!({"role": "user", "content": "z".repeat(5_000)}),
    ];
    let out = c
        .process(DialectKind::ChatCompletions, &body("tiny", m), &caller())
        .await;
    assert!(matches!(out, Outcome::Failed));
    assert_eq!(compactions(&metrics, "tokens", "failed"), 1);
    assert!(fake.requests().is_empty());
}

#[tokio::test]
async fn fixture_replay_keeps_every_rewrite_valid() {
    let fixtures = [
        include_str!("../../tests/fixtures/transcripts/swe-agent-function-calling-simple.json"),
        include_str!(
            "../../tests/fixtures/transcripts/swe-agent-marshmallow-function-calling.json"
        ),
        include_str!("../../tests/fixtures/transcripts/swe-agent-ctf-katy.json"),
        include_str!("../../tests/fixtures/transcripts/swe-agent-ctf-web.json"),
    ];
    let cfg = config(
        "[compaction]\nstrategy = \"summarize\"\nmax_messages = 6\nmin_preserve_tokens = 50\n\
         max_preserve_tokens = 400\n",
    );
    let fake = FakeSummarizer::text("Summary of the work so far.");
    let (c, metrics) = compactor(&cfg, fake.clone());
    let (mut rewritten, mut reused) = (0, 0);
    let mut max_num = 0;
    for fixture in fixtures {
        let v: Value = serde_json::from_str(fixture).expect("fixture");
        let all = v["messages"].as_array().cloned().expect("messages");
        for n in 2..=all.len() {
            if all[n - 1]["role"] == "assistant" {
                continue; // a client sends a request after a user turn or tool results
            }
            let req = body("gpt-4o", all[..n].to_vec());
            let outcome = c
                .process(DialectKind::ChatCompletions, &req, &caller())
                .await;
            // The agent's turn outlasts a summary made ahead (a request sent while one is
            // being made goes on uncompacted, below the wait threshold).
            c.background_idle().await;
            match outcome {
                Outcome::Rewritten { body, result, .. } => {
                    rewritten += 1;
                    max_num = max_num.max(result.compaction_num);
                    let out = messages_of(&body);
                    check_openai_pairing(&out).unwrap_or_else(|e| panic!("n={n}: {e}"));
                    assert_eq!(out[..2], all[..2], "system prompt and opening kept");
                    let tail = &out[3..];
                    assert_eq!(tail, &all[n - tail.len()..n]);
                    assert!(result.post_tokens < result.pre_tokens);
                }
                // A later step of the same conversation reuses the stored summary.
                Outcome::Reused { body, result } => {
                    reused += 1;
                    let out = messages_of(&body);
                    check_openai_pairing(&out).unwrap_or_else(|e| panic!("n={n}: {e}"));
                    assert_eq!(out[..2], all[..2], "system prompt and opening kept");
                    let tail = &out[3..];
                    assert_eq!(tail, &all[n - tail.len()..n]);
                    assert!(result.post_tokens < result.pre_tokens);
                }
                Outcome::Unchanged => assert!(n <= 7, "n={n} should trigger"),
                Outcome::Failed => panic!("n={n} failed"),
                Outcome::Masked { .. } => panic!("n={n}: `summarize` masked outputs"),
            }
        }
    }
    assert!(
        rewritten >= 4 && reused >= 4,
        "{rewritten} rewritten, {reused} reused"
    );
    // Later compactions of a conversation refine the stored summary.
    assert!(max_num >= 3, "compaction numbers reached only {max_num}");
    let requests = fake.requests();
    assert!(requests.iter().filter(|r| r.compaction_num > 1).all(|r| r
        .prior_summary
        .as_deref()
        .is_some_and(|p| p.starts_with("Summary of the work so far."))));
    // Summaries made ahead count as compactions too.
    assert_eq!(
        compactions(&metrics, "messages", "compacted"),
        rewritten + metrics.background_counted(BackgroundOutcome::Stored)
    );
}

/// A transcript fixture: its messages.
#[derive(serde::Deserialize)]
struct Fixture {
    messages: Vec<Value>,
}

/// Parses a fixture through the Chat Completions dialect and tracks every message.
fn track_fixture(json: &str) -> (Vec<String>, Vec<String>) {
    let fixture: Fixture = serde_json::from_str(json).expect("fixture parses");
    let body = serde_json::json!({"model": "gpt-4o", "messages": fixture.messages}).to_string();
    let parsed = DialectKind::ChatCompletions
        .parse(body.as_bytes())
        .expect("chat parses");
    let transcript = &parsed.transcript;
    let mut t = crate::compaction::files::FileTracker::new();
    for m in &transcript.messages {
        t.observe_message(m);
    }
    (t.read_files().to_vec(), t.modified_files().to_vec())
}

#[test]
fn swe_agent_function_calling_fixtures_are_tracked() {
    let (read, modified) = track_fixture(include_str!(
        "../../tests/fixtures/transcripts/swe-agent-function-calling-simple.json"
    ));
    assert_eq!(read, s(&["tests/missing_colon.py"]));
    assert_eq!(
        modified,
        s(&["tests/missing_colon.py"]),
        "edit applies to the open file"
    );

    let (read, modified) = track_fixture(include_str!(
        "../../tests/fixtures/transcripts/swe-agent-marshmallow-function-calling.json"
    ));
    assert_eq!(read, s(&["src/marshmallow/fields.py"]));
    assert_eq!(modified, s(&["reproduce.py", "src/marshmallow/fields.py"]));
}

#[test]
fn swe_agent_text_mode_fixtures_are_tracked() {
    let (read, modified) = track_fixture(include_str!(
        "../../tests/fixtures/transcripts/swe-agent-ctf-katy.json"
    ));
    assert!(read.is_empty(), "{read:?}");
    assert_eq!(
        modified,
        s(&[
            "recover_flag.py",
            "get_seed.py",
            "retrieve_random_numbers.py",
        ])
    );
    let (_, modified) = track_fixture(include_str!(
        "../../tests/fixtures/transcripts/swe-agent-ctf-web.json"
    ));
    assert_eq!(modified, s(&["printenv.pl"]));
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// Files read and modified through Codex's tools (shell, `apply_patch`, local shell), as the
/// Responses dialect reads them and the file tracker lists them.
#[test]
fn codex_tool_calls_are_tracked_as_files() {
    let body = json!({"model": "gpt-5-codex", "input": [
        {"type": "function_call", "call_id": "call_1", "name": "shell",
         "arguments": "{\"command\":[\"cat\",\"a.rs\"]}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "fn a() {}"},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch",
         "input": "*** Begin Patch\n*** Add File: b.rs\n+x\n*** End Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "ok"},
        {"type": "local_shell_call", "call_id": "call_3", "status": "completed",
         "action": {"type": "exec", "command": ["bash", "-lc", "rm c.rs"]}},
        {"type": "local_shell_call_output", "call_id": "call_3", "output": ""},
        {"role": "user", "content": "next?"}
    ]})
    .to_string();
    let parsed = DialectKind::Responses
        .parse(body.as_bytes())
        .expect("a Responses body");
    let mut files = crate::compaction::files::FileTracker::new();
    parsed
        .transcript
        .messages
        .iter()
        .for_each(|m| files.observe_message(m));
    assert_eq!(files.read_files(), ["a.rs".to_string()]);
    assert_eq!(
        files.modified_files(),
        ["c.rs".to_string(), "b.rs".to_string()],
        "most recent first"
    );
}

/// Codex after a remote compaction sends the provider's sealed summary (a `compaction` item,
/// its history encrypted) among its input. compactor cannot read it into its own summary, so a
/// compaction keeps it, and everything before it, as sent, and summarises only what follows.
#[tokio::test]
async fn a_provider_compaction_item_is_kept_with_everything_before_it() {
    let fake = FakeSummarizer::text("S");
    let (c, metrics) = compactor(&config(SMALL), fake.clone());
    let sealed = "Q".repeat(64);
    let mut input = vec![
        json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix the parser"}]}),
        json!({"type": "compaction", "id": "cmp_1", "encrypted_content": sealed}),
    ];
    for i in 0..12 {
        input.push(
            json!({"type": "function_call", "call_id": format!("c{i}"), "name": "shell",
                          "arguments": format!("{{\"command\":[\"cat\",\"f{i}.rs\"]}}")}),
        );
        input.push(
            json!({"type": "function_call_output", "call_id": format!("c{i}"),
                          "output": format!("line {i} ").repeat(8)}),
        );
    }
    input.push(json!({"role": "user", "content": "and the tests?"}));
    let body = json!({"model": "tiny", "input": input, "store": false}).to_string();
    let out = c
        .process(DialectKind::Responses, body.as_bytes(), &caller())
        .await;
    let Outcome::Rewritten { body: out, .. } = out else {
        panic!("compacted: {out:?}");
    };
    let sent: Value = serde_json::from_slice(&out).expect("JSON");
    let sent = sent["input"].as_array().expect("input");
    assert_eq!(
        sent[..2],
        input[..2],
        "the sealed summary and what precedes it, as sent"
    );
    assert_eq!(sent[2]["role"], "user", "then compactor's summary");
    assert!(sent.len() < input.len());
    assert_eq!(sent.last(), input.last());
    let prompt = &fake.requests()[0].prompt;
    assert!(
        !prompt.contains(&sealed),
        "the sealed summary is not summarised"
    );
    assert!(prompt.contains("f0.rs"), "what follows it is");
    assert_eq!(compactions(&metrics, "messages", "compacted"), 1);
}

/// A request enabling its model's long context (Anthropic's `context-1m`) is measured against
/// that window, but the summarizer's call does not carry the flag: its prompt and summary fit
/// the model's usual window.
#[tokio::test]
async fn a_long_context_request_is_summarised_within_the_usual_window() {
    let toml = "[compaction]\nmax_messages = 1000\nmin_preserve_tokens = 20\n\
                max_preserve_tokens = 200\n[models]\n\"tiny\" = { context_window = 1000 }\n\
                \"tiny[1m]\" = { context_window = 4000 }\n";
    let fake = FakeSummarizer::text("S");
    let (c, _) = compactor(&config(toml), fake.clone());
    let mut messages = Vec::new();
    for i in 0..61 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages
            .push(json!({"role": role, "content": format!("turn {i}: {}", "word ".repeat(60))}));
    }
    let body = json!({"model": "tiny", "max_tokens": 10, "messages": messages}).to_string();
    let caller = caller();
    let context = RequestContext {
        caller: &caller,
        session_header: None,
        long_context: true,
        attempts: &Attempts::per_request(),
        mode: None,
    };
    let processed = c
        .handle(DialectKind::Messages, &Bytes::from(body), &context)
        .await;
    assert!(
        matches!(processed.outcome, Outcome::Rewritten { .. }),
        "over the long window's trigger: {:?}",
        processed.outcome
    );
    let asked = &fake.requests()[0];
    assert!(
        asked.max_output_tokens <= 250,
        "a quarter of the usual window at most"
    );
    let prompt_tokens = crate::estimate::LazyEstimator::default().text(&asked.prompt);
    assert!(
        prompt_tokens <= 1000,
        "the prompt fits the usual window: {prompt_tokens} tokens"
    );
}

/// An agent's session in a 4,000-token window: a long opening (project rules and the task),
/// six tool rounds, then one last tool output of `lines` lines of code.
fn opening_session(lines: usize) -> Vec<Value> {
    let output: String = (0..lines)
        .map(|i| format!("{i}: let value_{i} = compute(input_{i}, {i});\n"))
        .collect();
    let mut m = vec![
        json!({"role": "system", "content": "You are an agent."}),
        json!({"role": "user", "content": format!("RULE-PURPLE: answer in lowercase. {}Fix the parser.", "Project rules. ".repeat(200))}),
    ];
    m.extend(agent_run(0, 6));
    m.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_last",
        "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"cat big.rs\"}"}}]}));
    m.push(json!({"role": "tool", "tool_call_id": "call_last", "content": output}));
    m
}

#[tokio::test]
async fn the_opening_is_kept_verbatim_unless_it_cannot_fit_beside_the_smallest_tail() {
    let toml = "[compaction]\nstrategy = \"summarize\"\nmax_messages = 10\n\
                background_ratio = 0\n[models.w4k]\ncontext_window = 4000\n";
    let send = |c: Arc<Pipeline>, m: Vec<Value>| async move {
        c.process(DialectKind::ChatCompletions, &body("w4k", m), &caller())
            .await
    };

    // Room for it: the opening (about 800 tokens) stays verbatim, the summarizer never sees it.
    let fake = FakeSummarizer::text("Work so far.");
    let (c, _) = compactor(&config(toml), fake.clone());
    let m = opening_session(10);
    let out = send(c.clone(), m.clone()).await;
    let Outcome::Rewritten { body: b, .. } = out else {
        panic!("expected a rewrite, got {out:?}");
    };
    let sent = messages_of(&b);
    assert_eq!(sent[..2], m[..2], "system prompt and opening verbatim");
    assert!(sent[2]["content"]
        .as_str()
        .is_some_and(|s| s.starts_with(crate::compaction::prompt::SUMMARY_INTRO)));
    assert!(!fake.requests()[0].prompt.contains("RULE-PURPLE"));

    // A last output of about 2,000 tokens: with the opening, even the smallest tail leaves the
    // rewrite over the trigger (3,400), so the opening is summarised and the request fits.
    let fake = FakeSummarizer::text("Work so far.");
    let (c, _) = compactor(&config(toml), fake.clone());
    let mut m = opening_session(120);
    let out = send(c.clone(), m.clone()).await;
    let Outcome::Rewritten {
        body: b, result, ..
    } = out
    else {
        panic!("expected a rewrite, got {out:?}");
    };
    let sent = messages_of(&b);
    assert_eq!(sent[0], m[0]);
    assert!(
        sent[1]["content"]
            .as_str()
            .is_some_and(|s| s.starts_with(crate::compaction::prompt::SUMMARY_INTRO)),
        "the summary follows the system prompt: {:?}",
        sent[1]
    );
    assert!(fake.requests()[0].prompt.contains("RULE-PURPLE"));
    assert!(result.post_tokens < 3_400, "{}", result.post_tokens);
    // The next request splices that summary after the same head: the opening is not added
    // back beside the summary that holds it.
    m.push(json!({"role": "assistant", "content": "Done."}));
    m.push(json!({"role": "user", "content": "thanks"}));
    let out = send(c.clone(), m.clone()).await;
    let Outcome::Reused { body: b, .. } = out else {
        panic!("expected the stored summary reused, got {out:?}");
    };
    let sent = messages_of(&b);
    assert!(sent[1]["content"]
        .as_str()
        .is_some_and(|s| s.starts_with(crate::compaction::prompt::SUMMARY_INTRO)));
    assert!(
        sent.iter().all(|x| x != &m[1]),
        "the opening is not forwarded twice"
    );
}
