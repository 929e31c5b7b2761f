//! Property tests of the engine and the Chat Completions dialect over random conversations
//! (tool calls, parallel tool calls answered in any order, part arrays with images, reasoning,
//! mid-conversation and leading system messages, vendor fields at every level).

use std::cell::Cell;

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};
use serde_json::value::RawValue;
use serde_json::{json, Value};

use super::Outcome;
use crate::compaction::prompt::SUMMARY_INTRO;
use crate::dialect::chat::top_level_fields;
use crate::dialect::DialectKind;
use crate::estimate::LazyEstimator;
use crate::testing::{
    caller, check_estimates, check_openai_pairing, compactor, config, ensure, expected_heads,
    FakeSummarizer, Reply, Said,
};

#[derive(Debug, Clone)]
enum Turn {
    User {
        text: String,
        as_parts: bool,
        image: bool,
    },
    Assistant {
        text: String,
        reasoning: Option<String>,
    },
    /// Assistant calls (name, args), then results (output) in `order`.
    Tools {
        text: Option<String>,
        calls: Vec<(String, String, String)>,
        order: Vec<usize>,
    },
    System(String),
}

fn text(max: usize) -> impl Strategy<Value = String> {
    proptest::string::string_regex(&format!("[a-z0-9 é日🦀\"\\\\\n]{{0,{max}}}"))
        .unwrap_or_else(|e| panic!("regex: {e}"))
}

fn turn() -> impl Strategy<Value = Turn> {
    let user =
        (text(400), any::<bool>(), any::<bool>()).prop_map(|(text, as_parts, image)| Turn::User {
            text,
            as_parts,
            image,
        });
    let assistant = (text(400), proptest::option::of(text(100)))
        .prop_map(|(text, reasoning)| Turn::Assistant { text, reasoning });
    let tools = (
        proptest::option::of(text(80)),
        proptest::collection::vec(
            (
                prop_oneof![Just("bash"), Just("read"), Just("edit"), Just("grep")],
                text(120),
                text(600),
            ),
            1..4,
        ),
    )
        .prop_flat_map(|(text, calls)| {
            let n = calls.len();
            let calls: Vec<(String, String, String)> = calls
                .into_iter()
                .map(|(name, arg, out)| (name.to_string(), json!({ "arg": arg }).to_string(), out))
                .collect();
            (
                Just(text),
                Just(calls),
                Just((0..n).collect::<Vec<usize>>()).prop_shuffle(),
            )
        })
        .prop_map(|(text, calls, order)| Turn::Tools { text, calls, order });
    prop_oneof![
        3 => user,
        3 => assistant,
        4 => tools,
        1 => text(60).prop_map(Turn::System),
    ]
}

fn extra(v: &mut Value, tag: usize) {
    if tag % 3 == 0 {
        if let Some(o) = v.as_object_mut() {
            o.insert(
                "x_vendor".into(),
                json!({"tag": tag, "list": [1, "two", null]}),
            );
        }
    }
}

/// Renders turns as Chat Completions messages; always ends on a user or tool message.
fn render(systems: &[String], turns: &[Turn]) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    for (i, s) in systems.iter().enumerate() {
        let role = if i % 2 == 0 { "system" } else { "developer" };
        out.push(json!({"role": role, "content": s, "name": format!("sys{i}")}));
    }
    let mut next_id = 0;
    for (k, t) in turns.iter().enumerate() {
        match t {
            Turn::User {
                text,
                as_parts,
                image,
            } => {
                let mut m = if *as_parts {
                    let mut parts = vec![
                        json!({"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}),
                    ];
                    if *image {
                        parts.push(json!({"type": "image_url", "image_url": {"url": "https://example.com/i.png"}}));
                    }
                    json!({"role": "user", "content": parts})
                } else {
                    json!({"role": "user", "content": text})
                };
                extra(&mut m, k);
                out.push(m);
            }
            Turn::Assistant { text, reasoning } => {
                let mut m = json!({"role": "assistant", "content": text});
                if let Some(r) = reasoning {
                    m["reasoning_content"] = json!(r);
                }
                extra(&mut m, k);
                out.push(m);
            }
            Turn::Tools { text, calls, order } => {
                let ids: Vec<String> = calls
                    .iter()
                    .map(|_| {
                        next_id += 1;
                        format!("call_{next_id}")
                    })
                    .collect();
                let tool_calls: Vec<Value> = calls
                    .iter()
                    .zip(&ids)
                    .map(|((name, args, _), id)| {
                        json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
                    })
                    .collect();
                let mut m = json!({"role": "assistant", "content": text, "tool_calls": tool_calls});
                extra(&mut m, k);
                out.push(m);
                for &j in order {
                    let mut r =
                        json!({"role": "tool", "tool_call_id": ids[j], "content": calls[j].2});
                    extra(&mut r, k + j);
                    out.push(r);
                }
            }
            Turn::System(s) => out.push(json!({"role": "system", "content": s})),
        }
    }
    let ends_well = out
        .last()
        .is_some_and(|m| m["role"] == "user" || m["role"] == "tool");
    if !ends_well {
        out.push(json!({"role": "user", "content": "continue"}));
    }
    out
}

#[derive(Debug, Clone)]
struct Case {
    systems: Vec<String>,
    turns: Vec<Turn>,
    model: &'static str,
    max_tokens: Option<u32>,
    key_order: Vec<usize>,
    max_messages: usize,
    min_preserve: usize,
    max_preserve: usize,
}

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::collection::vec(text(80), 0..3),
        proptest::collection::vec(turn(), 1..40),
        prop_oneof![Just("tiny"), Just("gpt-4o"), Just("unknown-model")],
        proptest::option::of(0u32..3_000),
        Just((0..7).collect::<Vec<usize>>()).prop_shuffle(),
        4usize..30,
        10usize..200,
        200usize..1_500,
    )
        .prop_map(
            |(
                systems,
                turns,
                model,
                max_tokens,
                key_order,
                max_messages,
                min_preserve,
                max_preserve,
            )| Case {
                systems,
                turns,
                model,
                max_tokens,
                key_order,
                max_messages,
                min_preserve,
                max_preserve,
            },
        )
}

fn request(case: &Case, messages: &[Value]) -> Vec<u8> {
    let mut fields: Vec<(&str, Value)> = vec![
        ("model", json!(case.model)),
        ("messages", json!(messages)),
        ("stream", json!(true)),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]),
        ),
        ("x_vendor_top", json!({"b": 1, "a": [true, 2.5]})),
        ("response_format", json!({"type": "text"})),
        (
            "max_tokens",
            case.max_tokens.map_or(Value::Null, |t| json!(t)),
        ),
    ];
    let mut out = String::from("{");
    for (n, &i) in case.key_order.iter().enumerate() {
        let (k, v) = std::mem::replace(&mut fields[i], ("", Value::Null));
        if n > 0 {
            out.push(',');
        }
        out.push_str(&json!(k).to_string());
        out.push(':');
        out.push_str(&v.to_string());
    }
    out.push('}');
    out.into_bytes()
}

/// A Chat Completions request valid for OpenAI (what the fuzz tests mutate).
pub(super) fn valid_request() -> impl Strategy<Value = Vec<u8>> {
    case().prop_map(|case| request(&case, &render(&case.systems, &case.turns)))
}

fn raw_messages(body: &[u8]) -> Vec<String> {
    let fields = top_level_fields(body).unwrap_or_default();
    let raw = fields
        .iter()
        .find(|(k, _)| k == "messages")
        .map(|(_, v)| v.get())
        .unwrap_or("[]");
    let list: Vec<&RawValue> = serde_json::from_str(raw).unwrap_or_default();
    list.iter().map(|r| r.get().to_string()).collect()
}

#[test]
fn rewritten_requests_stay_valid_verbatim_and_smaller() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let rewritten = Cell::new(0usize);
    let triggered = Cell::new(0usize);
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 300,
        ..ProptestConfig::default()
    });
    let result = runner.run(&case(), |case| {
        let messages = render(&case.systems, &case.turns);
        let body = request(&case, &messages);
        let cfg = config(&format!(
            "[compaction]\nstrategy = \"summarize\"\nmax_messages = {}\nmin_preserve_tokens = {}\nmax_preserve_tokens = {}\n\
             [models.tiny]\ncontext_window = 3000\n",
            case.max_messages, case.min_preserve, case.max_preserve
        ));
        let fake = FakeSummarizer::scripted(
            vec![Reply::Text("Short summary of the earlier turns.".into())],
            Some(200),
        );
        let (c, _) = compactor(&cfg, fake);
        let est = LazyEstimator::default();
        // The scan's estimate of each message is what its neutral parts hold.
        let parsed = DialectKind::ChatCompletions
            .parse(&body)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        check_estimates(&parsed, &est)?;
        let before = &parsed.scan;

        let due = c
            .engine()
            .limits(before.model.as_deref(), before.requested_output)
            .check(before.len(), before.tokens)
            .is_some();
        let outcome = rt.block_on(c.process(DialectKind::ChatCompletions, &body, &caller()));
        match outcome {
            Outcome::Reused { .. } => {
                ensure(false, "a fresh compactor has no checkpoint to reuse")?
            }
            Outcome::Masked { .. } => ensure(false, "`summarize` masked outputs")?,
            Outcome::Unchanged => ensure(!due, "due compaction reported unchanged")?,
            Outcome::Failed => {
                ensure(due, "failure without a trigger")?;
                triggered.set(triggered.get() + 1);
            }
            Outcome::Rewritten {
                body: out, result, ..
            } => {
                ensure(due, "rewrite without a trigger")?;
                triggered.set(triggered.get() + 1);
                rewritten.set(rewritten.get() + 1);
                // Top-level fields: same keys, same order, same bytes (except messages).
                let a = top_level_fields(&body).map_err(|e| TestCaseError::fail(e.to_string()))?;
                let b = top_level_fields(&out).map_err(|e| TestCaseError::fail(e.to_string()))?;
                ensure(a.len() == b.len(), "field count")?;
                for ((ka, va), (kb, vb)) in a.iter().zip(&b) {
                    ensure(ka == kb, format!("key order {ka} vs {kb}"))?;
                    if ka != "messages" {
                        ensure(va.get() == vb.get(), format!("field {ka} changed"))?;
                    }
                }
                // Messages: system head verbatim, one summary, tail verbatim.
                let orig = raw_messages(&body);
                let new = raw_messages(&out);
                let leading = messages
                    .iter()
                    .take_while(|m| m["role"] == "system" || m["role"] == "developer")
                    .count();
                let said: Vec<Said> = messages
                    .iter()
                    .map(|m| match m["role"].as_str() {
                        Some("assistant") => Said::Model,
                        Some("tool" | "function") => Said::ToolAnswer,
                        _ => Said::Client,
                    })
                    .collect();
                let budget = c
                    .engine()
                    .limits(before.model.as_deref(), before.requested_output)
                    .opening_budget;
                let is_summary = |h: usize| {
                    new.get(h)
                        .and_then(|m| serde_json::from_str::<Value>(m).ok())
                        .is_some_and(|v| {
                            v["role"] == "user"
                                && v["content"]
                                    .as_str()
                                    .is_some_and(|s| s.starts_with(SUMMARY_INTRO))
                        })
                };
                let head = expected_heads(&said, leading, before, budget)
                    .into_iter()
                    .find(|&h| is_summary(h))
                    .ok_or_else(|| TestCaseError::fail("no summary message after the head"))?;
                ensure(new.len() >= head + 2, "head + summary + tail")?;
                ensure(
                    new[..head] == orig[..head],
                    "system messages and opening kept verbatim",
                )?;
                let tail = &new[head + 1..];
                ensure(
                    tail == &orig[orig.len() - tail.len()..],
                    "tail byte-identical",
                )?;
                ensure(tail.len() < orig.len() - head, "something was compacted")?;
                // Valid for OpenAI.
                let values: Vec<Value> = new
                    .iter()
                    .map(|m| serde_json::from_str(m).unwrap_or(Value::Null))
                    .collect();
                check_openai_pairing(&values).map_err(TestCaseError::fail)?;
                // Smaller, and the reported figures are the estimates of the bodies.
                let after = DialectKind::ChatCompletions
                    .scan(&out, &est)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                ensure(
                    after.tokens == result.post_tokens,
                    "post_tokens is the rewrite's estimate",
                )?;
                ensure(
                    before.tokens == result.pre_tokens,
                    "pre_tokens is the original's estimate",
                )?;
                ensure(after.tokens < before.tokens, "rewrite is smaller")?;
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    eprintln!(
        "triggered {}, rewritten {}",
        triggered.get(),
        rewritten.get()
    );
    // The generator must exercise the interesting path, not only pass-through.
    assert!(triggered.get() > 100, "triggered {}", triggered.get());
    assert!(
        rewritten.get() * 10 > triggered.get() * 8,
        "rewritten {} of {}",
        rewritten.get(),
        triggered.get()
    );
}

/// Arbitrary JSON, with chat-like keys likely.
fn any_json() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        Just("role".to_string()),
        Just("content".to_string()),
        Just("messages".to_string()),
        Just("tool_calls".to_string()),
        Just("tool_call_id".to_string()),
        Just("type".to_string()),
        Just("function".to_string()),
        Just("arguments".to_string()),
        Just("image_url".to_string()),
        Just("model".to_string()),
        Just("max_tokens".to_string()),
        "[a-z]{1,6}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        prop_oneof![
            Just("user".to_string()),
            Just("assistant".to_string()),
            Just("tool".to_string()),
            Just("system".to_string()),
            Just("text".to_string()),
            Just("image_url".to_string()),
            ".{0,20}"
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(5, 200, 12, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..12).prop_map(Value::from),
            proptest::collection::vec((key.clone(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Whatever arrives, `process` answers (no panic) and never rewrites what it cannot read.
    #[test]
    fn process_never_panics_on_arbitrary_bodies(
        messages in proptest::collection::vec(any_json(), 0..30),
        junk in proptest::collection::vec(any::<u8>(), 0..64),
        cut in any::<proptest::sample::Index>(),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        let cfg = config("[compaction]\nmax_messages = 3\nmin_preserve_tokens = 1\nmax_preserve_tokens = 10\n");
        let (c, _) = compactor(&cfg, FakeSummarizer::text("s"));
        let body = json!({"model": "gpt-4o", "messages": messages}).to_string().into_bytes();
        let truncated = &body[..cut.index(body.len() + 1)];
        for b in [&body[..], truncated, &junk[..]] {
            let out = rt.block_on(c.process(DialectKind::ChatCompletions, b, &caller()));
            if let Outcome::Rewritten { body: out, .. } = out {
                prop_assert!(serde_json::from_slice::<Value>(&out).is_ok());
            }
        }
    }

    /// Against a store that already holds a checkpoint of the tenant, any message list (empty
    /// ones included, a prefix of the checkpointed conversation followed by arbitrary JSON, or
    /// arbitrary JSON alone) in any of the three dialects is answered without a panic: the
    /// guard in `handle` would hide one, so the `panic` outcome must stay at zero.
    #[test]
    fn message_lists_after_a_checkpoint_never_panic_in_any_dialect(
        cut in 0usize..16,
        extra in proptest::collection::vec(any_json(), 0..6),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        let cfg = config("[compaction]\nmax_messages = 6\nmin_preserve_tokens = 1\nmax_preserve_tokens = 20\n");
        let (c, metrics) = compactor(&cfg, FakeSummarizer::text("s"));
        let primed: Vec<Value> = (0..14)
            .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("m{i} {}", "x".repeat(200))}))
            .collect();
        let first = json!({"model": "gpt-4o", "messages": primed}).to_string().into_bytes();
        let out = rt.block_on(c.process(DialectKind::ChatCompletions, &first, &caller()));
        prop_assert!(matches!(out, Outcome::Rewritten { .. }), "priming compacted: {:?}", out);
        let mut list: Vec<Value> = primed[..cut.min(primed.len())].to_vec();
        list.extend(extra);
        let bodies = [
            (DialectKind::ChatCompletions, json!({"model": "gpt-4o", "messages": list})),
            (DialectKind::Messages, json!({"model": "claude", "max_tokens": 10, "messages": list})),
            (DialectKind::Responses, json!({"model": "gpt-4o", "input": list})),
            (DialectKind::ChatCompletions, json!({"model": "gpt-4o", "messages": []})),
            (DialectKind::Messages, json!({"model": "claude", "max_tokens": 10, "messages": []})),
            (DialectKind::Responses, json!({"model": "gpt-4o", "input": []})),
        ];
        for (dialect, b) in bodies {
            let b = b.to_string().into_bytes();
            let out = rt.block_on(c.process(dialect, &b, &caller()));
            if let Outcome::Rewritten { body: out, .. } | Outcome::Reused { body: out, .. } = out {
                prop_assert!(serde_json::from_slice::<Value>(&out).is_ok());
            }
        }
        let panics = metrics.compactions_counted("none", "panic");
        prop_assert_eq!(panics, 0);
    }

    /// The file tracker accepts any command line or argument string.
    #[test]
    fn file_tracking_never_panics(command in ".{0,200}", name in "[a-zA-Z_]{1,12}") {
        let mut t = crate::compaction::files::FileTracker::new();
        t.observe_command(&command);
        t.observe_text(&command);
        t.observe_tool_call(&name, &command);
        t.observe_tool_call("bash", &json!({"command": command}).to_string());
        prop_assert!(t.read_files().iter().all(|p| !p.is_empty()));
    }
}
