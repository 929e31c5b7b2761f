//! The per-request scan alone, for counting its instructions under callgrind (repeatable on a
//! noisy machine, unlike wall time): builds one body (the engine bench's plain 200 KB chat body
//! or its escape-heavy 500 KB one, in any of the three dialects) and scans it a few times.
//!
//! Run: `cargo build --release --example scan_cost && valgrind --tool=callgrind
//! target/release/examples/scan_cost chat escapes`, then read the inclusive cost per call of
//! `DialectKind::scan` (`callgrind_annotate --inclusive=yes`). Without valgrind it prints the
//! body size and the scan's token estimate.

use std::hint::black_box;

use compactor::dialect::DialectKind;
use compactor::estimate::LazyEstimator;
use serde_json::{json, Value};

/// Scans per run: enough that the per-call cost is clear of start-up noise.
const SCANS: usize = 5;

/// One turn of a conversation, in neutral terms the three dialects are written from.
enum Turn {
    System(String),
    User(String),
    Assistant(String),
    Call { id: String, arguments: Value },
    Output { id: String, output: String },
}

/// The engine bench's plain body: 769 short messages of ASCII text, no escapes.
fn plain() -> Vec<Turn> {
    let lorem = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor ";
    (0..769)
        .map(|i| {
            let text = lorem.repeat(4)[..260].to_string();
            match i {
                0 => Turn::System(text),
                i if i % 2 == 1 => Turn::User(text),
                _ => Turn::Assistant(text),
            }
        })
        .collect()
}

/// The engine bench's escape-heavy body: 70 turns of an agent loop whose tool outputs are
/// 14,000 characters of code with quotes, line breaks and an accented letter on every line.
fn escapes() -> Vec<Turn> {
    let output: String = "fn parse(input: &str) -> Result<Ast, Error> { /* \"quoted\" é */ }\n"
        .chars()
        .cycle()
        .take(14_000)
        .collect();
    let mut turns = vec![
        Turn::System("You are a coding agent. Use the tools.".into()),
        Turn::User("Fix the failing test in src/parser.rs, then run the suite.".into()),
    ];
    // As in the bench: 70 chat messages, a user message every 10 rounds.
    for i in 0..33 {
        turns.push(Turn::Assistant(format!("Step {i}: reading the next file.")));
        turns.push(Turn::Call {
            id: format!("call_{i}"),
            arguments: json!({"command": format!("cat src/file_{i}.rs")}),
        });
        turns.push(Turn::Output {
            id: format!("call_{i}"),
            output: output.clone(),
        });
        if i % 10 == 9 {
            turns.push(Turn::User(format!("Keep going ({i}).")));
        }
    }
    turns
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "bash", "description": "Run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}])
}

fn chat(turns: &[Turn]) -> Value {
    let mut messages: Vec<Value> = Vec::new();
    for turn in turns {
        match turn {
            Turn::System(t) => messages.push(json!({"role": "system", "content": t})),
            Turn::User(t) => messages.push(json!({"role": "user", "content": t})),
            Turn::Assistant(t) => messages.push(json!({"role": "assistant", "content": t})),
            Turn::Call { id, arguments } => {
                let call = json!({"id": id, "type": "function",
                    "function": {"name": "bash", "arguments": arguments.to_string()}});
                match messages.last_mut() {
                    Some(last) if last["role"] == "assistant" => {
                        last["tool_calls"] = json!([call]);
                    }
                    _ => messages.push(json!({"role": "assistant", "tool_calls": [call]})),
                }
            }
            Turn::Output { id, output } => {
                messages.push(json!({"role": "tool", "tool_call_id": id, "content": output}))
            }
        }
    }
    json!({"model": "gpt-4.1", "stream": true, "tools": tools(), "messages": messages,
        "stream_options": {"include_usage": true}})
}

fn anthropic(turns: &[Turn]) -> Value {
    let mut system = String::new();
    let mut messages: Vec<Value> = Vec::new();
    for turn in turns {
        match turn {
            Turn::System(t) => system.push_str(t),
            Turn::User(t) => messages.push(json!({"role": "user", "content": t})),
            Turn::Assistant(t) => messages
                .push(json!({"role": "assistant", "content": [{"type": "text", "text": t}]})),
            Turn::Call { id, arguments } => {
                let block =
                    json!({"type": "tool_use", "id": id, "name": "bash", "input": arguments});
                match messages
                    .last_mut()
                    .and_then(|m| m["content"].as_array_mut())
                {
                    Some(blocks) => blocks.push(block),
                    None => messages.push(json!({"role": "assistant", "content": [block]})),
                }
            }
            Turn::Output { id, output } => messages.push(json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": id, "content": output}]})),
        }
    }
    json!({"model": "claude-sonnet-4-5", "max_tokens": 8192, "stream": true, "system": system,
        "tools": [{"name": "bash", "description": "Run a command",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}],
        "messages": messages})
}

fn responses(turns: &[Turn]) -> Value {
    let mut instructions = String::new();
    let mut input: Vec<Value> = Vec::new();
    for turn in turns {
        match turn {
            Turn::System(t) => instructions.push_str(t),
            Turn::User(t) => input.push(json!({"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": t}]})),
            Turn::Assistant(t) => input.push(json!({"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": t}]})),
            Turn::Call { id, arguments } => input.push(json!({"type": "function_call",
                "call_id": id, "name": "bash", "arguments": arguments.to_string()})),
            Turn::Output { id, output } => input.push(json!({"type": "function_call_output",
                "call_id": id, "output": output})),
        }
    }
    json!({"model": "gpt-5", "stream": true, "store": false, "instructions": instructions,
        "tools": [{"type": "function", "name": "bash", "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}],
        "input": input})
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dialect, body): (DialectKind, fn(&[Turn]) -> Value) =
        match args.first().map(String::as_str) {
            Some("messages") => (DialectKind::Messages, anthropic),
            Some("responses") => (DialectKind::Responses, responses),
            _ => (DialectKind::ChatCompletions, chat),
        };
    let turns = match args.get(1).map(String::as_str) {
        Some("escapes") => escapes(),
        _ => plain(),
    };
    let body = body(&turns).to_string().into_bytes();
    let est = LazyEstimator::default();
    let mut tokens = 0;
    for _ in 0..SCANS {
        match dialect.scan(black_box(&body), &est) {
            Ok(scan) => tokens = black_box(scan.tokens),
            Err(e) => {
                eprintln!("scan failed: {e}");
                std::process::exit(1);
            }
        }
    }
    println!("{} bytes, {} tokens", body.len(), tokens);
}
