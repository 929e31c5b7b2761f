//! The summarizer contract: everything a compactor summarizer plugin needs, in one file.
//!
//! compactor's compaction engine decides *what* to summarise (which turns, masked and
//! truncated) and renders the compaction prompt; a [`Summarizer`] decides *how* the summary
//! gets written: by an LLM endpoint, by a local algorithm, or by an external program. The
//! engine hands over a [`SummaryRequest`] and expects a [`Summary`] or a [`SummarizeError`].
//!
//! This crate does not depend on the app, so a plugin author reads this file and nothing else.
//! It is kept small on purpose: adding a field is a breaking change for every plugin.
#![deny(missing_docs)]

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use serde::Serialize;

/// A boxed, sendable future: what [`Summarizer::summarize`] returns, so the trait stays
/// object safe and backends can be held as `Arc<dyn Summarizer>`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A backend that writes compaction summaries.
///
/// Implementations must be cheap to share (`Send + Sync`): one instance serves every request.
/// They should not retry on their own; compactor's fallback chain decides what happens next.
pub trait Summarizer: Send + Sync {
    /// A short, stable name used in logs and as a metric label (`"openai"`, `"exec"`, ...).
    fn name(&self) -> &str;

    /// Writes the summary for one compaction.
    ///
    /// compactor enforces its own timeout around this future; backends that talk to a network
    /// or a process should still bound their own waits with [`SummaryRequest::timeout`].
    fn summarize<'a>(
        &'a self,
        request: &'a SummaryRequest,
    ) -> BoxFuture<'a, Result<Summary, SummarizeError>>;
}

/// Everything known about one compaction. Serialises (without credentials) to the JSON the
/// `exec` protocol sends to external programs.
#[derive(Debug, Clone, Serialize)]
pub struct SummaryRequest {
    /// The fully rendered compaction prompt (`<task>`, `<conversation>`, `<read-files>`,
    /// `<modified-files>`), ready to send to an LLM as the user message.
    pub prompt: String,
    /// The summary of the previous compaction of this conversation, if any.
    pub prior_summary: Option<String>,
    /// The turns being summarised, already masked and truncated as in the prompt.
    pub entries: Vec<Entry>,
    /// Files read during the conversation so far (carried over from prior compactions).
    pub read_files: Vec<String>,
    /// Files modified during the conversation so far (carried over from prior compactions).
    pub modified_files: Vec<String>,
    /// Focus instructions from a manual compaction (`/compact focus on the API changes`).
    pub instructions: Option<String>,
    /// 1-based number of this compaction within its conversation.
    pub compaction_num: u32,
    /// The model of the request being compacted, if it named one.
    pub model: Option<String>,
    /// The most tokens the summary should take.
    pub max_output_tokens: u32,
    /// How long compactor will wait for this summary.
    #[serde(with = "duration_secs")]
    pub timeout: Duration,
    /// Where the compacted request is going and with which credentials. Never serialised.
    #[serde(skip)]
    pub caller: Caller,
}

/// One turn of the conversation being summarised.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Entry {
    /// Who produced the turn.
    pub role: Role,
    /// What the turn holds, in order.
    pub parts: Vec<Part>,
}

/// The author of an [`Entry`]. Tool results belong to the assistant turn that called the tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The human (or the agent's harness speaking for them).
    User,
    /// The model, including its tool calls and their results.
    Assistant,
}

/// One piece of an [`Entry`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    /// Plain text.
    Text {
        /// The text, possibly truncated.
        text: String,
    },
    /// A tool invocation.
    ToolCall {
        /// The tool's name.
        name: String,
        /// Its arguments as sent by the model (usually JSON), possibly truncated.
        arguments: String,
    },
    /// The output of a tool invocation.
    ToolResult {
        /// The tool's name.
        name: String,
        /// The output, possibly truncated or masked.
        output: String,
        /// Whether the tool reported an error.
        is_error: bool,
    },
    /// The model's visible reasoning.
    Reasoning {
        /// The reasoning text, possibly truncated.
        text: String,
    },
}

/// The wire API of the request being compacted, so a backend that calls the caller's own
/// provider can speak that provider's language (an Anthropic upstream does not serve
/// `/chat/completions`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Api {
    /// OpenAI Chat Completions (`POST …/chat/completions`), and the default when unknown.
    #[default]
    ChatCompletions,
    /// Anthropic Messages (`POST …/messages`).
    Messages,
    /// OpenAI Responses (`POST …/responses`).
    Responses,
}

/// The destination and credentials of the request being compacted.
///
/// Backends that call the caller's own provider (the zero-configuration default) use these.
/// `Debug` never prints credential values.
#[derive(Clone, Default)]
pub struct Caller {
    /// Base URL of the upstream the request is routed to, e.g. `https://api.openai.com`.
    pub upstream_base_url: String,
    /// The request's path prefix before the API path (`/v1` for `/v1/chat/completions`).
    pub api_prefix: String,
    /// Credential headers of the request (`authorization`, `x-api-key`, `api-key`), by
    /// lowercase name.
    pub credentials: Vec<(String, String)>,
    /// The wire API the request itself used ([`Api::ChatCompletions`] when unknown).
    pub api: Api,
}

impl Caller {
    /// The value of one credential header, by lowercase name.
    pub fn credential(&self, name: &str) -> Option<&str> {
        self.credentials
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

impl fmt::Debug for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.credentials.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("Caller")
            .field("upstream_base_url", &self.upstream_base_url)
            .field("api_prefix", &self.api_prefix)
            .field("api", &self.api)
            .field("credentials", &format_args!("{names:?} (values redacted)"))
            .finish()
    }
}

/// A written summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// The summary text. compactor treats a blank one as a failure.
    pub text: String,
}

/// Why a summary could not be written. [`SummarizeError::kind`] is the metric label.
#[derive(Debug, thiserror::Error)]
pub enum SummarizeError {
    /// No answer within the allowed time.
    #[error("summarizer timed out after {0:?}")]
    Timeout(Duration),
    /// The backend could not be reached or the exchange broke off.
    #[error("summarizer transport failed: {0}")]
    Transport(String),
    /// The provider answered with a non-success status.
    #[error("summarizer provider answered {status}: {message}")]
    Status {
        /// The HTTP status code (or the exit code of an `exec` program).
        status: u16,
        /// The provider's error message, shortened.
        message: String,
    },
    /// The backend answered something that is not a summary.
    #[error("summarizer output invalid: {0}")]
    InvalidOutput(String),
    /// The backend answered an empty or whitespace-only summary.
    #[error("summarizer returned a blank summary")]
    Blank,
    /// The backend is misconfigured for this request (e.g. no credentials to use).
    #[error("summarizer not usable: {0}")]
    Config(String),
}

impl SummarizeError {
    /// A stable, bounded label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            SummarizeError::Timeout(_) => "timeout",
            SummarizeError::Transport(_) => "transport",
            SummarizeError::Status { .. } => "status",
            SummarizeError::InvalidOutput(_) => "invalid",
            SummarizeError::Blank => "blank",
            SummarizeError::Config(_) => "config",
        }
    }
}

impl Summary {
    /// Checks the text is not blank and wraps it; the one place that rule lives for plugins.
    pub fn new(text: impl Into<String>) -> Result<Self, SummarizeError> {
        let text = text.into();
        if text.trim().is_empty() {
            return Err(SummarizeError::Blank);
        }
        Ok(Summary { text })
    }
}

mod duration_secs {
    use serde::Serializer;
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blank_summaries_are_rejected() {
        assert!(matches!(Summary::new("  \n\t"), Err(SummarizeError::Blank)));
        assert_eq!(Summary::new("ok").map(|s| s.text).ok(), Some("ok".into()));
    }

    #[test]
    fn caller_debug_hides_credential_values() {
        let caller = Caller {
            upstream_base_url: "https://x".into(),
            api_prefix: "/v1".into(),
            credentials: vec![("authorization".into(), "Bearer sk-secret".into())],
            api: Api::Messages,
        };
        let shown = format!("{caller:?}");
        assert!(shown.contains("Messages"), "{shown}");
        assert!(!shown.contains("sk-secret"), "{shown}");
        assert!(shown.contains("authorization"));
        assert_eq!(caller.credential("authorization"), Some("Bearer sk-secret"));
    }
}
