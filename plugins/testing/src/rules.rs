//! The request rules real providers enforce, for mock upstreams and property tests: what
//! OpenAI Chat Completions, Anthropic Messages, OpenAI Responses and Google Gemini refuse with
//! a 400 that a rewrite could cause (a tool answer without its call, a call never answered,
//! thinking or reasoning separated from the output it produced, too many cache breakpoints,
//! roles out of turn, a missing thought signature), then the
//! model's context window at 4 characters per token. A test that forwards a rewritten request
//! checks it here, so "valid for the provider" is one definition, not one per test file.

pub mod chat;
pub mod gemini;
pub mod messages;
pub mod responses;

/// Why a provider would refuse a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// HTTP 400 `invalid_request_error`: the conversation breaks a structural rule.
    Invalid(String),
    /// HTTP 400, context length: the prompt does not fit the window.
    ContextLength {
        /// The prompt's size as the rules count it.
        tokens: usize,
        /// The window it was checked against.
        window: usize,
    },
}
