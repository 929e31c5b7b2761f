//! Dialects: which wire format a request speaks, and the modules that read and write each.
//!
//! A dialect parses a provider's request body into the engine's neutral transcript and writes a
//! compaction plan back into the *original* JSON, so every field compactor does not interpret
//! survives untouched.
//!
//! The engine and the session layer see a dialect only through [`DialectKind`]'s three entry
//! points, cheapest first: [`DialectKind::peek`] (count and estimate, every request),
//! [`DialectKind::raw_messages`] (the messages as raw JSON, for session identity and
//! checkpoint hashing) and [`DialectKind::parse`] (the full [`ParsedRequest`], only when a
//! request must be rewritten).
//!
//! One module per wire format: [`chat`] (OpenAI Chat Completions, the reference: zero-copy
//! peek, order-preserving raw rewrite), [`messages`] (Anthropic Messages) and [`responses`]
//! (OpenAI Responses), with the JSON plumbing the last two share in `json`.

pub mod chat;
pub(crate) mod json;
pub mod messages;
pub mod responses;

use serde_json::value::RawValue;

use crate::estimate::LazyEstimator;
use crate::transcript::{Message, Transcript};

pub use chat::Peek;

/// Why a body could not be read or rewritten in its dialect. Every one of these sends the
/// request upstream unchanged.
#[derive(Debug, thiserror::Error)]
pub enum DialectError {
    /// Not JSON, or JSON of an unexpected shape.
    #[error("invalid request body: {0}")]
    Json(#[from] serde_json::Error),
    /// The body has no single conversation field: `messages`, or `input` for Responses.
    #[error("request has no single `{0}`")]
    NoConversation(&'static str),
    /// A message (Responses: an input item) the dialect does not understand.
    #[error("message {index}: {reason}")]
    BadMessage {
        /// Position in the conversation.
        index: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// A rewrite plan that does not fit the request.
    #[error("rewrite plan out of range: head {head}, boundary {boundary}, {len} messages")]
    BadPlan {
        /// Leading messages kept.
        head: usize,
        /// First message of the tail.
        boundary: usize,
        /// Messages in the request.
        len: usize,
    },
    /// Anthropic: the tail would start with `tool_result` blocks, which must answer the
    /// message before them.
    #[error("the preserved tail cannot start with tool results")]
    TailStartsWithToolResult,
    /// The conversation lives on the provider (`previous_response_id`, `conversation`): there
    /// is no history to compact, so the request passes through (counted as `server_state`).
    #[error("history held by the provider; passed through")]
    ServerState,
}

/// What the engine reads from a request, whatever its dialect.
///
/// `transcript.messages[i]` and `raw_messages[i]` describe the same wire message, so indices
/// chosen by the engine (head, boundary) and by the session layer (covered prefix) mean the
/// same thing to the dialect.
#[derive(Debug)]
pub struct Conversation<'a> {
    /// The wire messages (Responses: input items) as raw JSON, in order.
    pub raw_messages: Vec<&'a RawValue>,
    /// The `model` field.
    pub model: Option<String>,
    /// Output tokens the request reserves (`max_tokens` and friends).
    pub requested_output: Option<usize>,
    /// Estimated tokens outside the messages (tool definitions, top-level system prompts).
    pub fixed_tokens: usize,
    /// The neutral transcript, message for message.
    pub transcript: Transcript,
}

impl<'a> Conversation<'a> {
    /// Pairs the raw messages with their neutral form, resolving tool names across them.
    fn new(
        raw_messages: Vec<&'a RawValue>,
        messages: Vec<Message>,
        model: Option<String>,
        requested_output: Option<usize>,
        fixed_tokens: usize,
    ) -> Conversation<'a> {
        let mut transcript = Transcript::new(messages);
        transcript.resolve_tool_names();
        Conversation {
            raw_messages,
            model,
            requested_output,
            fixed_tokens,
            transcript,
        }
    }

    /// The messages a rewrite keeps around the summary: `[..head]` and `[boundary..]`, or
    /// [`DialectError::BadPlan`] when the plan does not fit the request.
    pub fn kept(
        &self,
        head: usize,
        boundary: usize,
    ) -> Result<(&[&'a RawValue], &[&'a RawValue]), DialectError> {
        let len = self.raw_messages.len();
        if head > boundary || boundary > len {
            return Err(DialectError::BadPlan {
                head,
                boundary,
                len,
            });
        }
        Ok((&self.raw_messages[..head], &self.raw_messages[boundary..]))
    }

    /// Estimated tokens of the whole request as received.
    pub fn tokens(&self) -> usize {
        self.fixed_tokens
            .saturating_add(self.transcript.tokens(0..self.transcript.len()))
    }
}

/// A request parsed for rewriting: what the engine reads and how the plan is written back.
pub trait ParsedRequest: Send + Sync {
    /// The conversation the engine works on.
    fn conversation(&self) -> &Conversation<'_>;
    /// The request with messages `[head..boundary]` replaced by one user message holding
    /// `summary_message`; everything else as received.
    fn rewrite(
        &self,
        head: usize,
        boundary: usize,
        summary_message: &str,
    ) -> Result<Vec<u8>, DialectError>;
}

/// The chat wire formats compactor can compact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialectKind {
    /// OpenAI Chat Completions: `POST …/chat/completions`.
    ChatCompletions,
    /// Anthropic Messages: `POST …/messages`.
    Messages,
    /// OpenAI Responses: `POST …/responses`.
    Responses,
}

impl DialectKind {
    /// The dialect of a `POST` to `path` (after route prefix handling), if it is a chat call.
    ///
    /// Matches on the last path segments so `/v1/chat/completions`, `/chat/completions` and
    /// `/openai/deployments/x/chat/completions` all count.
    pub fn from_path(path: &str) -> Option<DialectKind> {
        let path = path.trim_end_matches('/');
        if path.ends_with("/chat/completions") {
            Some(DialectKind::ChatCompletions)
        } else if path.ends_with("/messages") && !path.ends_with("/threads/messages") {
            Some(DialectKind::Messages)
        } else if path.ends_with("/responses") {
            Some(DialectKind::Responses)
        } else {
            None
        }
    }

    /// Counts and estimates a request without building it (the hot path).
    pub fn peek(self, body: &[u8], estimator: &LazyEstimator) -> Result<Peek, DialectError> {
        match self {
            DialectKind::ChatCompletions => chat::peek(body, estimator),
            DialectKind::Messages => messages::peek(body, estimator),
            DialectKind::Responses => responses::peek(body, estimator),
        }
    }

    /// The request's messages as raw JSON slices of `body`.
    pub fn raw_messages(self, body: &[u8]) -> Result<Vec<&RawValue>, DialectError> {
        match self {
            DialectKind::ChatCompletions | DialectKind::Messages => chat::raw_messages(body),
            DialectKind::Responses => responses::raw_messages(body),
        }
    }

    /// Parses a request fully, for rewriting.
    pub fn parse<'a>(
        self,
        body: &'a [u8],
        estimator: &LazyEstimator,
    ) -> Result<Box<dyn ParsedRequest + 'a>, DialectError> {
        match self {
            DialectKind::ChatCompletions => Ok(Box::new(chat::parse_with(body, estimator)?)),
            DialectKind::Messages => Ok(Box::new(messages::parse_with(body, estimator)?)),
            DialectKind::Responses => Ok(Box::new(responses::parse_with(body, estimator)?)),
        }
    }

    /// The wire API a summarizer calling the caller's provider should speak.
    pub fn api(self) -> compactor_plugin_api::Api {
        match self {
            DialectKind::ChatCompletions => compactor_plugin_api::Api::ChatCompletions,
            DialectKind::Messages => compactor_plugin_api::Api::Messages,
            DialectKind::Responses => compactor_plugin_api::Api::Responses,
        }
    }

    /// The bounded metric label of this dialect.
    pub fn label(self) -> &'static str {
        match self {
            DialectKind::ChatCompletions => "chat_completions",
            DialectKind::Messages => "messages",
            DialectKind::Responses => "responses",
        }
    }

    /// The path prefix before the API path: `/v1` for `/v1/chat/completions`.
    pub fn api_prefix(self, path: &str) -> &str {
        let suffix = match self {
            DialectKind::ChatCompletions => "/chat/completions",
            DialectKind::Messages => "/messages",
            DialectKind::Responses => "/responses",
        };
        let path = path.trim_end_matches('/');
        path.strip_suffix(suffix).unwrap_or("")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_paths_are_recognised_under_any_prefix() {
        use DialectKind::*;
        assert_eq!(
            DialectKind::from_path("/v1/chat/completions"),
            Some(ChatCompletions)
        );
        assert_eq!(
            DialectKind::from_path("/chat/completions"),
            Some(ChatCompletions)
        );
        assert_eq!(
            DialectKind::from_path("/anthropic/v1/messages"),
            Some(Messages)
        );
        assert_eq!(DialectKind::from_path("/v1/responses/"), Some(Responses));
        assert_eq!(DialectKind::from_path("/v1/models"), None);
        assert_eq!(DialectKind::from_path("/v1/messages/count_tokens"), None);
        assert_eq!(ChatCompletions.api_prefix("/v1/chat/completions"), "/v1");
        assert_eq!(ChatCompletions.api_prefix("/chat/completions"), "");
    }

    /// The session id comes from the peek's copy of the first messages; it must name the same
    /// session as the messages themselves (whitespace aside), in every dialect.
    #[test]
    fn peek_keeps_the_first_messages_the_session_id_is_made_of() {
        use crate::session::hash::{session_id, TenantId};
        let bodies = [
            (
                DialectKind::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"system","content":"s"}, {"role":"user","content":"a"},{"role":"user","content":"b"}]}"#,
            ),
            (
                DialectKind::Messages,
                r#"{"model":"m","messages":[{"role":"user","content":"a"},  {"role":"assistant","content":[{"type":"text","text":"b"}]},{"role":"user","content":"c"}]}"#,
            ),
            (
                DialectKind::Responses,
                r#"{"model":"m","input":[{"role":"user","content":"a"}, {"type":"function_call","call_id":"c","name":"f","arguments":"{}"}]}"#,
            ),
            (
                DialectKind::Responses,
                r#"{"model":"m","input":"caf\u00e9 \"quoted\""}"#,
            ),
        ];
        let est = LazyEstimator::default();
        let tenant = TenantId::from_credential("k");
        for (dialect, body) in bodies {
            let peek = dialect.peek(body.as_bytes(), &est).expect("peek");
            let raw = dialect.raw_messages(body.as_bytes()).expect("raw");
            let from_raw: Vec<&str> = raw.iter().take(2).map(|m| m.get()).collect();
            let from_peek: Vec<&str> = peek.first_messages.iter().map(String::as_str).collect();
            assert_eq!(from_peek.len(), from_raw.len().min(2), "{body}");
            assert_eq!(
                session_id(&tenant, None, &from_peek),
                session_id(&tenant, None, &from_raw),
                "{body}"
            );
        }
    }
}
