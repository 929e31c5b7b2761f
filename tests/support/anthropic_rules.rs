//! Anthropic Messages for mock upstreams: the request rules (from `compactor-plugin-testing`,
//! re-exported) and a converter from the Chat Completions fixtures to the Messages shape, so a
//! replay test can count rejected requests and context-length errors as Anthropic would report
//! them.

use std::collections::HashMap;

use serde_json::{json, Value};

pub use compactor_plugin_testing::rules::messages::{
    check_messages, messages_tokens, rejection_body,
};
pub use compactor_plugin_testing::rules::Rejection;

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
