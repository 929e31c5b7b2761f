//! Strict Anthropic Messages validation for mock upstreams, and a converter from the Chat
//! Completions fixtures to the Messages shape, so a replay test can count rejected requests and
//! context-length errors as Anthropic would report them.
//!
//! Rules checked (those compaction could break): the first message is from the user; roles
//! alternate; `tool_result` blocks come first in their message and answer a `tool_use` of the
//! message right before; every `tool_use` (but in the last message) is answered in the next
//! message; thinking blocks lead their message; with thinking enabled, a request continuing a
//! tool loop has its final turn open with a thinking block. Then the context window, at 4
//! characters per token.

use std::collections::HashMap;

use serde_json::{json, Value};

use super::provider_rules::Rejection;

fn blocks(m: &Value) -> Vec<Value> {
    match &m["content"] {
        Value::Array(b) => b.clone(),
        Value::String(s) => vec![json!({"type": "text", "text": s})],
        _ => Vec::new(),
    }
}

fn ids(m: &Value, kind: &str, key: &str) -> Vec<String> {
    blocks(m)
        .iter()
        .filter(|b| b["type"] == kind)
        .filter_map(|b| b[key].as_str().map(str::to_owned))
        .collect()
}

fn is_thinking(b: &Value) -> bool {
    b["type"] == "thinking" || b["type"] == "redacted_thinking"
}

fn chars(v: &Value) -> usize {
    match v {
        Value::String(s) => s.chars().count(),
        Value::Array(items) => items.iter().map(block_chars).sum(),
        _ => 0,
    }
}

/// Characters the model reads of one content block: text, thinking, tool names and inputs (as
/// JSON), tool results. Images count nothing here; the replays have none.
fn block_chars(b: &Value) -> usize {
    match b["type"].as_str() {
        Some("text") => b["text"].as_str().map_or(0, |s| s.chars().count()),
        Some("thinking") => b["thinking"].as_str().map_or(0, |s| s.chars().count()),
        Some("tool_use") => {
            b["name"].as_str().map_or(0, |s| s.chars().count()) + b["input"].to_string().len()
        }
        Some("tool_result") => chars(&b["content"]),
        _ => 0,
    }
}

/// Tokens as the mock counts them: 4 characters per token over `system` and `messages`.
pub fn messages_tokens(request: &Value) -> usize {
    let system = chars(&request["system"]);
    let messages: usize = request["messages"]
        .as_array()
        .map(|m| m.iter().map(|m| chars(&m["content"])).sum())
        .unwrap_or(0);
    (system + messages).div_ceil(4)
}

/// Checks a Messages request the way Anthropic does, then its size against `window`.
pub fn check_messages(request: &Value, window: usize) -> Result<(), Rejection> {
    let invalid = |m: String| Err(Rejection::Invalid(m));
    let Some(messages) = request["messages"].as_array() else {
        return invalid("messages: Field required".into());
    };
    if messages.first().map(|m| &m["role"]) != Some(&json!("user")) {
        return invalid("messages: first message must use the \"user\" role".into());
    }
    for (i, m) in messages.iter().enumerate() {
        let expected = if i % 2 == 0 { "user" } else { "assistant" };
        if m["role"] != expected {
            return invalid(format!(
                "messages.{i}: roles must alternate between \"user\" and \"assistant\""
            ));
        }
        let content = blocks(m);
        if expected == "user" {
            let results = ids(m, "tool_result", "tool_use_id");
            let leading = content
                .iter()
                .take_while(|b| b["type"] == "tool_result")
                .count();
            if leading != results.len() {
                return invalid(format!("messages.{i}: tool_result blocks must come first"));
            }
            let calls = i
                .checked_sub(1)
                .map(|p| ids(&messages[p], "tool_use", "id"))
                .unwrap_or_default();
            if let Some(orphan) = results.iter().find(|r| !calls.contains(r)) {
                return invalid(format!(
                    "messages.{i}.content: unexpected `tool_use_id` found in `tool_result` blocks: {orphan}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
                ));
            }
        } else {
            if content.iter().any(is_thinking) && !content.first().is_some_and(is_thinking) {
                return invalid(format!(
                    "messages.{i}.content.0: If an assistant message contains any thinking blocks, the first block must be thinking or redacted_thinking."
                ));
            }
            if let Some(next) = messages.get(i + 1) {
                let answered = ids(next, "tool_result", "tool_use_id");
                if let Some(open) = ids(m, "tool_use", "id")
                    .iter()
                    .find(|c| !answered.contains(c))
                {
                    return invalid(format!(
                        "messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: {open}"
                    ));
                }
            }
        }
    }
    let thinking = request["thinking"]["type"] == "enabled";
    let continues_loop = messages
        .last()
        .is_some_and(|m| !ids(m, "tool_result", "tool_use_id").is_empty());
    if thinking && continues_loop {
        let turn = messages
            .iter()
            .rposition(|m| m["role"] == "user" && ids(m, "tool_result", "tool_use_id").is_empty())
            .map_or(0, |u| u + 1);
        let starts = messages
            .get(turn)
            .is_some_and(|m| blocks(m).first().is_some_and(is_thinking));
        if !starts {
            return invalid(format!(
                "messages.{turn}.content.0.type: Expected `thinking` or `redacted_thinking`. When `thinking` is enabled, a final `assistant` message must start with a thinking block."
            ));
        }
    }
    let tokens = messages_tokens(request);
    if tokens > window {
        return Err(Rejection::ContextLength { tokens, window });
    }
    Ok(())
}

/// Anthropic's error body for a rejection.
pub fn rejection_body(r: &Rejection) -> Value {
    let message = match r {
        Rejection::Invalid(m) => m.clone(),
        Rejection::ContextLength { tokens, window } => {
            format!("prompt is too long: {tokens} tokens > {window} maximum")
        }
    };
    json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}})
}

/// A Chat Completions transcript as Anthropic would carry it: the system message becomes the
/// top-level `system`; tool calls become `tool_use` blocks (ids renamed so each is unique, as
/// Anthropic issues them), tool messages `tool_result` blocks, and consecutive messages of one
/// side are merged so roles alternate (tool results first). With `thinking`, every assistant
/// message opens with a thinking block (interleaved thinking, as Claude Code runs).
pub fn from_chat(chat: &[Value], thinking: bool) -> (Option<Value>, Vec<Value>) {
    let mut system = None;
    let mut out: Vec<(String, Vec<Value>)> = Vec::new();
    let mut renamed: HashMap<String, String> = HashMap::new();
    let mut next = 0;
    for (i, m) in chat.iter().enumerate() {
        let role = m["role"].as_str().unwrap_or("");
        let text = match &m["content"] {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        };
        let (side, new_blocks) = match role {
            "system" if i == 0 => {
                system = Some(json!(text));
                continue;
            }
            "system" | "user" => ("user", vec![json!({"type": "text", "text": text})]),
            "assistant" => {
                let mut b = Vec::new();
                if thinking {
                    b.push(json!({"type": "thinking", "thinking": format!("Considering step {i}."), "signature": "c2lnbmF0dXJl"}));
                }
                if !text.trim().is_empty() {
                    b.push(json!({"type": "text", "text": text}));
                }
                for call in m["tool_calls"].as_array().into_iter().flatten() {
                    next += 1;
                    let id = format!("toolu_{next:05}");
                    if let Some(old) = call["id"].as_str() {
                        renamed.insert(old.to_owned(), id.clone());
                    }
                    let args = call["function"]["arguments"].as_str().unwrap_or("{}");
                    let input: Value =
                        serde_json::from_str(args).unwrap_or_else(|_| json!({"raw": args}));
                    b.push(json!({"type": "tool_use", "id": id, "name": call["function"]["name"], "input": input}));
                }
                if b.is_empty() {
                    b.push(json!({"type": "text", "text": "(no content)"}));
                }
                ("assistant", b)
            }
            "tool" => {
                let id = m["tool_call_id"]
                    .as_str()
                    .and_then(|old| renamed.get(old))
                    .cloned()
                    .unwrap_or_default();
                (
                    "user",
                    vec![json!({"type": "tool_result", "tool_use_id": id, "content": text})],
                )
            }
            _ => continue,
        };
        match out.last_mut() {
            Some((last, blocks)) if last == side => {
                // Tool results lead a user message.
                let (results, rest): (Vec<Value>, Vec<Value>) = blocks
                    .drain(..)
                    .chain(new_blocks)
                    .partition(|b| b["type"] == "tool_result");
                blocks.extend(results);
                blocks.extend(rest);
            }
            _ => out.push((side.to_owned(), new_blocks)),
        }
    }
    let messages = out
        .into_iter()
        .map(|(role, blocks)| json!({"role": role, "content": blocks}))
        .collect();
    (system, messages)
}

/// The top-level fields of a JSON object body in order, values as raw JSON text (for checking
/// that a rewrite left every field but one byte-identical; the Responses tests use it too).
pub fn top_level_fields(body: &[u8]) -> Vec<(String, String)> {
    struct Fields(Vec<(String, String)>);
    impl<'de> serde::Deserialize<'de> for Fields {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Fields;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("an object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> Result<Fields, A::Error> {
                    let mut out = Vec::new();
                    while let Some(k) = map.next_key::<String>()? {
                        let v: &serde_json::value::RawValue = map.next_value()?;
                        out.push((k, v.get().to_owned()));
                    }
                    Ok(Fields(out))
                }
            }
            d.deserialize_map(V)
        }
    }
    serde_json::from_slice::<Fields>(body)
        .expect("a JSON object body")
        .0
}

/// The elements of the top-level array `key` as raw JSON text.
pub fn raw_elements(body: &[u8], key: &str) -> Vec<String> {
    let fields = top_level_fields(body);
    let raw = &fields
        .iter()
        .find(|(k, _)| k == key)
        .expect("field present")
        .1;
    let items: Vec<&serde_json::value::RawValue> = serde_json::from_str(raw).expect("an array");
    items.iter().map(|r| r.get().to_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rules_refuse_what_anthropic_refuses() {
        let call = json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]});
        let answer = json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]});
        let ok = json!({"messages": [{"role": "user", "content": "hi"}, call, answer]});
        assert_eq!(check_messages(&ok, 1000), Ok(()));
        let bad = [
            json!({"messages": [call, answer]}),
            json!({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]}),
            json!({"messages": [{"role": "user", "content": "hi"}, call, {"role": "user", "content": "?"}]}),
            json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}, answer]}),
            json!({"messages": [{"role": "user", "content": "hi"}, call,
                {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}),
            json!({"thinking": {"type": "enabled"}, "messages": [{"role": "user", "content": "hi"}, call, answer]}),
        ];
        for b in bad {
            assert!(
                matches!(check_messages(&b, 1000), Err(Rejection::Invalid(_))),
                "{b}"
            );
        }
        let big =
            json!({"system": "abcd", "messages": [{"role": "user", "content": "x".repeat(40)}]});
        assert_eq!(
            check_messages(&big, 10),
            Err(Rejection::ContextLength {
                tokens: 11,
                window: 10
            })
        );
    }

    #[test]
    fn converted_chat_transcripts_are_valid() {
        let chat = vec![
            json!({"role": "system", "content": "sys"}),
            json!({"role": "user", "content": "task"}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "cat", "arguments": "{\"f\":1}"}}]}),
            json!({"role": "tool", "tool_call_id": "c2", "content": "two"}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "one"}),
            json!({"role": "user", "content": "observation"}),
            json!({"role": "assistant", "content": "done", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "again"}),
        ];
        for thinking in [false, true] {
            let (system, messages) = from_chat(&chat, thinking);
            assert_eq!(system, Some(json!("sys")));
            assert_eq!(messages.len(), 5);
            let mut request = json!({"messages": messages});
            if thinking {
                request["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
            }
            assert_eq!(check_messages(&request, 1000), Ok(()));
            assert_eq!(
                request["messages"][4]["content"][0]["tool_use_id"],
                "toolu_00003"
            );
        }
    }
}
