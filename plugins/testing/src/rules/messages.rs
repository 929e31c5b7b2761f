//! Anthropic Messages. The API combines consecutive messages of one role into one turn before
//! it applies its rules, so these rules are checked on turns: the first turn is the user's;
//! `tool_result` blocks come first in their turn and answer a `tool_use` of the turn right
//! before; every `tool_use` (but in the last turn) is answered in the next turn; thinking
//! blocks lead their turn; with thinking enabled, a request continuing a tool loop has its
//! final assistant turn open with a thinking block. At most four blocks (tools, system,
//! messages) carry `cache_control`.

use serde_json::{json, Value};

use super::Rejection;

/// Cache breakpoints a request may set.
const MAX_CACHE_BREAKPOINTS: usize = 4;

/// A message's content as blocks (a string is one text block).
fn blocks(m: &Value) -> Vec<Value> {
    match &m["content"] {
        Value::Array(b) => b.clone(),
        Value::String(s) => vec![json!({"type": "text", "text": s})],
        _ => Vec::new(),
    }
}

/// One turn as the model sees it: consecutive messages of one role, their blocks in order.
struct Turn {
    role: Value,
    /// Index of the turn's first message, for error messages.
    at: usize,
    blocks: Vec<Value>,
}

impl Turn {
    fn ids(&self, kind: &str, key: &str) -> Vec<String> {
        self.blocks
            .iter()
            .filter(|b| b["type"] == kind)
            .filter_map(|b| b[key].as_str().map(str::to_owned))
            .collect()
    }

    fn results(&self) -> Vec<String> {
        self.ids("tool_result", "tool_use_id")
    }

    fn calls(&self) -> Vec<String> {
        self.ids("tool_use", "id")
    }

    fn opens_with_thinking(&self) -> bool {
        self.blocks.first().is_some_and(is_thinking)
    }
}

/// Consecutive messages of one role combined, as the API does.
fn turns(messages: &[Value]) -> Vec<Turn> {
    let mut out: Vec<Turn> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        match out.last_mut() {
            Some(turn) if turn.role == m["role"] => turn.blocks.extend(blocks(m)),
            _ => out.push(Turn {
                role: m["role"].clone(),
                at: i,
                blocks: blocks(m),
            }),
        }
    }
    out
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
/// JSON), tool results. Images count nothing here.
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

/// Blocks carrying `cache_control` among the tools, the system blocks and the messages'
/// blocks (tool results' inner blocks included).
pub fn cache_breakpoints(request: &Value) -> usize {
    fn count(v: &Value) -> usize {
        match v {
            Value::Array(items) => items.iter().map(count).sum(),
            Value::Object(o) => {
                usize::from(o.contains_key("cache_control")) + o.get("content").map_or(0, count)
            }
            _ => 0,
        }
    }
    count(&request["tools"]) + count(&request["system"]) + count(&request["messages"])
}

/// Tokens as the rules count them: 4 characters per token over `system` and `messages`.
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
    let turns = turns(messages);
    if turns.first().map(|t| &t.role) != Some(&json!("user")) {
        return invalid("messages: first message must use the \"user\" role".into());
    }
    for (k, turn) in turns.iter().enumerate() {
        let i = turn.at;
        match turn.role.as_str() {
            Some("user") => {
                let results = turn.results();
                let leading = turn
                    .blocks
                    .iter()
                    .take_while(|b| b["type"] == "tool_result")
                    .count();
                if leading != results.len() {
                    return invalid(format!("messages.{i}: tool_result blocks must come first"));
                }
                let calls = k
                    .checked_sub(1)
                    .map(|p| turns[p].calls())
                    .unwrap_or_default();
                if let Some(orphan) = results.iter().find(|r| !calls.contains(r)) {
                    return invalid(format!(
                        "messages.{i}.content: unexpected `tool_use_id` found in `tool_result` blocks: {orphan}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
                    ));
                }
            }
            Some("assistant") => {
                if turn.blocks.iter().any(is_thinking) && !turn.opens_with_thinking() {
                    return invalid(format!(
                        "messages.{i}.content.0: If an assistant message contains any thinking blocks, the first block must be thinking or redacted_thinking."
                    ));
                }
                if let Some(next) = turns.get(k + 1) {
                    let answered = next.results();
                    if let Some(open) = turn.calls().iter().find(|c| !answered.contains(c)) {
                        return invalid(format!(
                            "messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: {open}"
                        ));
                    }
                }
            }
            _ => {
                return invalid(format!(
                    "messages.{i}.role: Input should be 'user' or 'assistant'"
                ))
            }
        }
    }
    // `enabled` with a budget, or `adaptive` (the model decides how much to think).
    let thinking = matches!(
        request["thinking"]["type"].as_str(),
        Some("enabled" | "adaptive")
    );
    let continues_loop = turns.last().is_some_and(|t| !t.results().is_empty());
    if thinking && continues_loop {
        // The final assistant turn: the one after the last user turn that answers no tool.
        let opener = turns
            .iter()
            .rposition(|t| t.role == "user" && t.results().is_empty())
            .map_or(0, |u| u + 1);
        if !turns.get(opener).is_some_and(Turn::opens_with_thinking) {
            let i = turns.get(opener).map_or(0, |t| t.at);
            return invalid(format!(
                "messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`. When `thinking` is enabled, a final `assistant` message must start with a thinking block."
            ));
        }
    }
    let breakpoints = cache_breakpoints(request);
    if breakpoints > MAX_CACHE_BREAKPOINTS {
        return invalid(format!(
            "A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. Found {breakpoints}."
        ));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn user(text: &str) -> Value {
        json!({"role": "user", "content": text})
    }

    #[test]
    fn the_rules_refuse_what_anthropic_refuses() {
        let call = json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]});
        let answer = json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]});
        let ok = json!({"messages": [user("hi"), call, answer]});
        assert_eq!(check_messages(&ok, 1000), Ok(()));
        let bad = [
            json!({"messages": [call, answer]}),
            json!({"messages": [user("hi"), call, user("?")]}),
            json!({"messages": [user("hi"), {"role": "assistant", "content": "a"}, answer]}),
            json!({"messages": [user("hi"), call,
                {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}),
            json!({"thinking": {"type": "enabled"}, "messages": [user("hi"), call, answer]}),
            json!({"thinking": {"type": "adaptive"}, "messages": [user("hi"), call, answer]}),
            json!({"messages": [user("hi"), {"role": "system", "content": "no"}]}),
        ];
        for b in bad {
            assert!(
                matches!(check_messages(&b, 1000), Err(Rejection::Invalid(_))),
                "{b}"
            );
        }
        let big = json!({"system": "abcd", "messages": [user(&"x".repeat(40))]});
        assert_eq!(
            check_messages(&big, 10),
            Err(Rejection::ContextLength {
                tokens: 11,
                window: 10
            })
        );
    }

    #[test]
    fn consecutive_messages_of_one_role_are_one_turn() {
        let thinking = json!({"type": "thinking", "thinking": "t", "signature": "s"});
        let call = json!({"type": "tool_use", "id": "t", "name": "f", "input": {}});
        let result = json!({"type": "tool_result", "tool_use_id": "t", "content": "x"});
        let with_thinking =
            |messages: Value| json!({"thinking": {"type": "enabled"}, "messages": messages});
        // Split turns the API combines: valid.
        for ok in [
            json!({"messages": [user("hi"), user("again")]}),
            // A reminder sent after the tool results joins them.
            with_thinking(json!([user("hi"),
                {"role": "assistant", "content": [thinking, call]},
                {"role": "user", "content": [result]}, user("<system-reminder>r</system-reminder>")])),
            // Thinking and text in one message, the call in the next: one turn opening with
            // thinking, answered by the next turn.
            with_thinking(json!([user("hi"),
                {"role": "assistant", "content": [thinking, {"type": "text", "text": "look"}]},
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result]}])),
            // Calls in two consecutive messages are one turn's calls, answered together.
            json!({"messages": [user("hi"),
                {"role": "assistant", "content": [call]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "u", "name": "f", "input": {}}]},
                {"role": "user", "content": [result, {"type": "tool_result", "tool_use_id": "u", "content": "y"}]}]}),
        ] {
            assert_eq!(check_messages(&ok, 1000), Ok(()), "{ok}");
        }
        // A tail that starts inside such a turn is refused: the final turn no longer opens
        // with thinking, or a result comes after text.
        for bad in [
            with_thinking(json!([user("summary"),
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result]}])),
            json!({"messages": [user("hi"), {"role": "assistant", "content": [call]},
                user("first"), {"role": "user", "content": [result]}]}),
        ] {
            assert!(
                matches!(check_messages(&bad, 1000), Err(Rejection::Invalid(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn at_most_four_cache_breakpoints() {
        let cached =
            |t: &str| json!({"type": "text", "text": t, "cache_control": {"type": "ephemeral"}});
        let request = |n: usize| {
            json!({
                "tools": [{"name": "f", "input_schema": {}, "cache_control": {"type": "ephemeral"}}],
                "system": [cached("sys")],
                "messages": [{"role": "user", "content": (0..n).map(|i| cached(&i.to_string())).collect::<Vec<_>>()}],
            })
        };
        assert_eq!(cache_breakpoints(&request(2)), 4);
        assert_eq!(check_messages(&request(2), 1000), Ok(()));
        assert!(matches!(
            check_messages(&request(3), 1000),
            Err(Rejection::Invalid(m)) if m.contains("Found 5")
        ));
    }
}
