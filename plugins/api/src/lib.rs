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
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

/// The system message an LLM-backed summarizer sends with [`SummaryRequest::prompt`] (the
/// user message). It lives with the contract so that every LLM backend (`openai`,
/// `anthropic`, ...) frames the prompt the same way without depending on another backend.
pub const SYSTEM_PROMPT: &str = "You write compaction summaries of coding-agent conversations. \
Follow the task in the user's message exactly and answer with the summary only.";

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

    /// The most output tokens this backend asks for when summarising a request that used
    /// `api`, or `None` when it has no budget of its own (local backends). compactor sizes the
    /// room it leaves for the summary with this figure, so it must be the budget of the
    /// backend that will actually answer (`auto` answers for the backend it picks).
    fn max_output_tokens(&self, api: Api) -> Option<u32> {
        let _ = api;
        None
    }

    /// Whether this backend sends [`SummaryRequest::in_conversation`] for a request that used
    /// `api` when it is given one (it calls the caller's own upstream and model in that API).
    /// compactor builds that request only for a backend that does: it copies and re-encodes
    /// the whole conversation. `false` unless a backend says otherwise.
    fn reads_conversation(&self, api: Api) -> bool {
        let _ = api;
        false
    }
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
    /// Focus instructions from a manual compaction (the admin API's
    /// `POST /session/{id}/summarize` with `{"instructions": "focus on the API changes"}`).
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
    /// The same summary asked for inside the conversation, as the agents' own compaction asks
    /// for it: the request as the provider last received it (compactor's rewrite included),
    /// followed by a user turn asking for the summary, as a complete JSON body in the caller's
    /// wire format ([`Caller::api`]), output budget and `stream: false` set. A backend that
    /// calls the caller's own upstream with the caller's own model should send it instead of
    /// [`SummaryRequest::prompt`]: the provider reads the conversation from its prompt cache
    /// (a tenth of the input price or less), where the standalone prompt is all new input.
    /// Its answer summarises everything above the turn. `None` when the request cannot carry
    /// it (it would not fit the window beside the summary, or the provider would not cache
    /// it) or for a later attempt of the same compaction. Never serialised.
    #[serde(skip)]
    pub in_conversation: Option<Arc<[u8]>>,
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

/// Every wire format compactor speaks, in order: calls `$callback!` with the list, each
/// variant with its doc comment. The one list the plugin contract's [`Api`] and compactor's own
/// `DialectKind` are both declared from, so they cannot disagree: a format is added by one
/// line here (and its module in compactor, which the compiler then asks for everywhere a
/// format's behaviour is matched on).
#[macro_export]
macro_rules! wire_formats {
    ($callback:ident) => {
        $callback! {
            /// OpenAI Chat Completions: `POST …/chat/completions`.
            ChatCompletions,
            /// Anthropic Messages: `POST …/messages`.
            Messages,
            /// OpenAI Responses: `POST …/responses`.
            Responses,
            /// Google Gemini: `POST …/models/{model}:generateContent` (and
            /// `:streamGenerateContent`), the model named in the path.
            Gemini,
        }
    };
}

/// Declares [`Api`] from the list, its first format the default.
macro_rules! declare_api {
    ($(#[$first_doc:meta])* $first:ident, $($(#[$doc:meta])* $variant:ident,)*) => {
        /// The wire API of the request being compacted, so a backend that calls the caller's
        /// own provider can speak that provider's language (an Anthropic upstream does not
        /// serve `/chat/completions`). The first of the list (Chat Completions) when unknown.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
        pub enum Api {
            $(#[$first_doc])*
            #[default]
            $first,
            $($(#[$doc])* $variant,)*
        }

        impl Api {
            /// Every wire API, in the list's order (compactor's `DialectKind::ALL` is in the
            /// same order, so an index converts one into the other).
            pub const ALL: [Api; [Api::$first, $(Api::$variant),*].len()] =
                [Api::$first, $(Api::$variant),*];
        }
    };
}

wire_formats!(declare_api);

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
    /// Credential headers of the request (`authorization`, `x-api-key`, `api-key`,
    /// `x-goog-api-key`; a Gemini key sent as the `key` query parameter is given as
    /// `x-goog-api-key`), by lowercase name.
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

/// A plugin setting that is not valid: its key within the plugin's configuration section
/// (compactor reports it as `summarizer.<backend>.<key>`) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid `{key}`: {reason}")]
pub struct InvalidSetting {
    /// The key within the section, e.g. `base_url`.
    pub key: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl InvalidSetting {
    /// `key` is invalid because `reason`.
    pub fn new(key: &'static str, reason: impl Into<String>) -> InvalidSetting {
        InvalidSetting {
            key,
            reason: reason.into(),
        }
    }
}

/// A written summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// The summary text. compactor treats a blank one as a failure.
    pub text: String,
    /// What writing it cost in tokens, when a model wrote it and said ([`Summary::with_usage`]);
    /// compactor prices it (`compactor_cost_usd_total{kind="summarizer"}`).
    pub usage: Option<SummaryUsage>,
}

/// The tokens a model billed for a summary, as its provider reported them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SummaryUsage {
    /// The model that wrote it (priced by the models table).
    pub model: String,
    /// Every input token, cached and cache-written ones included.
    pub input: u64,
    /// Output tokens (reasoning included).
    pub output: u64,
    /// Input tokens read from the provider's prompt cache.
    pub cache_read: u64,
    /// Input tokens written to it.
    pub cache_write: u64,
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
    /// The backend answered an empty summary, or one of only whitespace and invisible
    /// characters ([`is_blank`]).
    #[error("summarizer returned a blank summary")]
    Blank,
    /// The backend is misconfigured for this request (e.g. no credentials to use).
    #[error("summarizer not usable: {0}")]
    Config(String),
    /// The answer is larger than the configured bound (`summarizer.max_summary_bytes`): it was
    /// refused without reading the rest. Like every failure it ends compactor's attempts for
    /// the request (the same backend would answer the same way); a configured fallback, being
    /// another backend, is still asked.
    #[error("summarizer answer too large: {what} exceeds {limit} bytes")]
    TooLarge {
        /// What exceeded the bound: `response body`, `stdout`, `summary`.
        what: String,
        /// The bound, in bytes.
        limit: usize,
    },
}

/// The default bound of a summary's text, in bytes (`summarizer.max_summary_bytes`).
///
/// A summary is asked for with an output budget of a few thousand tokens (4,096 by default),
/// which is tens of kilobytes of text; 1 MiB (some 250,000 tokens) is far beyond any budget a
/// summary is written under and beyond most context windows, so a summary this large could
/// not make a request smaller anyway. It keeps what one misbehaving backend can make compactor
/// hold to about a megabyte per summary in flight.
pub const DEFAULT_MAX_SUMMARY_BYTES: usize = 1024 * 1024;

/// Room for the JSON around a summary in a backend's answer, beyond the summary bound: ids,
/// the model name, finish reason and usage of a provider's answer (a `reasoning` item of the
/// Responses API), `{"summary": ...}` of an `exec` program, and the escapes of the summary's
/// own quotes and newlines. Real answers carry a few hundred bytes of it; a backend reads at
/// most the summary bound plus this much.
pub const SUMMARY_ENVELOPE_BYTES: usize = 64 * 1024;

impl SummarizeError {
    /// Every value [`SummarizeError::kind`] can answer, so compactor can export each one
    /// before it first happens.
    pub const KINDS: [&'static str; 7] = [
        "timeout",
        "transport",
        "status",
        "invalid",
        "blank",
        "config",
        "too_large",
    ];

    /// A stable, bounded label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            SummarizeError::Timeout(_) => "timeout",
            SummarizeError::Transport(_) => "transport",
            SummarizeError::Status { .. } => "status",
            SummarizeError::InvalidOutput(_) => "invalid",
            SummarizeError::Blank => "blank",
            SummarizeError::Config(_) => "config",
            SummarizeError::TooLarge { .. } => "too_large",
        }
    }
}

impl Summary {
    /// Checks the text is not blank ([`is_blank`]) and wraps it; the one place that rule lives
    /// for plugins.
    pub fn new(text: impl Into<String>) -> Result<Self, SummarizeError> {
        let text = text.into();
        if is_blank(&text) {
            return Err(SummarizeError::Blank);
        }
        Ok(Summary { text, usage: None })
    }

    /// This summary with what the model billed for it.
    pub fn with_usage(self, usage: Option<SummaryUsage>) -> Summary {
        Summary { usage, ..self }
    }

    /// [`Summary::new`] for a backend bounded to `max_bytes` of summary
    /// (`summarizer.max_summary_bytes`): a longer text is [`SummarizeError::TooLarge`].
    pub fn bounded(text: impl Into<String>, max_bytes: usize) -> Result<Self, SummarizeError> {
        let text = text.into();
        if text.len() > max_bytes {
            return Err(SummarizeError::TooLarge {
                what: "summary".into(),
                limit: max_bytes,
            });
        }
        Summary::new(text)
    }
}

/// Whether `text` says nothing: it is empty or holds only whitespace and the invisible
/// characters of [`INVISIBLE_CHARS`] (zero-width spaces, joiners, byte-order marks, soft
/// hyphens). [`Summary::new`] rejects such a summary as [`SummarizeError::Blank`].
pub fn is_blank(text: &str) -> bool {
    text.chars()
        .all(|c| c.is_whitespace() || INVISIBLE_CHARS.contains(&c))
}

/// Characters that render as nothing and that Rust's `char::is_whitespace` does not count:
/// ZERO WIDTH SPACE, ZERO WIDTH NON-JOINER, ZERO WIDTH JOINER, WORD JOINER, ZERO WIDTH
/// NO-BREAK SPACE (byte-order mark), SOFT HYPHEN and MONGOLIAN VOWEL SEPARATOR.
pub const INVISIBLE_CHARS: [char; 7] = [
    '\u{200B}', '\u{200C}', '\u{200D}', '\u{2060}', '\u{FEFF}', '\u{00AD}', '\u{180E}',
];

/// Tag names whose elements coding agents inject into user text (see [`split_user_text`]).
/// Claude Code: `system-reminder` (CLAUDE.md, reminders), `user-prompt-submit-hook` (hook
/// output); Codex: `environment_context`, `user_instructions` (AGENTS.md); Cline and Roo:
/// `environment_details`.
pub const INJECTED_TAGS: [&str; 5] = [
    "system-reminder",
    "user-prompt-submit-hook",
    "environment_context",
    "user_instructions",
    "environment_details",
];

/// Tag-name prefixes that mark an injected element too: Claude Code's slash-command echoes
/// (`command-name`, `command-message`, `command-args`), local command output
/// (`local-command-stdout`, `local-command-stderr`, `local-command-caveat`) and `!` shell
/// echoes (`bash-input`, `bash-stdout`, `bash-stderr`). At least one character must follow the
/// prefix.
pub const INJECTED_TAG_PREFIXES: [&str; 3] = ["command-", "local-command-", "bash-"];

/// How a harness's own summary of an earlier conversation starts (Claude Code's and
/// compactor's). A user text whose own words start with it is all context.
pub const CONTINUATION_PREAMBLE: &str =
    "This session is being continued from a previous conversation";

/// How Claude Code's interruption markers start (`[Request interrupted by user]`,
/// `[Request interrupted by user for tool use]`).
pub const INTERRUPT_MARKER: &str = "[Request interrupted by user";

/// A user turn's text split into what the person wrote and what the harness injected.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UserText {
    /// What the person typed, trimmed; empty when the text was all context.
    pub own_words: String,
    /// The injected pieces removed from the text, each trimmed, in order, joined by `"\n"`.
    pub context: String,
}

/// Splits one user text (one text block of a user turn) into the person's own words and the
/// context their agent injected around them.
///
/// Agents send more than what the person typed as "user" text: Claude Code puts
/// `<system-reminder>` blocks (CLAUDE.md, todo reminders), slash-command echoes
/// (`<command-name>/clear</command-name>`), `<local-command-stdout>` and hook output before the
/// typed words; Codex sends `<environment_context>` and `<user_instructions>`; Cline and Roo
/// append `<environment_details>`. The rules, applied in one left-to-right pass:
///
/// 1. An element `<tag …>…</tag>` whose tag is in [`INJECTED_TAGS`] or starts with one of
///    [`INJECTED_TAG_PREFIXES`] is context, wherever it sits. Tags match case-sensitively, as
///    the agents write them; an opening tag is `<` + the name + `>`, `/` or whitespace (then
///    attributes up to `>`), and the element ends at the first `</tag>` after it. A
///    self-closing `<tag/>` is context on its own, and so is a stray closing `</tag>`.
/// 2. An injected opening tag that is never closed (or whose `>` never comes) makes the rest of
///    the text context: the text was cut inside the element.
/// 3. Claude Code's interruption markers ([`INTERRUPT_MARKER`] up to the next `]` on its line,
///    or the end of that line) are context.
/// 4. A text whose own words start with [`CONTINUATION_PREAMBLE`] (a harness summary of an
///    earlier conversation) is all context.
/// 5. Anything else is the person's: a `<` that does not open an injected tag (`a < b`,
///    `<div>`, `Vec<u8>`) stays in the own words.
///
/// `own_words` is what remains, trimmed. When nothing was removed it is exactly `text.trim()`;
/// otherwise runs of blank lines (the ones removed elements leave behind) are collapsed to one
/// blank line, and a piece removed from between two non-whitespace characters leaves one space
/// so words do not run together. Own words that are blank in the sense of [`is_blank`] (only
/// zero-width characters, say) make the whole text context. Otherwise `context` holds the
/// removed pieces, each trimmed, joined by `"\n"`; when the whole text is context (rule 4 and
/// the blank case), it is the trimmed text itself. No piece of the input is lost: every
/// non-whitespace character ends up in exactly one of the two, in its order. Never panics;
/// linear in the length of `text`.
///
/// ```
/// use compactor_plugin_api::split_user_text;
///
/// let text = "<system-reminder>\nAs you answer, follow CLAUDE.md.\n</system-reminder>\n\
///             <command-name>/clear</command-name>\n\
///             Does it also handle the outline of the text box?";
/// let split = split_user_text(text);
/// assert_eq!(split.own_words, "Does it also handle the outline of the text box?");
/// assert!(split.context.starts_with("<system-reminder>"));
/// assert!(split.context.ends_with("<command-name>/clear</command-name>"));
/// ```
pub fn split_user_text(text: &str) -> UserText {
    let trimmed = text.trim();
    if trimmed.starts_with(CONTINUATION_PREAMBLE) {
        return all_context(trimmed);
    }
    let mut own = String::new();
    let mut context = String::new();
    // `kept` is where the next piece of own words starts; `scan` where the search resumes.
    let mut kept = 0;
    let mut scan = 0;
    while let Some(offset) = text[scan..].find(['<', '[']) {
        let at = scan + offset;
        let Some(end) = injected_end(text, at) else {
            scan = at + 1; // `<` and `[` are one byte: `at + 1` is a char boundary
            continue;
        };
        push_own(&mut own, &text[kept..at]);
        let piece = text[at..end].trim();
        if !piece.is_empty() {
            if !context.is_empty() {
                context.push('\n');
            }
            context.push_str(piece);
        }
        kept = end;
        scan = end;
    }
    if kept == 0 {
        // Nothing was removed: the text is the person's, as they wrote it.
        return if is_blank(trimmed) {
            all_context(trimmed)
        } else {
            UserText {
                own_words: trimmed.to_owned(),
                context: String::new(),
            }
        };
    }
    push_own(&mut own, &text[kept..]);
    let own_words = collapse_blank_lines(own.trim());
    if own_words.starts_with(CONTINUATION_PREAMBLE) {
        return all_context(trimmed);
    }
    if !own_words.is_empty() && is_blank(&own_words) {
        // Zero-width leftovers are not words: the whole text is context, in its order.
        return all_context(trimmed);
    }
    UserText { own_words, context }
}

fn all_context(trimmed: &str) -> UserText {
    UserText {
        own_words: String::new(),
        context: trimmed.to_owned(),
    }
}

/// Appends a piece of own words, with one space where a removed piece sat between two
/// non-whitespace characters.
fn push_own(own: &mut String, piece: &str) {
    let joins_words = own.chars().next_back().is_some_and(|c| !c.is_whitespace())
        && piece.chars().next().is_some_and(|c| !c.is_whitespace());
    if joins_words {
        own.push(' ');
    }
    own.push_str(piece);
}

/// The end (exclusive byte offset) of the injected piece starting at `at` (a `<` or `[`), or
/// `None` when none starts there.
fn injected_end(text: &str, at: usize) -> Option<usize> {
    let rest = &text[at..];
    if rest.starts_with(INTERRUPT_MARKER) {
        let end = match rest.find([']', '\n']) {
            Some(close) if rest.as_bytes()[close] == b']' => close + 1,
            Some(line_end) => line_end,
            None => rest.len(),
        };
        return Some(at + end);
    }
    let after_lt = rest.strip_prefix('<')?;
    if let Some(after_slash) = after_lt.strip_prefix('/') {
        // A stray closing tag (one that closed an element was consumed with it).
        let name = tag_name(after_slash);
        return (is_injected_tag(name) && after_slash[name.len()..].starts_with('>'))
            .then(|| at + 2 + name.len() + 1);
    }
    let name = tag_name(after_lt);
    if !is_injected_tag(name) {
        return None;
    }
    let after_name = &after_lt[name.len()..];
    match after_name.chars().next() {
        None => return Some(text.len()),
        Some(c) if c == '>' || c == '/' || c.is_whitespace() => {}
        Some(_) => return None, // `<system-reminders`, `<command-name.x`: not the tag
    }
    let name_end = at + 1 + name.len();
    let Some(gt) = text[name_end..].find('>') else {
        return Some(text.len());
    };
    let open_end = name_end + gt + 1;
    if text[..open_end - 1].ends_with('/') {
        return Some(open_end); // `<tag/>`
    }
    Some(closing_end(text, open_end, name).unwrap_or(text.len()))
}

/// The end of the first `</name>` at or after `from`.
fn closing_end(text: &str, from: usize, name: &str) -> Option<usize> {
    let mut search = from;
    while let Some(offset) = text[search..].find("</") {
        let start = search + offset + 2;
        let tail = &text[start..];
        if tail.starts_with(name) && tail[name.len()..].starts_with('>') {
            return Some(start + name.len() + 1);
        }
        search = start;
    }
    None
}

/// The tag name at the start of `s`: ASCII letters, digits, `-`, `_`, `.` and `:`.
fn tag_name(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':')))
        .unwrap_or(s.len());
    &s[..end]
}

fn is_injected_tag(name: &str) -> bool {
    INJECTED_TAGS.contains(&name)
        || INJECTED_TAG_PREFIXES
            .iter()
            .any(|p| name.len() > p.len() && name.starts_with(p))
}

/// `text` with every run of blank (whitespace-only) lines replaced by one empty line.
fn collapse_blank_lines(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut previous_blank = false;
    for (i, line) in text.split('\n').enumerate() {
        let blank = line.trim().is_empty();
        if blank && previous_blank {
            continue;
        }
        if i > 0 {
            out.push('\n');
        }
        if !blank {
            out.push_str(line);
        }
        previous_blank = blank;
    }
    out
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
    fn kinds_lists_every_kind_once() {
        // Exhaustive on purpose: a new variant fails to compile here until it is listed.
        let kind_of = |e: &SummarizeError| match e {
            SummarizeError::Timeout(_)
            | SummarizeError::Transport(_)
            | SummarizeError::Status { .. }
            | SummarizeError::InvalidOutput(_)
            | SummarizeError::Blank
            | SummarizeError::Config(_)
            | SummarizeError::TooLarge { .. } => e.kind(),
        };
        let all = [
            SummarizeError::Timeout(Duration::from_secs(1)),
            SummarizeError::Transport(String::new()),
            SummarizeError::Status {
                status: 500,
                message: String::new(),
            },
            SummarizeError::InvalidOutput(String::new()),
            SummarizeError::Blank,
            SummarizeError::Config(String::new()),
            SummarizeError::TooLarge {
                what: String::new(),
                limit: 1,
            },
        ];
        let kinds: Vec<&str> = all.iter().map(kind_of).collect();
        assert_eq!(kinds, SummarizeError::KINDS);
    }

    #[test]
    fn bounded_summaries_refuse_longer_texts() {
        assert_eq!(
            Summary::bounded("four", 4).map(|s| s.text).ok(),
            Some("four".into())
        );
        match Summary::bounded("fives", 4) {
            Err(e @ SummarizeError::TooLarge { limit: 4, .. }) => {
                assert_eq!(e.kind(), "too_large");
                assert_eq!(
                    e.to_string(),
                    "summarizer answer too large: summary exceeds 4 bytes"
                );
            }
            other => panic!("expected too large, got {other:?}"),
        }
        assert!(matches!(
            Summary::bounded(" ", 4),
            Err(SummarizeError::Blank)
        ));
    }

    #[test]
    fn blank_summaries_are_rejected() {
        assert!(matches!(Summary::new("  \n\t"), Err(SummarizeError::Blank)));
        assert_eq!(Summary::new("ok").map(|s| s.text).ok(), Some("ok".into()));
    }

    #[test]
    fn invisible_only_summaries_are_blank() {
        assert!(is_blank(""));
        assert!(is_blank(
            " \n\t\u{200B}\u{FEFF} \u{00AD}\u{2060}\u{200C}\u{200D}\u{180E}"
        ));
        assert!(!is_blank("\u{200B}ok\u{200B}"));
        assert!(!is_blank("."));
        assert!(matches!(
            Summary::new("\u{200B}\u{200B}\n\u{FEFF}"),
            Err(SummarizeError::Blank)
        ));
    }

    /// A CLAUDE.md reminder as Claude Code injects it ahead of the first prompt.
    const CLAUDE_MD_REMINDER: &str = "<system-reminder>\nAs you answer the user's questions, \
you can use the following context:\n# claudeMd\nCodebase and user instructions are shown \
below. Be sure to adhere to these instructions. IMPORTANT: These instructions OVERRIDE any \
default behavior and you MUST follow them exactly as written.\n\nContents of \
/home/dev/editor/CLAUDE.md (project instructions, checked into the codebase):\n\n# Editor\n\
- Run `npm test` before committing.\n- Components live in src/components/<Name>.tsx.\n\n      \
IMPORTANT: this context may or may not be relevant to your tasks. You should not respond to \
this context unless it is highly relevant to your task.\n</system-reminder>";

    /// The echo Claude Code leaves after `/clear`.
    const CLEAR_ECHO: &str = "<command-name>/clear</command-name>\n            \
<command-message>clear</command-message>\n            <command-args></command-args>";

    const STDOUT_ECHO: &str = "<local-command-stdout></local-command-stdout>";

    const CAVEAT: &str = "<local-command-caveat>Caveat: The messages below were generated by \
the user while running local commands. DO NOT respond to these messages or otherwise consider \
them in your response unless the user explicitly asks you to.</local-command-caveat>";

    const TYPED: &str = "Does it also properly handle the outline of the text box?";

    #[test]
    fn claude_code_context_is_split_from_the_typed_words() {
        // All the blocks of one turn flattened into one text, typed words last.
        let text =
            format!("{CAVEAT}\n{CLEAR_ECHO}\n{STDOUT_ECHO}\n\n{CLAUDE_MD_REMINDER}\n{TYPED}");
        let split = split_user_text(&text);
        assert_eq!(split.own_words, TYPED);
        assert_eq!(
            split.context,
            [
                CAVEAT,
                "<command-name>/clear</command-name>",
                "<command-message>clear</command-message>",
                "<command-args></command-args>",
                STDOUT_ECHO,
                CLAUDE_MD_REMINDER,
            ]
            .join("\n")
        );

        // The same turn as Claude Code sends it: one text block each.
        for block in [CAVEAT, CLEAR_ECHO, STDOUT_ECHO, CLAUDE_MD_REMINDER] {
            let split = split_user_text(block);
            assert_eq!(split.own_words, "", "{block}");
            assert!(!split.context.is_empty(), "{block}");
        }
        assert_eq!(
            split_user_text(TYPED),
            UserText {
                own_words: TYPED.into(),
                context: String::new()
            }
        );
    }

    #[test]
    fn reminders_after_and_between_the_words_are_context_too() {
        let text = "test api logging\n\n<system-reminder>\nThe TodoWrite tool hasn't been used \
recently.\n</system-reminder>\n\n\n<user-prompt-submit-hook>lint ok</user-prompt-submit-hook>\n\n\
and the access log";
        let split = split_user_text(text);
        assert_eq!(split.own_words, "test api logging\n\nand the access log");
        assert!(split.context.contains("TodoWrite"));
        assert!(split.context.ends_with("</user-prompt-submit-hook>"));
        // Inline, the words on either side do not run together.
        let split = split_user_text("fix<bash-stdout>ok</bash-stdout>it");
        assert_eq!(split.own_words, "fix it");
        assert_eq!(split.context, "<bash-stdout>ok</bash-stdout>");
    }

    #[test]
    fn codex_and_cline_context_is_split() {
        let codex = "<user_instructions>\n\n# AGENTS.md\n\nUse pnpm, not npm.\n\n\
</user_instructions>\n<environment_context>\n  <cwd>/home/dev/editor</cwd>\n  \
<approval_policy>on-request</approval_policy>\n  <sandbox_mode>workspace-write</sandbox_mode>\n  \
<network_access>restricted</network_access>\n  <shell>bash</shell>\n</environment_context>\n\
rename the `Box` component to `Frame`";
        let split = split_user_text(codex);
        assert_eq!(split.own_words, "rename the `Box` component to `Frame`");
        assert!(split.context.starts_with("<user_instructions>"));
        assert!(split.context.ends_with("</environment_context>"));

        let cline = "<task>\nadd a dark mode toggle\n</task>\n\n<environment_details>\n\
# VSCode Visible Files\nsrc/App.tsx\n\n# Current Mode\nACT MODE\n</environment_details>";
        let split = split_user_text(cline);
        assert_eq!(split.own_words, "<task>\nadd a dark mode toggle\n</task>");
        assert!(split.context.contains("ACT MODE"));
    }

    #[test]
    fn continuation_summaries_and_interruptions_are_context() {
        let summary = "This session is being continued from a previous conversation that ran \
out of context. The conversation is summarized below:\nAnalysis: the user asked for a text box.";
        assert_eq!(split_user_text(summary).own_words, "");
        assert_eq!(split_user_text(summary).context, summary);
        // compactor's own summary message, behind a reminder.
        let text = format!(
            "{CLAUDE_MD_REMINDER}\nThis session is being continued from a previous conversation \
that was compacted to fit the context window. Summary of the earlier conversation:\n\n1. ..."
        );
        let split = split_user_text(&text);
        assert_eq!(split.own_words, "");
        assert_eq!(split.context, text);
        // Mentioned later in the text, it is just words.
        let quoted = format!("why does the summary say \"{CONTINUATION_PREAMBLE}\"?");
        assert_eq!(split_user_text(&quoted).own_words, quoted);

        let split = split_user_text("[Request interrupted by user for tool use]");
        assert_eq!(split.own_words, "");
        assert_eq!(split.context, "[Request interrupted by user for tool use]");
        let split = split_user_text("[Request interrupted by user]\nno, edit the other file");
        assert_eq!(split.own_words, "no, edit the other file");
        let split = split_user_text("stop [Request interrupted by user\nthen go on");
        assert_eq!(split.own_words, "stop \nthen go on");
        assert_eq!(split.context, "[Request interrupted by user");
    }

    #[test]
    fn other_angle_brackets_are_the_persons() {
        for text in [
            "is a < b when a > 0?",
            "render a <div> around it, not a <span/>",
            "return Vec<u8> from `read_all`",
            "the <system-reminders> tag is made up",
            "<System-Reminder>tags match case-sensitively</System-Reminder>",
            "<command->not a command tag</command->",
            "<commands>x</commands> and </command-x > and <bash->",
            "trailing <",
            "[Request interrupted",
            "<!-- a comment --> <?xml?> <>",
        ] {
            assert_eq!(
                split_user_text(text),
                UserText {
                    own_words: text.into(),
                    context: String::new()
                },
                "{text}"
            );
        }
    }

    #[test]
    fn unclosed_self_closing_and_stray_tags() {
        // Truncated inside the element: the rest is context.
        let split = split_user_text("fix the outline\n<system-reminder>\nContents of CLAUDE.md…");
        assert_eq!(split.own_words, "fix the outline");
        assert_eq!(split.context, "<system-reminder>\nContents of CLAUDE.md…");
        let split = split_user_text("fix it <system-reminder priority=\"high\"");
        assert_eq!(split.own_words, "fix it");
        assert_eq!(
            split.own_words,
            split_user_text("fix it <system-reminder").own_words
        );
        // Attributes, self-closing tags and stray closing tags.
        let split = split_user_text("a <system-reminder kind=\"todo\">x</system-reminder> b");
        assert_eq!(split.own_words, "a  b");
        let split = split_user_text("a <bash-input/> b </system-reminder> c");
        assert_eq!(split.own_words, "a  b  c");
        assert_eq!(split.context, "<bash-input/>\n</system-reminder>");
        // The first closing tag ends the element.
        let split =
            split_user_text("<system-reminder>one</system-reminder>two</system-reminder>three");
        assert_eq!(split.own_words, "two three");
    }

    #[test]
    fn blank_lines_collapse_only_where_something_was_removed() {
        assert_eq!(split_user_text("  a\n\n\n\nb  ").own_words, "a\n\n\n\nb");
        let split = split_user_text("a\n\n<system-reminder>x</system-reminder>\n \n\t\nb\n\n\n\nc");
        assert_eq!(split.own_words, "a\n\nb\n\nc");
        // Zero-width leftovers are not words.
        let split = split_user_text("\u{200B}\n<system-reminder>x</system-reminder>");
        assert_eq!(split.own_words, "");
        assert_eq!(
            split.context,
            "\u{200B}\n<system-reminder>x</system-reminder>"
        );
        assert_eq!(split_user_text("\u{FEFF}").own_words, "");
        assert_eq!(split_user_text("").own_words, "");
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

#[cfg(test)]
mod split_properties {
    use super::*;
    use proptest::prelude::*;

    /// Pieces that exercise every rule, and the near misses of each.
    const TOKENS: &[&str] = &[
        "<system-reminder>",
        "</system-reminder>",
        "<system-reminder",
        "<system-reminder x=\"/\">",
        "<command-name>",
        "</command-name>",
        "<local-command-stdout>",
        "</local-command-stdout>",
        "<bash-input/>",
        "<environment_context>",
        "</environment_context>",
        "<user_instructions>",
        "<",
        ">",
        "/",
        "</",
        "<div>",
        "Vec<u8>",
        "a < b",
        "[",
        "]",
        "[Request interrupted by user",
        "[Request interrupted by user]",
        CONTINUATION_PREAMBLE,
        " ",
        "\n",
        "\n\n",
        "\t",
        "word",
        "é",
        "日本",
        "\u{200B}",
    ];

    fn soup() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(TOKENS), 0..40).prop_map(|t| t.concat())
    }

    fn non_whitespace(s: &str) -> Vec<char> {
        s.chars().filter(|c| !c.is_whitespace()).collect()
    }

    fn is_subsequence(needle: &[char], hay: &[char]) -> bool {
        let mut hay = hay.iter();
        needle.iter().all(|c| hay.any(|h| h == c))
    }

    /// Every non-whitespace character of the input lands in exactly one side, in order, and
    /// no complete injected tag is left in the own words.
    fn check(text: &str) -> Result<(), TestCaseError> {
        let split = split_user_text(text);
        let all = non_whitespace(text);
        let own = non_whitespace(&split.own_words);
        let context = non_whitespace(&split.context);
        prop_assert_eq!(own.len() + context.len(), all.len(), "{:?}", split);
        prop_assert!(is_subsequence(&own, &all), "{:?}", split);
        prop_assert!(is_subsequence(&context, &all), "{:?}", split);
        prop_assert_eq!(split.own_words.trim(), split.own_words.as_str());
        prop_assert!(split.own_words.is_empty() || !is_blank(&split.own_words));
        for tag in INJECTED_TAGS
            .iter()
            .chain(["command-name", "bash-input"].iter())
        {
            prop_assert!(
                !split.own_words.contains(&format!("<{tag}>")),
                "{:?}",
                split
            );
            prop_assert!(
                !split.own_words.contains(&format!("</{tag}>")),
                "{:?}",
                split
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        #[test]
        fn token_soup_loses_nothing(text in soup()) {
            check(&text)?;
        }

        #[test]
        fn arbitrary_text_loses_nothing(text in any::<String>()) {
            check(&text)?;
        }

        #[test]
        fn text_without_markup_is_all_own_words(text in "[a-zA-Z0-9 .,?!()\n\t>/é]{0,80}") {
            let split = split_user_text(&text);
            prop_assert_eq!(split.own_words, text.trim());
            prop_assert_eq!(split.context, "");
        }

        #[test]
        fn injected_elements_around_the_words_are_removed(
            before in prop::collection::vec(("[a-z <>/\n]{0,30}", 0..4usize), 0..4),
            words in "[a-zA-Z0-9][a-zA-Z0-9 .,?<]{0,60}[a-zA-Z0-9?]",
            after in prop::collection::vec(("[a-z <>/\n]{0,30}", 0..4usize), 0..3),
        ) {
            let names = [
                "system-reminder",
                "command-message",
                "local-command-stdout",
                "environment_details",
            ];
            let element = |(body, n): &(String, usize)| format!("<{0}>{body}</{0}>", names[*n]);
            let before: Vec<String> = before.iter().map(element).collect();
            let after: Vec<String> = after.iter().map(element).collect();
            let text = format!("{}\n\n{words}\n{}", before.join("\n"), after.join(" "));
            let split = split_user_text(&text);
            prop_assert_eq!(&split.own_words, &words);
            let pieces: Vec<&str> = before.iter().chain(&after).map(|e| e.trim()).collect();
            prop_assert_eq!(split.context, pieces.join("\n"));
        }
    }
}
