//! OpenAI Chat Completions: tool messages answer the assistant message right before them and
//! every tool call is answered.

use serde_json::Value;

use super::Rejection;

/// Characters the model reads in one Chat Completions message: text (string or parts), tool
/// call names and arguments. Images count nothing here; the replays have none.
fn message_chars(message: &Value) -> usize {
    let mut chars = 0;
    match message.get("content") {
        Some(Value::String(s)) => chars += s.chars().count(),
        Some(Value::Array(parts)) => {
            for part in parts {
                if let Some(Value::String(t)) = part.get("text") {
                    chars += t.chars().count();
                }
            }
        }
        _ => {}
    }
    if let Some(Value::Array(calls)) = message.get("tool_calls") {
        for call in calls {
            let f = &call["function"];
            chars += f["name"].as_str().map_or(0, |s| s.chars().count());
            chars += f["arguments"].as_str().map_or(0, |s| s.chars().count());
        }
    }
    chars
}

/// Tokens as the mock provider counts them: 4 characters per token, rounded up per request.
pub fn chat_tokens(request: &Value) -> usize {
    let chars: usize = request["messages"]
        .as_array()
        .map(|m| m.iter().map(message_chars).sum())
        .unwrap_or(0);
    chars.div_ceil(4)
}

/// Checks a Chat Completions request the way OpenAI does, then its size against `window`.
pub fn check_chat(request: &Value, window: usize) -> Result<(), Rejection> {
    let invalid = |m: String| Err(Rejection::Invalid(m));
    let Some(messages) = request["messages"].as_array() else {
        return invalid("'messages' must be an array".into());
    };
    if messages.is_empty() {
        return invalid("'messages' must not be empty".into());
    }
    // Tool call ids of the latest assistant message still waiting for their results.
    let mut pending: Vec<String> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let role = m["role"].as_str().unwrap_or("");
        if role == "tool" {
            let id = m["tool_call_id"].as_str().unwrap_or("");
            match pending.iter().position(|p| p == id) {
                Some(at) => {
                    pending.remove(at);
                }
                None => {
                    return invalid(format!(
                        "messages[{i}]: messages with role 'tool' must be a response to a preceding message with 'tool_calls'"
                    ))
                }
            }
            continue;
        }
        if !pending.is_empty() {
            return invalid(format!(
                "messages[{i}]: an assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id' ({pending:?} unanswered)"
            ));
        }
        match role {
            "system" | "developer" | "user" => {}
            "assistant" => {
                if let Some(Value::Array(calls)) = m.get("tool_calls") {
                    pending = calls
                        .iter()
                        .filter_map(|c| c["id"].as_str().map(str::to_owned))
                        .collect();
                }
            }
            other => return invalid(format!("messages[{i}]: invalid role '{other}'")),
        }
    }
    if !pending.is_empty() {
        return invalid(format!("tool calls {pending:?} are never answered"));
    }
    let tokens = chat_tokens(request);
    if tokens > window {
        return Err(Rejection::ContextLength { tokens, window });
    }
    Ok(())
}

/// The provider's error body for a rejection.
pub fn rejection_body(r: &Rejection) -> Value {
    match r {
        Rejection::Invalid(message) => serde_json::json!({
            "error": {"message": message, "type": "invalid_request_error", "code": null}
        }),
        Rejection::ContextLength { tokens, window } => serde_json::json!({
            "error": {
                "message": format!("This model's maximum context length is {window} tokens. However, your messages resulted in {tokens} tokens."),
                "type": "invalid_request_error",
                "code": "context_length_exceeded"
            }
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unanswered_and_orphan_tool_messages_are_refused() {
        let call = json!({"role":"assistant","tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]});
        let ok = json!({"messages":[{"role":"user","content":"hi"}, call, {"role":"tool","tool_call_id":"a","content":"x"}]});
        assert_eq!(check_chat(&ok, 1000), Ok(()));
        let orphan = json!({"messages":[{"role":"user","content":"hi"},{"role":"tool","tool_call_id":"a","content":"x"}]});
        assert!(matches!(
            check_chat(&orphan, 1000),
            Err(Rejection::Invalid(_))
        ));
        let unanswered = json!({"messages":[{"role":"user","content":"hi"}, call, {"role":"user","content":"?"}]});
        assert!(matches!(
            check_chat(&unanswered, 1000),
            Err(Rejection::Invalid(_))
        ));
        let big = json!({"messages":[{"role":"user","content":"x".repeat(41)}]});
        assert_eq!(
            check_chat(&big, 10),
            Err(Rejection::ContextLength {
                tokens: 11,
                window: 10
            })
        );
    }
}
