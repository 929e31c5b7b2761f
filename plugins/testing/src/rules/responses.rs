//! OpenAI Responses: every `*_call_output` item has an earlier call item with the same
//! `call_id`, and every `mcp_approval_response` an earlier `mcp_approval_request` with its
//! `approval_request_id`; every call is answered, except calls at the very end of `input`; a `reasoning`
//! item is followed by an output it produced (never last, never followed by a user message or
//! a tool output); an output item (message or call) of a response that had reasoning comes with
//! that `reasoning` item.
//!
//! The real API knows which items one response produced from its own records; these rules read
//! it from item ids: `rs_N` is response `N`'s reasoning, and `msg_N`, `fc_N_K`, `ctc_N_K`,
//! `lsh_N_K` its assistant message and calls (function, custom tool, local shell). A test that
//! generates items gives ids in that form to the outputs of responses that had reasoning, and
//! none (or another form) to the others.

use serde_json::{json, Value};

use super::Rejection;

/// What an item's id says of it under the convention above.
#[derive(Debug, PartialEq, Eq)]
enum Produced<'a> {
    /// The reasoning of response `N`.
    Reasoning(&'a str),
    /// An output of response `N`, which had reasoning.
    Output(&'a str),
}

fn produced(item: &Value) -> Option<Produced<'_>> {
    let (prefix, rest) = item["id"].as_str()?.split_once('_')?;
    let n = rest.split('_').next()?;
    match prefix {
        "rs" => Some(Produced::Reasoning(n)),
        "msg" | "fc" | "ctc" | "lsh" => Some(Produced::Output(n)),
        _ => None,
    }
}

fn kind(item: &Value) -> &str {
    item["type"].as_str().unwrap_or("message")
}

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
    match kind(item) {
        "message" => text_chars(&item["content"]),
        "function_call" => text_chars(&item["name"]) + text_chars(&item["arguments"]),
        "function_call_output" => text_chars(&item["output"]),
        "reasoning" => text_chars(&item["summary"]),
        _ => 0,
    }
}

/// Tokens as the rules count them: 4 characters per token.
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
        Value::Array(items) => items.as_slice(),
        Value::String(_) => &[],
        _ => return invalid("Missing required parameter: 'input'.".into()),
    };
    let mut seen: Vec<&str> = Vec::new();
    let mut open: Vec<&str> = Vec::new();
    let mut reasoned: Vec<&str> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let item_kind = kind(item);
        let call_id = item["call_id"].as_str();
        if item_kind.ends_with("_call_output") {
            let id = call_id.unwrap_or_default();
            if !seen.contains(&id) {
                return invalid(format!(
                    "input[{i}]: No tool call found for function call output with call_id {id}."
                ));
            }
            open.retain(|o| *o != id);
        } else if item_kind.ends_with("_call") {
            if let Some(id) = call_id {
                seen.push(id);
                open.push(id);
            }
        }
        if item_kind == "mcp_approval_response" {
            let id = item["approval_request_id"].as_str().unwrap_or_default();
            let asked = items[..i]
                .iter()
                .any(|r| kind(r) == "mcp_approval_request" && r["id"] == id);
            if !asked {
                return invalid(format!(
                    "input[{i}]: No approval request found for approval_request_id {id}."
                ));
            }
        }
        if item_kind == "reasoning" {
            let next = items.get(i + 1);
            let follows = match next.map(kind) {
                Some("message") => next.is_some_and(|n| n["role"] == "assistant"),
                Some(t) => t.ends_with("_call") || t == "reasoning",
                None => false,
            };
            // When both ids say which response they belong to, it must be the same one.
            let same_response = match (produced(item), next.and_then(produced)) {
                (Some(Produced::Reasoning(n)), Some(Produced::Output(m))) => n == m,
                _ => true,
            };
            if !follows || !same_response {
                return invalid(format!(
                    "input[{i}]: Item of type 'reasoning' was provided without its required following item."
                ));
            }
        }
        match produced(item) {
            Some(Produced::Reasoning(n)) => reasoned.push(n),
            Some(Produced::Output(n)) if !reasoned.contains(&n) => {
                let id = item["id"].as_str().unwrap_or_default();
                return invalid(format!(
                    "input[{i}]: Item '{id}' was provided without its required 'reasoning' item: 'rs_{n}'."
                ));
            }
            _ => {}
        }
    }
    let trailing_calls = items
        .iter()
        .rev()
        .take_while(|it| kind(it).ends_with("_call"))
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
    fn reasoning_stays_with_the_outputs_of_its_own_response() {
        let user = json!({"role": "user", "content": "hi"});
        let rs = |n: u32| json!({"type": "reasoning", "id": format!("rs_{n}"), "summary": []});
        let call = |id: &str, c: &str| json!({"type": "function_call", "id": id, "call_id": c, "name": "f", "arguments": "{}"});
        let shell = |id: &str, c: &str| json!({"type": "local_shell_call", "id": id, "call_id": c, "action": {}});
        let out = |kind: &str, c: &str| json!({"type": kind, "call_id": c, "output": "x"});
        let ok = json!({"input": [user, rs(1), call("fc_1_0", "a"), shell("lsh_1_1", "b"),
            out("function_call_output", "a"), out("local_shell_call_output", "b"),
            {"type": "function_call", "call_id": "z", "name": "f", "arguments": "{}"},
            out("function_call_output", "z"),
            {"type": "mcp_approval_request", "id": "mcpr_1", "server_label": "docs", "name": "ask", "arguments": "{}"},
            {"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": true}]});
        assert_eq!(check_responses(&ok, 1000), Ok(()));
        for bad in [
            // The call of response 1 without its reasoning.
            json!({"input": [user, call("fc_1_0", "a"), out("function_call_output", "a")]}),
            // A custom tool call whose reasoning was cut.
            json!({"input": [user, {"type": "custom_tool_call", "id": "ctc_2_0", "call_id": "a", "input": ""},
                out("custom_tool_call_output", "a")]}),
            // An approval answered for a request the input no longer holds.
            json!({"input": [user, {"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": true}]}),
            // Reasoning of response 1 followed by the output of response 2.
            json!({"input": [user, rs(1), rs(2), call("fc_2_0", "a"), rs(1), call("fc_2_1", "b"),
                out("function_call_output", "a"), out("function_call_output", "b")]}),
        ] {
            assert!(
                matches!(check_responses(&bad, 1000), Err(Rejection::Invalid(_))),
                "{bad}"
            );
        }
    }
}
