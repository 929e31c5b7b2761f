//! Strict OpenAI Responses validation for mock upstreams, and a converter from the Chat
//! Completions fixtures to Responses `input` items.
//!
//! Rules checked (those compaction could break): every `*_call_output` item has an earlier
//! call item with the same `call_id`; every call is answered, except calls at the very end of
//! `input`; a `reasoning` item is followed by the output it produced (never last, never
//! followed by a user message or an output); an output item (message or call) of a response
//! that had reasoning comes with that `reasoning` item. The real API knows which items one
//! response produced from its own records; this mock reads it from the ids [`from_chat`] gives
//! (`rs_N`, `msg_N`, `fc_N_K`: response `N`). Then the context window, at 4 characters per
//! token over `instructions` and the items' text.

use std::collections::HashMap;

use serde_json::{json, Value};

use super::provider_rules::Rejection;

fn text_chars(v: &Value) -> usize {
    match v {
        Value::String(s) => s.chars().count(),
        Value::Array(parts) => parts
            .iter()
            .map(|p| p["text"].as_str().map_or(0, |s| s.chars().count()))
            .sum(),
        _ => 0,
    }
}

fn item_chars(item: &Value) -> usize {
    match item["type"].as_str().unwrap_or("message") {
        "message" => text_chars(&item["content"]),
        "function_call" => text_chars(&item["name"]) + text_chars(&item["arguments"]),
        "function_call_output" => text_chars(&item["output"]),
        "reasoning" => text_chars(&item["summary"]),
        _ => 0,
    }
}

/// Tokens as the mock counts them: 4 characters per token.
pub fn responses_tokens(request: &Value) -> usize {
    let items: usize = match &request["input"] {
        Value::String(s) => s.chars().count(),
        Value::Array(items) => items.iter().map(item_chars).sum(),
        _ => 0,
    };
    (text_chars(&request["instructions"]) + items).div_ceil(4)
}

/// Checks a Responses request the way OpenAI does, then its size against `window`.
pub fn check_responses(request: &Value, window: usize) -> Result<(), Rejection> {
    let invalid = |m: String| Err(Rejection::Invalid(m));
    let items = match &request["input"] {
        Value::Array(items) => items.clone(),
        Value::String(_) => Vec::new(),
        _ => return invalid("Missing required parameter: 'input'.".into()),
    };
    let mut seen: Vec<String> = Vec::new();
    let mut open: Vec<String> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let kind = item["type"].as_str().unwrap_or("message");
        let call_id = item["call_id"].as_str().map(str::to_owned);
        if kind.ends_with("_call_output") {
            let id = call_id.unwrap_or_default();
            if !seen.contains(&id) {
                return invalid(format!(
                    "input[{i}]: No tool call found for function call output with call_id {id}."
                ));
            }
            open.retain(|o| *o != id);
        } else if kind.ends_with("_call") {
            if let Some(id) = call_id {
                seen.push(id.clone());
                open.push(id);
            }
        }
        if kind == "reasoning" {
            let next = items
                .get(i + 1)
                .map(|n| n["type"].as_str().unwrap_or("message"));
            let follows = match next {
                Some("message") => items[i + 1]["role"] == "assistant",
                Some(t) => t.ends_with("_call") || t == "reasoning",
                None => false,
            };
            if !follows {
                return invalid(format!(
                    "input[{i}]: Item of type 'reasoning' was provided without its required following item."
                ));
            }
        }
    }
    // Outputs of a response come with its reasoning item.
    let mut reasoned: Vec<&str> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let id = item["id"].as_str().unwrap_or("");
        if let Some(n) = id.strip_prefix("rs_") {
            reasoned.push(n);
            continue;
        }
        let response = id
            .strip_prefix("msg_")
            .or_else(|| id.strip_prefix("fc_").and_then(|r| r.split('_').next()));
        if let Some(n) = response {
            if !reasoned.contains(&n) {
                return invalid(format!(
                    "input[{i}]: Item '{id}' was provided without its required 'reasoning' item: 'rs_{n}'."
                ));
            }
        }
    }
    let trailing_calls = items
        .iter()
        .rev()
        .take_while(|it| it["type"].as_str().is_some_and(|t| t.ends_with("_call")))
        .count();
    if open.len() > trailing_calls {
        return invalid(format!("No tool output found for function calls {open:?}."));
    }
    let tokens = responses_tokens(request);
    if tokens > window {
        return Err(Rejection::ContextLength { tokens, window });
    }
    Ok(())
}

/// OpenAI's error body for a rejection.
pub fn rejection_body(r: &Rejection) -> Value {
    match r {
        Rejection::Invalid(message) => json!({
            "error": {"message": message, "type": "invalid_request_error", "param": "input", "code": null}
        }),
        Rejection::ContextLength { tokens, window } => json!({
            "error": {
                "message": format!("Your input exceeds the context window of this model ({tokens} > {window} tokens)."),
                "type": "invalid_request_error",
                "param": "input",
                "code": "context_length_exceeded"
            }
        }),
    }
}

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
    fn the_rules_refuse_what_openai_refuses() {
        let call = json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"});
        let output = json!({"type": "function_call_output", "call_id": "c", "output": "x"});
        let user = json!({"role": "user", "content": "hi"});
        let reasoning = json!({"type": "reasoning", "summary": []});
        assert_eq!(
            check_responses(&json!({"input": [user, call, output]}), 100),
            Ok(())
        );
        assert_eq!(
            check_responses(&json!({"input": [user, reasoning, call]}), 100),
            Ok(())
        );
        for bad in [
            json!({"input": [user, output]}),
            json!({"input": [user, call, user]}),
            json!({"input": [user, reasoning]}),
            json!({"input": [reasoning, user]}),
        ] {
            assert!(
                matches!(check_responses(&bad, 100), Err(Rejection::Invalid(_))),
                "{bad}"
            );
        }
        let big = json!({"instructions": "abcd", "input": "x".repeat(40)});
        assert_eq!(
            check_responses(&big, 10),
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
