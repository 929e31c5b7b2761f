//! What a provider answers, as each wire format words it: the token counts of its `usage`
//! and its refusal of a request for its length. Each format module declares its own
//! (`usage`, `REFUSAL`); src/usage.rs finds the counts in a response's bytes and
//! src/overflow.rs finds the refusal, trying every format's words in [`DialectKind::ALL`]'s
//! order, since a gateway may answer a request of one format in another's.

use super::{chat, gemini, messages, responses, DialectKind};

/// Token counts the upstream reported for one response, normalised across providers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Every input token the model read, cached and cache-written ones included.
    pub input: u64,
    /// Output tokens generated (reasoning included).
    pub output: u64,
    /// Input tokens served from the provider's prompt cache.
    pub cache_read: u64,
    /// Input tokens written to the provider's prompt cache (Anthropic only).
    pub cache_write: u64,
}

/// The usage counts a response named, under every format's names (what each means is the
/// format's to say: [`DialectKind::usage`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UsageFields {
    /// Chat Completions: `prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// Chat Completions: `completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// Messages and Responses: `input_tokens`.
    pub input_tokens: Option<u64>,
    /// Messages and Responses: `output_tokens`.
    pub output_tokens: Option<u64>,
    /// Chat Completions and Responses: `…_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// Messages: `cache_read_input_tokens`.
    pub cache_read_input_tokens: Option<u64>,
    /// Messages: `cache_creation_input_tokens`.
    pub cache_creation_input_tokens: Option<u64>,
    /// Gemini: `promptTokenCount`.
    pub prompt_token_count: Option<u64>,
    /// Gemini: `candidatesTokenCount`.
    pub candidates_token_count: Option<u64>,
    /// Gemini: `thoughtsTokenCount`.
    pub thoughts_token_count: Option<u64>,
    /// Gemini: `cachedContentTokenCount`.
    pub cached_content_token_count: Option<u64>,
}

impl UsageFields {
    /// The usage the fields say, read by the first format in [`DialectKind::ALL`] whose
    /// counts they hold; `None` when they hold none.
    pub fn usage(&self) -> Option<Usage> {
        DialectKind::ALL.into_iter().find_map(|d| d.usage(self))
    }
}

/// How a format's provider words a refusal for length (all lowercase).
#[derive(Debug)]
pub struct RefusalWording {
    /// Phrases that mark one.
    pub phrases: &'static [&'static str],
    /// The window: the number after one of these.
    pub window_after: &'static [&'static str],
    /// The window: the number after the first phrase that the second follows (`… > N
    /// maximum`).
    pub window_between: Option<(&'static str, &'static str)>,
    /// The refused request's size: the number after one of these.
    pub requested_after: &'static [&'static str],
    /// JSON fields of the error naming the window and the request's size (llama.cpp's
    /// `n_ctx`, `n_prompt_tokens`).
    pub fields: Option<(&'static str, &'static str)>,
}

impl DialectKind {
    /// The usage `fields` say, read as this format reads its own; `None` when they hold none
    /// of this format's counts.
    pub fn usage(self, fields: &UsageFields) -> Option<Usage> {
        match self {
            DialectKind::ChatCompletions => chat::usage(fields),
            DialectKind::Messages => messages::usage(fields),
            DialectKind::Responses => responses::usage(fields),
            DialectKind::Gemini => gemini::usage(fields),
        }
    }

    /// How this format's provider words a refusal for length.
    pub fn refusal_wording(self) -> &'static RefusalWording {
        match self {
            DialectKind::ChatCompletions => &chat::REFUSAL,
            DialectKind::Messages => &messages::REFUSAL,
            DialectKind::Responses => &responses::REFUSAL,
            DialectKind::Gemini => &gemini::REFUSAL,
        }
    }
}
