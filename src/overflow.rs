//! Provider refusals for length: recognising that a provider refused a request because it did
//! not fit the model's context window, and the numbers it named.
//!
//! Compact-and-retry (a request the provider refused for its length is compacted and sent
//! once more before any byte reaches the client) and learned context windows both start
//! here. Every provider words the refusal its own way, so recognition is by the phrases each
//! one uses (each wire format's module declares its provider's, `REFUSAL`), and the window and
//! the request's size are read from the message where it names them:
//!
//! | provider | status | words |
//! | --- | --- | --- |
//! | OpenAI Chat Completions, vLLM | 400 | `This model's maximum context length is N tokens. However, you requested M tokens …` (code `context_length_exceeded`) |
//! | OpenAI Responses | 400 | `Your input exceeds the context window of this model …` (code `context_length_exceeded`) |
//! | Anthropic Messages | 400 | `prompt is too long: M tokens > N maximum` |
//! | Google Gemini | 400 | `The input token count (M) exceeds the maximum number of tokens allowed (N).` (status `INVALID_ARGUMENT`) |
//! | llama.cpp server | 400 | `request (M tokens) exceeds the available context size (N tokens)` (type `exceed_context_size_error`, fields `n_prompt_tokens`, `n_ctx`) |
//! | Ollama | 400, 500 | `the input length exceeds the context length` |
//! | OpenRouter | 400 | `This endpoint's maximum context length is N tokens. However, you requested about M tokens …` |
//!
//! Some refuse inside a `200` event stream instead, before any content ([`recognise_streamed`]
//! reads the event's `data`; the proxy holds a chat stream's first events to see them):
//!
//! | provider | event | words |
//! | --- | --- | --- |
//! | OpenAI Responses | `response.failed`, its `response.error` | `Your input exceeds the context window of this model …` (code `context_length_exceeded`) |
//! | OpenAI Responses | `error` (`code`, `message` at the top) | same |
//! | Anthropic Messages | `error` (`{"type":"error","error":{…}}`, as the 400 body) | `prompt is too long: M tokens > N maximum` |
//! | OpenAI Chat Completions and compatibles | a chunk `{"error":{…}}` (as the 400 body) | `This model's maximum context length is N tokens …` (code `context_length_exceeded`) |
//!
//! A rate limit is never a length refusal (429, or a `tokens per min` message), however it is
//! worded: compacting would not help it.

use serde_json::Value;

use crate::dialect::DialectKind;

/// A provider's refusal of a request for its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow {
    /// The context window the provider named, in tokens.
    pub window: Option<usize>,
    /// The size of the refused request the provider named, in tokens.
    pub requested: Option<usize>,
}

/// Phrases (lowercase) that mark a rate limit, which compaction does not cure.
const RATE_LIMITS: &[&str] = &["tokens per min", "rate_limit", "rate limit"];

/// Whether a response with `status` and `body` is a refusal for length, and what it names.
pub fn recognise(status: u16, body: &[u8]) -> Option<Overflow> {
    if !matches!(status, 400 | 413 | 422 | 500) {
        return None;
    }
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let text = match &parsed {
        Some(v) => error_text(v),
        None => String::from_utf8_lossy(body).into_owned(),
    };
    recognise_text(&text, parsed.as_ref())
}

/// Whether the `data` of an error event in a `200` event stream (the shapes in the second
/// table of the module docs) is a refusal for length, and what it names. `data` that is not
/// JSON is not an error event, so never a refusal.
pub fn recognise_streamed(data: &[u8]) -> Option<Overflow> {
    let parsed: Value = serde_json::from_slice(data).ok()?;
    // Responses' `response.failed` carries the failed response, whose `error` is the refusal.
    let failed = parsed
        .get("response")
        .and_then(|r| r.get("error"))
        .filter(|e| e.is_object());
    let text = match failed {
        Some(error) => error_text(&serde_json::json!({ "error": error })),
        None => error_text(&parsed),
    };
    recognise_text(&text, Some(&parsed))
}

/// The refusal `text` (an error's words, or a body that is not JSON) names, if it is one:
/// in the words of any format's provider ([`DialectKind::refusal_wording`], tried in
/// [`DialectKind::ALL`]'s order), since a gateway may answer a request of one format in
/// another's. `parsed` is the JSON it came from, for the fields llama.cpp names numbers in.
fn recognise_text(text: &str, parsed: Option<&Value>) -> Option<Overflow> {
    let lower = text.to_lowercase();
    let wordings = || {
        DialectKind::ALL
            .into_iter()
            .map(DialectKind::refusal_wording)
    };
    let refused = wordings().any(|w| w.phrases.iter().any(|p| lower.contains(p)));
    if RATE_LIMITS.iter().any(|p| lower.contains(p)) || !refused {
        return None;
    }
    let field = |name: &str| {
        parsed
            .and_then(|v| v.get("error").unwrap_or(v).get(name))
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
    };
    let window = wordings()
        .filter_map(|w| w.fields)
        .find_map(|(window, _)| field(window))
        .or_else(|| {
            wordings().find_map(|w| {
                w.window_after
                    .iter()
                    .find_map(|p| number_after(&lower, p))
                    .or_else(|| {
                        w.window_between
                            .and_then(|(before, after)| number_between(&lower, before, after))
                    })
            })
        });
    let requested = wordings()
        .filter_map(|w| w.fields)
        .find_map(|(_, requested)| field(requested))
        .or_else(|| {
            wordings().find_map(|w| {
                w.requested_after
                    .iter()
                    .find_map(|p| number_after(&lower, p))
            })
        });
    Some(Overflow { window, requested })
}

/// The human-readable error of a provider's JSON body: `error.message`, `error` as a string,
/// or `message`, with `error.code`, `error.type` and `code` appended (the phrases may be
/// there; Responses' streamed `error` event has its `code` and `message` at the top).
fn error_text(v: &Value) -> String {
    let error = v.get("error");
    let mut text = String::new();
    for part in [
        error.and_then(|e| e.get("message")),
        error.filter(|e| e.is_string()),
        v.get("message"),
        v.get("detail"),
        error.and_then(|e| e.get("code")),
        error.and_then(|e| e.get("type")),
        v.get("code"),
    ]
    .into_iter()
    .flatten()
    {
        if let Some(s) = part.as_str() {
            text.push_str(s);
            text.push('\n');
        }
    }
    text
}

/// The number right after `phrase` in `text` (digits, `,` and `_` grouping allowed).
fn number_after(text: &str, phrase: &str) -> Option<usize> {
    let at = text.find(phrase)? + phrase.len();
    leading_number(&text[at..])
}

/// The number after `before` that `after` follows (Anthropic's `… > N maximum`).
fn number_between(text: &str, before: &str, after: &str) -> Option<usize> {
    let at = text.find(before)? + before.len();
    let rest = &text[at..];
    let n = leading_number(rest)?;
    rest.trim_start()
        .trim_start_matches(|c: char| c.is_ascii_digit() || c == ',' || c == '_')
        .trim_start()
        .starts_with(after)
        .then_some(n)
}

fn leading_number(text: &str) -> Option<usize> {
    let digits: String = text
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == ',' || *c == '_')
        .filter(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(status: u16, body: &Value, window: Option<usize>, requested: Option<usize>) {
        let bytes = body.to_string();
        assert_eq!(
            recognise(status, bytes.as_bytes()),
            Some(Overflow { window, requested }),
            "{bytes}"
        );
    }

    #[test]
    fn every_provider_wording_is_recognised_with_its_numbers() {
        // Google Gemini.
        check(
            400,
            &json!({"error": {"code": 400, "message": "The input token count (1196265) exceeds the maximum number of tokens allowed (1048575).", "status": "INVALID_ARGUMENT"}}),
            Some(1_048_575),
            Some(1_196_265),
        );
        // OpenAI Chat Completions.
        check(
            400,
            &json!({"error": {"message": "This model's maximum context length is 128000 tokens. However, your messages resulted in 130512 tokens. Please reduce the length of the messages.", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}),
            Some(128_000),
            Some(130_512),
        );
        // vLLM (OpenAI-compatible).
        check(
            400,
            &json!({"object": "error", "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.", "type": "BadRequestError", "param": null, "code": 400}),
            Some(4096),
            Some(5000),
        );
        // OpenAI Responses.
        check(
            400,
            &json!({"error": {"message": "Your input exceeds the context window of this model. Please adjust your input and try again.", "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}}),
            None,
            None,
        );
        // Anthropic Messages.
        check(
            400,
            &json!({"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: 208317 tokens > 200000 maximum"}}),
            Some(200_000),
            Some(208_317),
        );
        // llama.cpp server.
        check(
            400,
            &json!({"error": {"code": 400, "message": "request (4476 tokens) exceeds the available context size (4096 tokens), try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 4476, "n_ctx": 4096}}),
            Some(4096),
            Some(4476),
        );
        // Ollama.
        check(
            500,
            &json!({"error": "the input length exceeds the context length"}),
            None,
            None,
        );
        // OpenRouter, numbers grouped.
        check(
            400,
            &json!({"error": {"message": "This endpoint's maximum context length is 200,000 tokens. However, you requested about 251,333 tokens (251,333 of text input). Please reduce the length of either one, or use the \"middle-out\" transform to compress your prompt automatically.", "code": 400}}),
            Some(200_000),
            Some(251_333),
        );
        // Not JSON at all (a proxy in between rewrote the body).
        assert_eq!(
            recognise(400, b"prompt is too long: 9000 tokens > 8192 maximum"),
            Some(Overflow {
                window: Some(8192),
                requested: Some(9000)
            })
        );
    }

    #[test]
    fn other_refusals_are_not_length_refusals() {
        for (status, body) in [
            // A rate limit on tokens per minute: compaction does not cure it.
            (
                429,
                json!({"error": {"message": "Request too large for gpt-4o on tokens per min (TPM): Limit 30000, Requested 50000.", "type": "tokens", "code": "rate_limit_exceeded"}}),
            ),
            (
                413,
                json!({"error": {"message": "Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 50000.", "type": "tokens", "code": "rate_limit_exceeded"}}),
            ),
            (
                400,
                json!({"error": {"message": "The model `gpt-9` does not exist", "code": "model_not_found"}}),
            ),
            (
                401,
                json!({"error": {"message": "maximum context length is 10 tokens"}}),
            ),
            (200, json!({"choices": []})),
            (503, json!({"error": "overloaded"})),
        ] {
            assert_eq!(
                recognise(status, body.to_string().as_bytes()),
                None,
                "{body}"
            );
        }
        assert_eq!(recognise(400, b""), None);
        assert_eq!(recognise(400, b"\xff\xfe"), None);
    }

    fn streamed(data: &Value) -> Option<Overflow> {
        recognise_streamed(data.to_string().as_bytes())
    }

    #[test]
    fn refusals_streamed_in_a_200_are_recognised_with_their_numbers() {
        // OpenAI Responses: `response.failed`, the failed response's `error`.
        assert_eq!(
            streamed(&json!({"type": "response.failed", "sequence_number": 2,
                "response": {"id": "resp_1", "object": "response", "status": "failed",
                    "instructions": "You are Codex.", "output": [],
                    "error": {"code": "context_length_exceeded",
                        "message": "Your input exceeds the context window of this model. Please adjust your input and try again."}}})),
            Some(Overflow {
                window: None,
                requested: None
            })
        );
        // OpenAI Responses: an `error` event, code and message at the top.
        assert_eq!(
            streamed(
                &json!({"type": "error", "sequence_number": 1, "code": "context_length_exceeded",
                "message": "Your input exceeds the context window of this model.", "param": null})
            ),
            Some(Overflow {
                window: None,
                requested: None
            })
        );
        // Anthropic Messages: an `error` event.
        assert_eq!(
            streamed(
                &json!({"type": "error", "error": {"type": "invalid_request_error",
                "message": "prompt is too long: 208317 tokens > 200000 maximum"}})
            ),
            Some(Overflow {
                window: Some(200_000),
                requested: Some(208_317)
            })
        );
        // Chat Completions: an error chunk.
        assert_eq!(
            streamed(
                &json!({"error": {"message": "This model's maximum context length is 128000 tokens. However, your messages resulted in 130512 tokens.",
                "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}})
            ),
            Some(Overflow {
                window: Some(128_000),
                requested: Some(130_512)
            })
        );
    }

    #[test]
    fn other_streamed_failures_are_not_length_refusals() {
        for data in [
            json!({"type": "response.failed", "response": {"status": "failed",
                "error": {"code": "server_error", "message": "The server had an error while processing your request."}}}),
            json!({"type": "response.failed", "response": {"status": "failed",
                "error": {"code": "rate_limit_exceeded", "message": "Rate limit reached for gpt-5 on tokens per min (TPM)"}}}),
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
            json!({"error": {"message": "The server is overloaded", "type": "server_error"}}),
            // Content that merely quotes the words is no error event.
            json!({"type": "response.output_text.delta", "delta": "maximum context length"}),
            json!({"type": "response.created", "response": {"status": "in_progress", "error": null,
                "instructions": "explain context_length_exceeded"}}),
        ] {
            assert_eq!(streamed(&data), None, "{data}");
        }
        assert_eq!(
            recognise_streamed(b"prompt is too long: 9 tokens > 8 maximum"),
            None
        );
        assert_eq!(recognise_streamed(b"[DONE]"), None);
    }
}
