//! OpenAI Responses for mock upstreams: the request rules (from `compactor-plugin-testing`,
//! re-exported; they read which response an item belongs to from its id, `rs_N`, `msg_N`,
//! `fc_N_K`) and a converter from the Chat Completions fixtures to Responses `input` items in
//! that form.

use std::collections::HashMap;

use serde_json::{json, Value};

pub use compactor_plugin_testing::rules::responses::{
    check_responses, rejection_body, responses_tokens,
};
pub use compactor_plugin_testing::rules::Rejection;

/// A Chat Completions transcript as Codex would send it to the Responses API: the first system
/// message becomes `instructions`; user messages become `input_text` message items; each
/// assistant message `N` becomes a `reasoning` item `rs_N`, an output message `msg_N` (when it
/// has text) and one `function_call` item `fc_N_K` per tool call (call ids renamed `call_N_K`,
/// unique as OpenAI issues them); tool messages become `function_call_output` items.
pub fn from_chat(chat: &[Value]) -> (Option<Value>, Vec<Value>) {
    let mut instructions = None;
    let mut items = Vec::new();
    let mut renamed: HashMap<String, String> = HashMap::new();
    for (i, m) in chat.iter().enumerate() {
        let text = match &m["content"] {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        };
        match m["role"].as_str().unwrap_or("") {
            "system" if i == 0 => instructions = Some(json!(text)),
            "system" => {
                items.push(json!({"type": "message", "role": "developer", "content": text}))
            }
            "user" => items.push(json!({"type": "message", "role": "user",
                                        "content": [{"type": "input_text", "text": text}]})),
            "assistant" => {
                items.push(json!({"type": "reasoning", "id": format!("rs_{i}"),
                                  "summary": [{"type": "summary_text", "text": format!("Planning step {i}.")}],
                                  "encrypted_content": "ZW5jcnlwdGVkLXJlYXNvbmluZw=="}));
                if !text.trim().is_empty() {
                    items.push(json!({"type": "message", "role": "assistant", "id": format!("msg_{i}"),
                                      "status": "completed",
                                      "content": [{"type": "output_text", "text": text, "annotations": []}]}));
                }
                let calls = m["tool_calls"].as_array().cloned().unwrap_or_default();
                if calls.is_empty() && text.trim().is_empty() {
                    items.push(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "(no content)"}]}));
                }
                for (k, call) in calls.iter().enumerate() {
                    let id = format!("call_{i}_{k}");
                    if let Some(old) = call["id"].as_str() {
                        renamed.insert(old.to_owned(), id.clone());
                    }
                    items.push(json!({"type": "function_call", "id": format!("fc_{i}_{k}"), "call_id": id,
                                      "name": call["function"]["name"], "arguments": call["function"]["arguments"]}));
                }
            }
            "tool" => {
                let id = m["tool_call_id"]
                    .as_str()
                    .and_then(|old| renamed.get(old))
                    .cloned()
                    .unwrap_or_default();
                items.push(json!({"type": "function_call_output", "call_id": id, "output": text}));
            }
            _ => {}
        }
    }
    (instructions, items)
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
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "one"}),
            json!({"role": "assistant", "content": "again", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "two"}),
        ];
        let (instructions, items) = from_chat(&chat);
        assert_eq!(instructions, Some(json!("sys")));
        assert_eq!(items.len(), 8);
        assert_eq!(items[7]["call_id"], "call_4_0");
        let request = json!({"instructions": instructions, "input": items.clone()});
        assert_eq!(check_responses(&request, 1000), Ok(()));
        // Without the reasoning item of response 4, its message and call are refused.
        let cut = json!({"input": items[5..].to_vec()});
        assert!(matches!(
            check_responses(&cut, 1000),
            Err(Rejection::Invalid(_))
        ));
    }
}
