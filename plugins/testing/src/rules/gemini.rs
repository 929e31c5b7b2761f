//! Google Gemini (`generateContent`). Checked on `contents`: every entry is the user's or the
//! model's (a missing role is the user's) with at least one part; the conversation opens with
//! the user and roles alternate; every `functionCall` of a model entry (but the last entry) is
//! answered by a `functionResponse` of the same name in the next entry, and every
//! `functionResponse` answers a call of the entry right before it (by id when both carry
//! one); a `thoughtSignature` sits only on the model's parts; and when the model's entries
//! carry signatures at all (a thinking model), every model entry of the current turn (since
//! the last user entry with text) that makes calls carries one on its first call, as Gemini 3
//! requires. Then the window, at 4 characters per token over `systemInstruction` and
//! `contents`.

use serde_json::{json, Value};

use super::Rejection;

fn role(entry: &Value) -> &str {
    entry["role"].as_str().unwrap_or("user")
}

fn parts(entry: &Value) -> &[Value] {
    entry["parts"].as_array().map_or(&[], Vec::as_slice)
}

fn call_of(part: &Value) -> Option<&Value> {
    part.get("functionCall")
        .or_else(|| part.get("function_call"))
}

fn response_of(part: &Value) -> Option<&Value> {
    part.get("functionResponse")
        .or_else(|| part.get("function_response"))
}

fn signed(part: &Value) -> bool {
    part.get("thoughtSignature").is_some() || part.get("thought_signature").is_some()
}

/// Characters the model reads of one part: text, function names and arguments (as JSON),
/// function responses (as JSON).
fn part_chars(part: &Value) -> usize {
    if let Some(text) = part["text"].as_str() {
        return text.chars().count();
    }
    if let Some(call) = call_of(part) {
        return call["name"].as_str().map_or(0, str::len) + call["args"].to_string().len();
    }
    if let Some(response) = response_of(part) {
        return response["name"].as_str().map_or(0, str::len)
            + response["response"].to_string().len();
    }
    0
}

/// Tokens as the rules count them: 4 characters per token over `systemInstruction` and
/// `contents`.
pub fn gemini_tokens(request: &Value) -> usize {
    let system = request
        .get("systemInstruction")
        .or_else(|| request.get("system_instruction"));
    let system: usize = system.map_or(0, |s| parts(s).iter().map(part_chars).sum());
    let contents: usize = request["contents"]
        .as_array()
        .map_or(0, |c| c.iter().flat_map(parts).map(part_chars).sum());
    (system + contents).div_ceil(4)
}

/// The body of Gemini's 400 for `rejection`.
pub fn rejection_body(rejection: &Rejection) -> Value {
    let message = match rejection {
        Rejection::Invalid(m) => m.clone(),
        Rejection::ContextLength { tokens, window } => format!(
            "The input token count ({tokens}) exceeds the maximum number of tokens allowed ({window})."
        ),
    };
    json!({"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}})
}

/// Checks a `generateContent` request the way Gemini does, then its size against `window`.
pub fn check_gemini(request: &Value, window: usize) -> Result<(), Rejection> {
    let invalid = |m: String| Err(Rejection::Invalid(m));
    let Some(contents) = request["contents"].as_array() else {
        return invalid("* GenerateContentRequest.contents: contents is not specified".into());
    };
    if contents.is_empty() {
        return invalid("* GenerateContentRequest.contents: contents is not specified".into());
    }
    let thinking = contents
        .iter()
        .filter(|e| role(e) == "model")
        .flat_map(parts)
        .any(signed);
    let current_turn = contents
        .iter()
        .rposition(|e| role(e) == "user" && parts(e).iter().any(|p| p["text"].is_string()))
        .unwrap_or(0);
    for (i, entry) in contents.iter().enumerate() {
        let r = role(entry);
        if r != "user" && r != "model" {
            return invalid(format!(
                "* GenerateContentRequest.contents[{i}].role: Please use a valid role: user, model."
            ));
        }
        if parts(entry).is_empty() {
            return invalid(format!(
                "* GenerateContentRequest.contents[{i}].parts: contents.parts must not be empty."
            ));
        }
        let expected = if i % 2 == 0 { "user" } else { "model" };
        if r != expected {
            return invalid(format!(
                "contents[{i}]: roles must alternate, starting with the user's (got {r})"
            ));
        }
        if r == "user" && parts(entry).iter().any(signed) {
            return invalid(format!("contents[{i}]: a thought signature on a user part"));
        }
        let calls: Vec<&Value> = parts(entry).iter().filter_map(call_of).collect();
        let responses: Vec<&Value> = parts(entry).iter().filter_map(response_of).collect();
        if !responses.is_empty() {
            let asked: Vec<&Value> = match i.checked_sub(1) {
                Some(p) if role(&contents[p]) == "model" => {
                    parts(&contents[p]).iter().filter_map(call_of).collect()
                }
                _ => Vec::new(),
            };
            for response in &responses {
                let answers = asked.iter().any(|call| {
                    call["name"] == response["name"]
                        && (call.get("id").is_none()
                            || response.get("id").is_none()
                            || call["id"] == response["id"])
                });
                if !answers {
                    return invalid(format!(
                        "contents[{i}]: function response {} answers no function call of the turn before",
                        response["name"]
                    ));
                }
            }
        }
        if !calls.is_empty() && i + 1 < contents.len() {
            let next: Vec<&Value> = parts(&contents[i + 1])
                .iter()
                .filter_map(response_of)
                .collect();
            if next.len() != calls.len() {
                return invalid(format!(
                    "Please ensure that function response turn comes immediately after a function call turn, and the number of function response parts equals the number of function call parts (contents[{i}])"
                ));
            }
        }
        if thinking && i > current_turn && !calls.is_empty() {
            let first_call = parts(entry).iter().find(|p| call_of(p).is_some());
            if !first_call.is_some_and(signed) {
                return invalid(format!(
                    "Function call is missing a thought_signature in functionCall parts (contents[{i}])"
                ));
            }
        }
    }
    let tokens = gemini_tokens(request);
    if tokens > window {
        return Err(Rejection::ContextLength { tokens, window });
    }
    Ok(())
}
