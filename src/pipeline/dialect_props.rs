//! Property tests of the Anthropic Messages, OpenAI Responses and Gemini dialects through the whole
//! request flow (`Pipeline::process`) over random conversations: tool loops with parallel
//! calls answered in any order, tool errors, images in messages and in tool results, thinking
//! (at the start of each turn, optionally interleaved), redacted thinking, server tools,
//! documents, Responses reasoning items, custom and local shell tools, MCP approvals, provider
//! compaction items, vendor fields at every
//! level. Every rewrite must be valid for the provider, leave `system`/`instructions` and every
//! other top-level field byte-identical, keep a verbatim tail, and be smaller.

use std::cell::Cell;

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::compaction::prompt::SUMMARY_INTRO;
use crate::dialect::json::OrderedObject;
use crate::dialect::DialectKind;
use crate::estimate::LazyEstimator;
use crate::pipeline::Outcome;
use crate::testing::{
    caller, check_estimates, compactor, config, ensure, expected_heads, valid_for_provider,
    FakeSummarizer, Said,
};

fn text(min: usize, max: usize) -> impl Strategy<Value = String> {
    proptest::string::string_regex(&format!("[a-z0-9 é日🦀\"\\\\\n]{{{min},{max}}}"))
        .unwrap_or_else(|e| panic!("regex: {e}"))
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// Top-level fields of a body, raw.
fn fields(body: &[u8]) -> Result<Vec<(String, String)>, TestCaseError> {
    let o: OrderedObject<'_> = serde_json::from_slice(body).map_err(fail)?;
    Ok(o.0
        .iter()
        .map(|(k, v)| (k.clone(), v.get().to_string()))
        .collect())
}

/// The raw elements of the top-level array field `key`.
fn raw_list(body: &[u8], key: &str) -> Result<Vec<String>, TestCaseError> {
    let all = fields(body)?;
    let raw = all
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .ok_or_else(|| fail(format!("no {key}")))?;
    let list: Vec<&RawValue> = serde_json::from_str(raw).map_err(fail)?;
    Ok(list.iter().map(|r| r.get().to_string()).collect())
}

/// Same keys in the same order, same bytes except `changed`.
fn same_fields_except(a: &[u8], b: &[u8], changed: &str) -> Result<(), TestCaseError> {
    let (a, b) = (fields(a)?, fields(b)?);
    ensure(a.len() == b.len(), "field count")?;
    for ((ka, va), (kb, vb)) in a.iter().zip(&b) {
        ensure(ka == kb, format!("key order {ka} vs {kb}"))?;
        if ka != changed {
            ensure(va == vb, format!("field {ka} changed"))?;
        }
    }
    Ok(())
}

fn object(fields: Vec<(&str, Value)>, order: &[usize]) -> Vec<u8> {
    let mut out = String::from("{");
    let mut first = true;
    for &i in order {
        let Some((k, v)) = fields.get(i) else {
            continue;
        };
        if v.is_null() {
            continue;
        }
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(&json!(k).to_string());
        out.push(':');
        out.push_str(&v.to_string());
    }
    out.push('}');
    out.into_bytes()
}

/// Counts of a run: how often compaction was due and how often it rewrote.
#[derive(Default)]
struct Tally {
    triggered: Cell<usize>,
    rewritten: Cell<usize>,
}

impl Tally {
    fn check(&self, name: &str) {
        let (t, r) = (self.triggered.get(), self.rewritten.get());
        eprintln!("{name}: triggered {t}, rewritten {r}");
        assert!(t > 80, "{name}: triggered {t}");
        assert!(r * 10 > t * 7, "{name}: rewritten {r} of {t}");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"))
}

fn engine_toml(max_messages: usize, min_preserve: usize, max_preserve: usize) -> String {
    format!(
        "[compaction]\nstrategy = \"summarize\"\nmax_messages = {max_messages}\nmin_preserve_tokens = {min_preserve}\n\
         max_preserve_tokens = {max_preserve}\n[models.\"claude-test\"]\ncontext_window = 3000\n\
         [models.\"gpt-test\"]\ncontext_window = 3000\n[models.\"gemini-test\"]\ncontext_window = 3000\n\
         [summarizer.openai]\nmax_tokens = 200\n"
    )
}

// ---------------------------------------------------------------------------------------------
// Anthropic Messages.

#[derive(Debug, Clone)]
struct Call {
    name: &'static str,
    arg: String,
    output: String,
    error: bool,
    image: bool,
    as_blocks: bool,
}

#[derive(Debug, Clone)]
struct Step {
    text: Option<String>,
    calls: Vec<Call>,
    order: Vec<usize>,
    interleaved_thinking: bool,
    reminder: Option<String>,
    /// The assistant message sent as two, its calls in the second (the API merges them).
    split: bool,
    /// The reminder sent as its own user message after the results (merged with them).
    reminder_alone: bool,
}

#[derive(Debug, Clone)]
struct Exchange {
    user: String,
    user_blocks: bool,
    image: bool,
    document: bool,
    steps: Vec<Step>,
    answer: String,
    web_search: bool,
    redacted: bool,
    /// The turn sent as a context message, then the person's words (merged into one).
    split_user: bool,
}

fn call() -> impl Strategy<Value = Call> {
    (
        prop_oneof![Just("Bash"), Just("Read"), Just("Edit"), Just("Grep")],
        text(0, 80),
        text(0, 500),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(name, arg, output, error, image, as_blocks)| Call {
            name,
            arg,
            output,
            error: error && !image,
            image: image && as_blocks,
            as_blocks,
        })
}

fn step() -> impl Strategy<Value = Step> {
    (
        proptest::option::of(text(1, 60)),
        proptest::collection::vec(call(), 1..4),
        any::<bool>(),
        proptest::option::weighted(0.2, text(1, 40)),
        (proptest::bool::weighted(0.2), proptest::bool::weighted(0.5)),
    )
        .prop_flat_map(|(text, calls, interleaved_thinking, reminder, split)| {
            let n = calls.len();
            (
                Just(text),
                Just(calls),
                Just((0..n).collect::<Vec<usize>>()).prop_shuffle(),
                Just(interleaved_thinking),
                Just(reminder),
                Just(split),
            )
        })
        .prop_map(
            |(text, calls, order, interleaved_thinking, reminder, (split, reminder_alone))| Step {
                text,
                calls,
                order,
                interleaved_thinking,
                reminder,
                split,
                reminder_alone,
            },
        )
}

fn exchange() -> impl Strategy<Value = Exchange> {
    (
        (text(1, 300), any::<bool>(), any::<bool>(), any::<bool>()),
        proptest::collection::vec(step(), 0..5),
        (text(1, 300), any::<bool>(), any::<bool>()),
        proptest::bool::weighted(0.2),
    )
        .prop_map(
            |(
                (user, user_blocks, image, document),
                steps,
                (answer, web_search, redacted),
                split_user,
            )| Exchange {
                user,
                user_blocks,
                image: image && user_blocks,
                document: document && user_blocks,
                steps,
                answer,
                web_search,
                redacted,
                split_user,
            },
        )
}

/// Renders exchanges as Anthropic messages. The last exchange is cut after `cut` of its
/// messages (at a user message), so a request may end in the middle of a tool loop. Some turns
/// are sent as two consecutive messages of one role, which the API merges into one turn. At
/// most two user messages carry `cache_control` (with the system's and the tools', the API's
/// limit of four).
fn render_anthropic(exchanges: &[Exchange], thinking: bool, cut: usize) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    let mut id = 0;
    for (k, ex) in exchanges.iter().enumerate() {
        let start = out.len();
        let user = if ex.user_blocks {
            let mut blocks = vec![json!({"type": "text", "text": ex.user})];
            if ex.image {
                blocks.push(json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo"}}));
            }
            if ex.document {
                blocks.push(json!({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}, "title": "n"}));
            }
            if k % 3 == 0 && k + 6 >= exchanges.len() {
                if let Some(last) = blocks.last_mut() {
                    last["cache_control"] = json!({"type": "ephemeral"});
                }
            }
            json!({"role": "user", "content": blocks})
        } else {
            json!({"role": "user", "content": ex.user})
        };
        if ex.split_user {
            out.push(json!({"role": "user", "content": [
                {"type": "text", "text": format!("<system-reminder>context {k}</system-reminder>")}
            ]}));
        }
        out.push(user);
        for (s, step) in ex.steps.iter().enumerate() {
            let mut blocks = Vec::new();
            if thinking && (s == 0 || step.interleaved_thinking) {
                if ex.redacted && s == 0 {
                    blocks.push(json!({"type": "redacted_thinking", "data": "EncryptedBlob"}));
                } else {
                    blocks.push(json!({"type": "thinking", "thinking": format!("think {k}.{s}"), "signature": "c2lnbmF0dXJl"}));
                }
            }
            if let Some(t) = &step.text {
                blocks.push(json!({"type": "text", "text": t}));
            }
            let ids: Vec<String> = step
                .calls
                .iter()
                .map(|_| {
                    id += 1;
                    format!("toolu_{id:04}")
                })
                .collect();
            if step.split && !blocks.is_empty() {
                out.push(json!({"role": "assistant", "content": blocks}));
                blocks = Vec::new();
            }
            for (c, tid) in step.calls.iter().zip(&ids) {
                blocks.push(json!({"type": "tool_use", "id": tid, "name": c.name, "input": {"arg": c.arg, "n": 1}}));
            }
            out.push(json!({"role": "assistant", "content": blocks}));
            let mut results = Vec::new();
            for &j in &step.order {
                let c = &step.calls[j];
                let content = if c.as_blocks {
                    let mut b = vec![json!({"type": "text", "text": c.output})];
                    if c.image {
                        b.push(json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo"}}));
                    }
                    json!(b)
                } else {
                    json!(c.output)
                };
                let mut r =
                    json!({"type": "tool_result", "tool_use_id": ids[j], "content": content});
                if c.error {
                    r["is_error"] = json!(true);
                }
                results.push(r);
            }
            match &step.reminder {
                Some(reminder) if step.reminder_alone => {
                    out.push(json!({"role": "user", "content": results}));
                    out.push(json!({"role": "user", "content": reminder}));
                }
                Some(reminder) => {
                    results.push(json!({"type": "text", "text": reminder}));
                    out.push(json!({"role": "user", "content": results}));
                }
                None => out.push(json!({"role": "user", "content": results})),
            }
        }
        let mut blocks = Vec::new();
        if thinking && ex.steps.is_empty() {
            blocks.push(json!({"type": "thinking", "thinking": "final", "signature": "c2ln"}));
        }
        if ex.web_search {
            id += 1;
            let sid = format!("srvtoolu_{id:04}");
            blocks.push(json!({"type": "server_tool_use", "id": sid, "name": "web_search", "input": {"query": "rust"}}));
            blocks.push(json!({"type": "web_search_tool_result", "tool_use_id": sid, "content": [
                {"type": "web_search_result", "url": "https://r.example", "title": "Rust", "encrypted_content": "Zm9v"}
            ]}));
        }
        blocks.push(json!({"type": "text", "text": ex.answer}));
        out.push(json!({"role": "assistant", "content": blocks}));
        if k + 1 == exchanges.len() {
            // Cut the last exchange at one of its user messages.
            let users: Vec<usize> = (start..out.len())
                .filter(|&i| out[i]["role"] == "user")
                .collect();
            let at = users[cut % users.len()];
            out.truncate(at + 1);
        }
    }
    out
}

#[derive(Debug, Clone)]
struct AnthropicCase {
    exchanges: Vec<Exchange>,
    thinking: bool,
    cut: usize,
    system_blocks: bool,
    model: &'static str,
    max_tokens: Option<u32>,
    order: Vec<usize>,
    limits: (usize, usize, usize),
}

fn anthropic_case() -> impl Strategy<Value = AnthropicCase> {
    (
        proptest::collection::vec(exchange(), 1..10),
        any::<bool>(),
        0usize..8,
        any::<bool>(),
        prop_oneof![
            Just("claude-test"),
            Just("claude-sonnet-4-5"),
            Just("other")
        ],
        proptest::option::of(0u32..2_000),
        Just((0..9).collect::<Vec<usize>>()).prop_shuffle(),
        (4usize..30, 10usize..200, 200usize..1_500),
    )
        .prop_map(
            |(exchanges, thinking, cut, system_blocks, model, max_tokens, order, limits)| {
                AnthropicCase {
                    exchanges,
                    thinking,
                    cut,
                    system_blocks,
                    model,
                    max_tokens,
                    order,
                    limits,
                }
            },
        )
}

fn anthropic_body(case: &AnthropicCase, messages: &[Value]) -> Vec<u8> {
    let system = if case.system_blocks {
        json!([{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}])
    } else {
        json!("You are a coding agent.")
    };
    let fields = vec![
        ("model", json!(case.model)),
        ("messages", json!(messages)),
        ("system", system),
        (
            "tools",
            json!([{"name": "Bash", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}]),
        ),
        ("tool_choice", json!({"type": "auto"})),
        (
            "thinking",
            if case.thinking {
                // Both ways of turning thinking on: a budget, or the model deciding.
                if case.cut % 2 == 0 {
                    json!({"type": "enabled", "budget_tokens": 1024})
                } else {
                    json!({"type": "adaptive"})
                }
            } else {
                Value::Null
            },
        ),
        ("metadata", json!({"user_id": "user_1"})),
        ("x_vendor", json!({"b": 1, "a": [true, 2.5, null]})),
        (
            "max_tokens",
            case.max_tokens.map_or(json!(4096), |t| json!(t)),
        ),
    ];
    object(fields, &case.order)
}

/// An Anthropic Messages request valid for Anthropic (what the fuzz tests mutate).
pub(super) fn valid_anthropic_request() -> impl Strategy<Value = Vec<u8>> {
    anthropic_case().prop_map(|case| {
        let messages = render_anthropic(&case.exchanges, case.thinking, case.cut);
        anthropic_body(&case, &messages)
    })
}

#[test]
fn anthropic_rewrites_stay_valid_verbatim_and_smaller() {
    let rt = runtime();
    let tally = Tally::default();
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 250,
        ..ProptestConfig::default()
    });
    let result = runner.run(&anthropic_case(), |case| {
        let msgs = render_anthropic(&case.exchanges, case.thinking, case.cut);
        let body = anthropic_body(&case, &msgs);
        valid_for_provider(DialectKind::Messages, &body)
            .map_err(|e| fail(format!("generator: {e}")))?;
        let (mm, minp, maxp) = case.limits;
        // Summaries of every length modulo 4, so per-message rounding shows.
        let summary = format!(
            "Short summary of the earlier turns.{}",
            "!".repeat(case.cut % 4)
        );
        let (c, _) = compactor(
            &config(&engine_toml(mm, minp, maxp)),
            FakeSummarizer::text(&summary),
        );
        let est = LazyEstimator::default();
        let parsed = DialectKind::Messages.parse(&body).map_err(fail)?;
        check_estimates(&parsed, &est)?;
        let before = &parsed.scan;
        let due = c
            .engine()
            .limits(before.model.as_deref(), before.requested_output)
            .check(before.len(), before.tokens)
            .is_some();
        match rt.block_on(c.process(DialectKind::Messages, &body, &caller())) {
            Outcome::Reused { .. } => ensure(false, "a fresh compactor reused a summary")?,
            Outcome::Masked { .. } => ensure(false, "`summarize` masked outputs")?,
            Outcome::Unchanged => ensure(!due, "due compaction reported unchanged")?,
            Outcome::Failed => {
                ensure(due, "failure without a trigger")?;
                tally.triggered.set(tally.triggered.get() + 1);
            }
            Outcome::Rewritten {
                body: out, result, ..
            } => {
                ensure(due, "rewrite without a trigger")?;
                tally.triggered.set(tally.triggered.get() + 1);
                tally.rewritten.set(tally.rewritten.get() + 1);
                same_fields_except(&body, &out, "messages")?;
                let orig = raw_list(&body, "messages")?;
                let new = raw_list(&out, "messages")?;
                let values: Vec<Value> = new
                    .iter()
                    .map(|m| serde_json::from_str(m).unwrap_or(Value::Null))
                    .collect();
                valid_for_provider(DialectKind::Messages, &out).map_err(fail)?;
                // The opening (when kept), then the summary, then a verbatim suffix. Roles
                // alternate, so the summary joins the opening's message as a block after its
                // blocks, and the first kept user message's blocks follow it.
                let said: Vec<Said> = orig
                    .iter()
                    .map(|m| {
                        let m: Value = serde_json::from_str(m).unwrap_or(Value::Null);
                        if m["role"] == "assistant" {
                            Said::Model
                        } else if m["content"][0]["type"] == "tool_result" {
                            Said::ToolAnswer
                        } else {
                            Said::Client
                        }
                    })
                    .collect();
                let budget = c
                    .engine()
                    .limits(before.model.as_deref(), before.requested_output)
                    .opening_budget;
                let blocks_of = |raw: &str| -> Result<Vec<Value>, TestCaseError> {
                    let m: Value = serde_json::from_str(raw).map_err(fail)?;
                    Ok(match &m["content"] {
                        Value::String(s) if s.is_empty() => Vec::new(),
                        Value::String(s) => vec![json!({"type": "text", "text": s})],
                        Value::Array(b) => b.clone(),
                        _ => Vec::new(),
                    })
                };
                // With the opening kept, the summary is the block after the opening's.
                let [with_opening, _] = expected_heads(&said, 0, before, budget);
                let kept_opening = with_opening > 0 && with_opening <= new.len() && {
                    let opening = blocks_of(&orig[with_opening - 1])?;
                    let blocks = blocks_of(&new[with_opening - 1])?;
                    blocks.get(opening.len()).is_some_and(|b| {
                        b["text"]
                            .as_str()
                            .is_some_and(|t| t.starts_with(SUMMARY_INTRO))
                    })
                };
                let head = if kept_opening { with_opening } else { 0 };
                let at = head.saturating_sub(1);
                ensure(new[..at] == orig[..at], "the opening kept")?;
                let first = &values[at];
                ensure(first["role"] == "user", "summary is in a user message")?;
                let blocks = blocks_of(&new[at])?;
                let opening = if head > 0 {
                    blocks_of(&orig[head - 1])?
                } else {
                    Vec::new()
                };
                ensure(
                    blocks.len() > opening.len() && blocks[..opening.len()] == opening[..],
                    "the opening's blocks kept, in order",
                )?;
                let summary_text = blocks[opening.len()]["text"].as_str().unwrap_or("");
                ensure(
                    summary_text.starts_with(SUMMARY_INTRO),
                    "summary introduced",
                )?;
                let tail = &new[at + 1..];
                ensure(
                    tail == &orig[orig.len() - tail.len()..],
                    "tail byte-identical",
                )?;
                let joined = &blocks[opening.len() + 1..];
                let merged = !joined.is_empty();
                let compacted_from = if merged {
                    // Merged with the first kept user message: its blocks follow, unchanged.
                    let kept = orig.len() - tail.len() - 1;
                    ensure(joined == &blocks_of(&orig[kept])?[..], "merged blocks kept")?;
                    kept
                } else {
                    orig.len() - tail.len()
                };
                ensure(compacted_from > head, "something was compacted")?;
                // The engine prices the summary and the kept message separately; merged into one
                // message they can round to one token less.
                let after = DialectKind::Messages.scan(&out, &est).map_err(fail)?;
                let slack = usize::from(merged) + usize::from(head > 0);
                ensure(
                    after.tokens <= result.post_tokens
                        && after.tokens + slack >= result.post_tokens,
                    format!("post_tokens {} vs {}", result.post_tokens, after.tokens),
                )?;
                ensure(before.tokens == result.pre_tokens, "pre_tokens")?;
                ensure(after.tokens < before.tokens, "rewrite is smaller")?;
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    tally.check("messages");
}

// ---------------------------------------------------------------------------------------------
// OpenAI Responses.

#[derive(Debug, Clone)]
enum Item {
    User {
        text: String,
        parts: bool,
        image: bool,
    },
    Answer {
        text: String,
        reasoning: bool,
    },
    Calls {
        reasoning: bool,
        calls: Vec<(&'static str, String, String)>,
        order: Vec<usize>,
    },
    WebSearch,
    Developer(String),
    /// A provider's sealed summary (Codex after a remote compaction).
    Compaction,
    /// A hosted MCP tool's approval request, the client's answer, and the call when approved.
    McpApproval(bool),
}

fn item() -> impl Strategy<Value = Item> {
    let user = (text(0, 300), any::<bool>(), any::<bool>())
        .prop_map(|(text, parts, image)| Item::User { text, parts, image });
    let answer = (text(0, 300), any::<bool>())
        .prop_map(|(text, reasoning)| Item::Answer { text, reasoning });
    let calls = (
        any::<bool>(),
        proptest::collection::vec(
            (
                prop_oneof![
                    Just("function_call"),
                    Just("custom_tool_call"),
                    Just("local_shell_call")
                ],
                text(0, 100),
                text(0, 500),
            ),
            1..4,
        ),
    )
        .prop_flat_map(|(reasoning, calls)| {
            let n = calls.len();
            (
                Just(reasoning),
                Just(calls),
                Just((0..n).collect::<Vec<usize>>()).prop_shuffle(),
            )
        })
        .prop_map(|(reasoning, calls, order)| Item::Calls {
            reasoning,
            calls,
            order,
        });
    prop_oneof![
        30 => user,
        20 => answer,
        40 => calls,
        10 => Just(Item::WebSearch),
        10 => text(1, 60).prop_map(Item::Developer),
        10 => any::<bool>().prop_map(Item::McpApproval),
        // About one conversation in six carries one.
        1 => Just(Item::Compaction),
    ]
}

fn reasoning_item(id: usize) -> Value {
    json!({"type": "reasoning", "id": format!("rs_{id}"),
           "summary": [{"type": "summary_text", "text": format!("thinking {id}")}],
           "encrypted_content": "ZW5jcnlwdGVk"})
}

/// Renders items as Responses `input`; leading developer messages first; always ends on a user
/// message or tool outputs.
fn render_responses(developers: usize, items: &[Item]) -> Vec<Value> {
    let mut out: Vec<Value> = (0..developers)
        .map(|i| json!({"type": "message", "role": if i % 2 == 0 { "developer" } else { "system" }, "content": format!("rules {i}")}))
        .collect();
    let mut id = 0;
    for (k, it) in items.iter().enumerate() {
        id += 1;
        match it {
            Item::User { text, parts, image } => {
                let mut m = if *parts {
                    let mut p = vec![json!({"type": "input_text", "text": text})];
                    if *image {
                        p.push(json!({"type": "input_image", "image_url": "https://x.example/i.png", "detail": "auto"}));
                    }
                    json!({"type": "message", "role": "user", "content": p})
                } else {
                    json!({"role": "user", "content": text})
                };
                if k % 3 == 0 {
                    m["x_vendor"] = json!({"k": k});
                }
                out.push(m);
            }
            Item::Answer { text, reasoning } => {
                if *reasoning {
                    out.push(reasoning_item(id));
                }
                let mut m = json!({"type": "message", "role": "assistant", "status": "completed",
                                   "content": [{"type": "output_text", "text": text, "annotations": []}]});
                if *reasoning {
                    m["id"] = json!(format!("msg_{id}"));
                }
                out.push(m);
            }
            Item::Calls {
                reasoning,
                calls,
                order,
            } => {
                if *reasoning {
                    out.push(reasoning_item(id));
                }
                let ids: Vec<String> = (0..calls.len())
                    .map(|j| format!("call_{id}_{j}"))
                    .collect();
                for (j, ((kind, arg, _), cid)) in calls.iter().zip(&ids).enumerate() {
                    let (mut call, prefix) = match *kind {
                        "function_call" => (json!({"type": "function_call", "call_id": cid,
                                                   "name": "shell", "arguments": json!({"command": ["bash", "-lc", arg]}).to_string()}), "fc"),
                        "custom_tool_call" => (json!({"type": "custom_tool_call", "call_id": cid, "name": "apply_patch",
                                                      "input": format!("*** Begin Patch\n*** Update File: f{id}.rs\n+{arg}\n*** End Patch")}), "ctc"),
                        _ => (json!({"type": "local_shell_call", "call_id": cid, "status": "completed",
                                     "action": {"type": "exec", "command": ["bash", "-lc", arg]}}), "lsh"),
                    };
                    // Ids name the response for the provider rules (see `rules::responses`).
                    if *reasoning {
                        call["id"] = json!(format!("{prefix}_{id}_{j}"));
                    }
                    out.push(call);
                }
                for &j in order {
                    let (kind, _, output) = &calls[j];
                    out.push(json!({"type": format!("{kind}_output"), "call_id": ids[j], "output": output}));
                }
            }
            Item::WebSearch => out.push(json!({"type": "web_search_call", "id": format!("ws_{id}"), "status": "completed",
                                               "action": {"type": "search", "query": "rust serde"}})),
            Item::Developer(t) => out.push(json!({"type": "message", "role": "developer", "content": t})),
            Item::Compaction => out.push(json!({"type": "compaction", "id": format!("cmp_{id}"),
                                                "encrypted_content": "c2VhbGVkIGhpc3Rvcnk="})),
            Item::McpApproval(approve) => {
                let request = format!("mcpr_{id}");
                out.push(json!({"type": "mcp_approval_request", "id": request, "server_label": "docs",
                                "name": "ask_question", "arguments": "{\"q\":\"serde\"}"}));
                out.push(json!({"type": "mcp_approval_response", "approval_request_id": request,
                                "approve": approve}));
                if *approve {
                    out.push(json!({"type": "mcp_call", "id": format!("mcp_{id}"), "server_label": "docs",
                                    "name": "ask_question", "arguments": "{\"q\":\"serde\"}",
                                    "output": "serde is a framework for serializing"}));
                }
            }
        }
    }
    let ends_well = out.last().is_some_and(|m| {
        m["role"] == "user" || m["type"].as_str().is_some_and(|t| t.ends_with("_output"))
    });
    if !ends_well {
        out.push(json!({"role": "user", "content": "continue"}));
    }
    out
}

#[derive(Debug, Clone)]
struct ResponsesCase {
    developers: usize,
    items: Vec<Item>,
    model: &'static str,
    max_output_tokens: Option<u32>,
    order: Vec<usize>,
    limits: (usize, usize, usize),
}

fn responses_case() -> impl Strategy<Value = ResponsesCase> {
    (
        0usize..3,
        proptest::collection::vec(item(), 1..40),
        prop_oneof![Just("gpt-test"), Just("gpt-5"), Just("unknown")],
        proptest::option::of(0u32..3_000),
        Just((0..8).collect::<Vec<usize>>()).prop_shuffle(),
        (4usize..30, 10usize..200, 200usize..1_500),
    )
        .prop_map(
            |(developers, items, model, max_output_tokens, order, limits)| ResponsesCase {
                developers,
                items,
                model,
                max_output_tokens,
                order,
                limits,
            },
        )
}

fn responses_body(case: &ResponsesCase, input: &[Value]) -> Vec<u8> {
    let fields = vec![
        ("model", json!(case.model)),
        ("input", json!(input)),
        ("instructions", json!("You are Codex.\nBe \"precise\".")),
        (
            "tools",
            json!([{"type": "function", "name": "shell", "parameters": {"type": "object"}}]),
        ),
        ("reasoning", json!({"effort": "medium", "summary": "auto"})),
        ("store", json!(false)),
        ("include", json!(["reasoning.encrypted_content"])),
        (
            "max_output_tokens",
            case.max_output_tokens.map_or(Value::Null, |t| json!(t)),
        ),
    ];
    object(fields, &case.order)
}

/// An OpenAI Responses request valid for OpenAI (what the fuzz tests mutate).
pub(super) fn valid_responses_request() -> impl Strategy<Value = Vec<u8>> {
    responses_case().prop_map(|case| {
        let input = render_responses(case.developers, &case.items);
        responses_body(&case, &input)
    })
}

#[test]
fn responses_rewrites_stay_valid_verbatim_and_smaller() {
    let rt = runtime();
    let tally = Tally::default();
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 250,
        ..ProptestConfig::default()
    });
    let result = runner.run(&responses_case(), |case| {
        let input = render_responses(case.developers, &case.items);
        let body = responses_body(&case, &input);
        valid_for_provider(DialectKind::Responses, &body)
            .map_err(|e| fail(format!("generator: {e}")))?;
        let (mm, minp, maxp) = case.limits;
        let (c, _) = compactor(
            &config(&engine_toml(mm, minp, maxp)),
            FakeSummarizer::text("Short summary of the earlier turns."),
        );
        let est = LazyEstimator::default();
        let parsed = DialectKind::Responses.parse(&body).map_err(fail)?;
        let before = &parsed.scan;
        // Items are counted as nodes (their string leaves), not from their neutral parts (a
        // shell call's arguments are rebuilt from its action), so only the totals must agree.
        let t = &parsed.transcript;
        ensure(
            before.tokens == before.fixed_tokens + t.tokens(0..t.len()),
            "the scan's total is its fixed tokens plus its items'",
        )?;
        let due = c
            .engine()
            .limits(before.model.as_deref(), before.requested_output)
            .check(before.counted(0..before.len()), before.tokens)
            .is_some();
        match rt.block_on(c.process(DialectKind::Responses, &body, &caller())) {
            Outcome::Reused { .. } => ensure(false, "a fresh compactor reused a summary")?,
            Outcome::Masked { .. } => ensure(false, "`summarize` masked outputs")?,
            Outcome::Unchanged => ensure(!due, "due compaction reported unchanged")?,
            Outcome::Failed => {
                ensure(due, "failure without a trigger")?;
                tally.triggered.set(tally.triggered.get() + 1);
            }
            Outcome::Rewritten {
                body: out, result, ..
            } => {
                ensure(due, "rewrite without a trigger")?;
                tally.triggered.set(tally.triggered.get() + 1);
                tally.rewritten.set(tally.rewritten.get() + 1);
                same_fields_except(&body, &out, "input")?;
                let orig = raw_list(&body, "input")?;
                let new = raw_list(&out, "input")?;
                // The head: leading instructions, the opening when kept, and everything
                // through the last sealed provider summary.
                let leading = input
                    .iter()
                    .take_while(|m| m["role"] == "developer" || m["role"] == "system")
                    .count();
                let said: Vec<Said> = input
                    .iter()
                    .map(|m| {
                        let kind = m["type"].as_str().unwrap_or("message");
                        if kind == "message" && m["role"] != "assistant" {
                            Said::Client
                        } else if kind.ends_with("_call_output") || kind == "mcp_approval_response"
                        {
                            Said::ToolAnswer
                        } else {
                            Said::Model
                        }
                    })
                    .collect();
                let budget = c
                    .engine()
                    .limits(before.model.as_deref(), before.requested_output)
                    .opening_budget;
                let sealed = input
                    .iter()
                    .rposition(|m| m["type"] == "compaction")
                    .map_or(0, |i| i + 1);
                let is_summary = |h: usize| {
                    new.get(h)
                        .and_then(|m| serde_json::from_str::<Value>(m).ok())
                        .is_some_and(|v| {
                            v["type"] == "message"
                                && v["role"] == "user"
                                && v["content"][0]["text"]
                                    .as_str()
                                    .is_some_and(|s| s.starts_with(SUMMARY_INTRO))
                        })
                };
                let head = expected_heads(&said, leading, before, budget)
                    .map(|h| h.max(sealed))
                    .into_iter()
                    .find(|&h| is_summary(h))
                    .ok_or_else(|| fail("no summary item after the head"))?;
                ensure(new.len() >= head + 2, "head + summary + tail")?;
                ensure(new[..head] == orig[..head], "the head kept")?;
                let summary: Value = serde_json::from_str(&new[head]).map_err(fail)?;
                ensure(
                    summary["type"] == "message" && summary["role"] == "user",
                    "summary item",
                )?;
                ensure(
                    summary["content"][0]["type"] == "input_text"
                        && summary["content"][0]["text"]
                            .as_str()
                            .is_some_and(|s| s.starts_with(SUMMARY_INTRO)),
                    "summary introduced",
                )?;
                let tail = &new[head + 1..];
                ensure(
                    tail == &orig[orig.len() - tail.len()..],
                    "tail byte-identical",
                )?;
                ensure(tail.len() < orig.len() - head, "something was compacted")?;
                // Valid, reasoning items included: no output of a response lost the reasoning
                // item produced with it (the rules read the response from the ids).
                valid_for_provider(DialectKind::Responses, &out).map_err(fail)?;
                let after = DialectKind::Responses.scan(&out, &est).map_err(fail)?;
                ensure(after.tokens == result.post_tokens, "post_tokens")?;
                ensure(before.tokens == result.pre_tokens, "pre_tokens")?;
                ensure(after.tokens < before.tokens, "rewrite is smaller")?;
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    tally.check("responses");
}

// ---------------------------------------------------------------------------------------------
// Google Gemini.

/// Renders exchanges as Gemini `contents`: the user's turn (text, perhaps an inline image),
/// then per tool step a model entry (a thought, its text, its calls, the first carrying a
/// thought signature when `thinking`) and a user entry answering every call in `order` (an
/// error as `{"error": …}`, a reminder as a text part after the responses), then the model's
/// answer. Roles alternate throughout, as Gemini reads them. The last exchange is cut at one
/// of its user entries.
fn render_gemini(exchanges: &[Exchange], thinking: bool, ids: bool, cut: usize) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    let mut id = 0;
    for (k, ex) in exchanges.iter().enumerate() {
        let start = out.len();
        let mut parts = vec![json!({"text": ex.user})];
        if ex.image {
            parts.push(json!({"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo"}}));
        }
        out.push(json!({"role": "user", "parts": parts}));
        for (s, step) in ex.steps.iter().enumerate() {
            let mut parts = Vec::new();
            if thinking && step.interleaved_thinking {
                parts.push(json!({"text": format!("think {k}.{s}"), "thought": true}));
            }
            if let Some(t) = &step.text {
                parts.push(json!({"text": t}));
            }
            let call_ids: Vec<String> = step
                .calls
                .iter()
                .map(|_| {
                    id += 1;
                    format!("call_{id:04}")
                })
                .collect();
            for (c, (call, cid)) in step.calls.iter().zip(&call_ids).enumerate() {
                let mut f = json!({"name": call.name, "args": {"arg": call.arg, "n": 1}});
                if ids {
                    f["id"] = json!(cid);
                }
                let mut part = json!({"functionCall": f});
                if thinking && c == 0 {
                    part["thoughtSignature"] = json!("c2lnbmF0dXJl");
                }
                parts.push(part);
            }
            out.push(json!({"role": "model", "parts": parts}));
            let mut answers = Vec::new();
            for &j in &step.order {
                let call = &step.calls[j];
                let response = if call.error {
                    json!({"error": call.output})
                } else {
                    json!({"output": call.output})
                };
                let mut f = json!({"name": call.name, "response": response});
                if ids {
                    f["id"] = json!(call_ids[j]);
                }
                answers.push(json!({"functionResponse": f}));
            }
            if let Some(reminder) = &step.reminder {
                answers.push(json!({"text": reminder}));
            }
            out.push(json!({"role": "user", "parts": answers}));
        }
        let mut parts = Vec::new();
        if thinking {
            parts.push(json!({"text": "final", "thought": true}));
        }
        parts.push(json!({"text": ex.answer}));
        out.push(json!({"role": "model", "parts": parts}));
        if k + 1 == exchanges.len() {
            let users: Vec<usize> = (start..out.len())
                .filter(|&i| out[i]["role"] == "user")
                .collect();
            let at = users[cut % users.len()];
            out.truncate(at + 1);
        }
    }
    out
}

#[derive(Debug, Clone)]
struct GeminiCase {
    exchanges: Vec<Exchange>,
    thinking: bool,
    ids: bool,
    cut: usize,
    snake_case: bool,
    max_output: Option<u32>,
    order: Vec<usize>,
    limits: (usize, usize, usize),
}

fn gemini_case() -> impl Strategy<Value = GeminiCase> {
    (
        proptest::collection::vec(exchange(), 1..10),
        (any::<bool>(), any::<bool>(), any::<bool>()),
        0usize..8,
        proptest::option::of(0u32..2_000),
        Just((0..6).collect::<Vec<usize>>()).prop_shuffle(),
        (4usize..30, 10usize..200, 200usize..1_500),
    )
        .prop_map(
            |(exchanges, (thinking, ids, snake_case), cut, max_output, order, limits)| GeminiCase {
                exchanges,
                thinking,
                ids,
                cut,
                snake_case,
                max_output,
                order,
                limits,
            },
        )
}

fn gemini_body(case: &GeminiCase, contents: &[Value]) -> Vec<u8> {
    let name =
        |camel: &'static str, snake: &'static str| if case.snake_case { snake } else { camel };
    let config = match case.max_output {
        Some(t) => json!({"temperature": 0.5, "maxOutputTokens": t}),
        None => json!({"temperature": 0.5}),
    };
    let fields = vec![
        ("contents", json!(contents)),
        (
            name("systemInstruction", "system_instruction"),
            json!({"parts": [{"text": "You are Gemini CLI, a coding agent."}]}),
        ),
        (
            "tools",
            json!([{"functionDeclarations": [{"name": "Bash", "parameters": {"type": "object"}}]}]),
        ),
        (name("generationConfig", "generation_config"), config),
        (
            name("toolConfig", "tool_config"),
            json!({"functionCallingConfig": {"mode": "AUTO"}}),
        ),
        ("x_vendor", json!({"b": 1, "a": [true, 2.5, null]})),
    ];
    object(fields, &case.order)
}

/// A Gemini request valid for Gemini (what the fuzz tests mutate).
pub(super) fn valid_gemini_request() -> impl Strategy<Value = Vec<u8>> {
    gemini_case().prop_map(|case| {
        let contents = render_gemini(&case.exchanges, case.thinking, case.ids, case.cut);
        gemini_body(&case, &contents)
    })
}

/// The caller of a Gemini request for `gemini-test`: the model is in its path.
fn gemini_caller() -> std::sync::Arc<compactor_plugin_api::Caller> {
    std::sync::Arc::new(compactor_plugin_api::Caller {
        api_prefix: "/v1beta/models/gemini-test".into(),
        api: compactor_plugin_api::Api::Gemini,
        ..compactor_plugin_api::Caller::default()
    })
}

#[test]
fn gemini_rewrites_stay_valid_verbatim_and_smaller() {
    let rt = runtime();
    let tally = Tally::default();
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 250,
        ..ProptestConfig::default()
    });
    let result = runner.run(&gemini_case(), |case| {
        let contents = render_gemini(&case.exchanges, case.thinking, case.ids, case.cut);
        let body = gemini_body(&case, &contents);
        valid_for_provider(DialectKind::Gemini, &body)
            .map_err(|e| fail(format!("generator: {e}")))?;
        let (mm, minp, maxp) = case.limits;
        let summary = format!(
            "Short summary of the earlier turns.{}",
            "!".repeat(case.cut % 4)
        );
        let (c, _) = compactor(
            &config(&engine_toml(mm, minp, maxp)),
            FakeSummarizer::text(&summary),
        );
        let est = LazyEstimator::default();
        let parsed = DialectKind::Gemini.parse(&body).map_err(fail)?;
        check_estimates(&parsed, &est)?;
        let before = parsed
            .scan
            .with_model_from_prefix("/v1beta/models/gemini-test");
        ensure(
            before.model.as_deref() == Some("gemini-test"),
            "model from the path",
        )?;
        ensure(
            before.requested_output == case.max_output.map(|t| t as usize),
            "maxOutputTokens read, in either spelling",
        )?;
        let due = c
            .engine()
            .limits(before.model.as_deref(), before.requested_output)
            .check(before.len(), before.tokens)
            .is_some();
        match rt.block_on(c.process(DialectKind::Gemini, &body, &gemini_caller())) {
            Outcome::Reused { .. } => ensure(false, "a fresh compactor reused a summary")?,
            Outcome::Masked { .. } => ensure(false, "`summarize` masked outputs")?,
            Outcome::Unchanged => ensure(!due, "due compaction reported unchanged")?,
            Outcome::Failed => {
                ensure(due, "failure without a trigger")?;
                tally.triggered.set(tally.triggered.get() + 1);
            }
            Outcome::Rewritten {
                body: out, result, ..
            } => {
                ensure(due, "rewrite without a trigger")?;
                tally.triggered.set(tally.triggered.get() + 1);
                tally.rewritten.set(tally.rewritten.get() + 1);
                same_fields_except(&body, &out, "contents")?;
                valid_for_provider(DialectKind::Gemini, &out).map_err(fail)?;
                let orig = raw_list(&body, "contents")?;
                let new = raw_list(&out, "contents")?;
                // One user entry holds the summary, as a text part of its own; every other
                // entry is one of the request's, byte for byte: the opening before it, a
                // verbatim tail after it.
                let holds_summary = |raw: &str| {
                    let v: Value = serde_json::from_str(raw).unwrap_or(Value::Null);
                    v["parts"].as_array().is_some_and(|parts| {
                        parts.iter().any(|p| {
                            p["text"]
                                .as_str()
                                .is_some_and(|t| t.starts_with(SUMMARY_INTRO))
                        })
                    })
                };
                let at: Vec<usize> = (0..new.len()).filter(|&i| holds_summary(&new[i])).collect();
                ensure(at.len() == 1, format!("one summary entry, found {at:?}"))?;
                let at = at[0];
                ensure(new[..at] == orig[..at], "the opening kept")?;
                let tail = &new[at + 1..];
                ensure(
                    tail == &orig[orig.len() - tail.len()..],
                    "tail byte-identical",
                )?;
                // The summary entry keeps the parts of the neighbours it joined, in order.
                let summary_entry: Value = serde_json::from_str(&new[at]).map_err(fail)?;
                ensure(summary_entry["role"] == "user", "the summary is the user's")?;
                let after = DialectKind::Gemini.scan(&out, &est).map_err(fail)?;
                ensure(before.tokens == result.pre_tokens, "pre_tokens")?;
                ensure(after.tokens < before.tokens, "rewrite is smaller")?;
                ensure(
                    after.tokens <= result.post_tokens && after.tokens + 2 >= result.post_tokens,
                    format!("post_tokens {} vs {}", result.post_tokens, after.tokens),
                )?;
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    tally.check("gemini");
}
