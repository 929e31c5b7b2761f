//! Dialects: which wire format a request speaks, and the modules that read and write each.
//!
//! A dialect parses a provider's request body into the engine's neutral transcript and writes a
//! compaction plan back into the *original* JSON, so every field compactor does not interpret
//! survives untouched.

pub mod chat;

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
}
