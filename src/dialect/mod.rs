//! Dialects: which wire format a request speaks, and the modules that read and write each.
//!
//! A dialect parses a provider's request body into the engine's neutral transcript and writes a
//! compaction plan back into the *original* JSON, so every field compactor does not interpret
//! survives untouched.
//!
//! The pipeline sees a dialect only through [`DialectKind::scan`], which reads a body once
//! into a [`Scan`]: the conversation's messages as raw slices of the body with the estimated
//! tokens of each, and the few top-level fields the trigger needs. Everything later works from
//! the scan: session identity and checkpoint hashing from the raw messages, the trigger from
//! the estimates, neutral messages ([`Scan::transcript`]) only when a compaction is due, and
//! the rewrite ([`Scan::rewrite`]) by splicing bytes, so nothing compactor does not replace is
//! ever re-serialised.
//!
//! One module per wire format: [`chat`] (OpenAI Chat Completions), [`messages`] (Anthropic
//! Messages), [`responses`] (OpenAI Responses) and [`gemini`] (Google Gemini), with the JSON plumbing they share in
//! `json`; [`outputs`] finds tool outputs in any of them and replaces them in place (masking
//! old observations).

pub mod answer;
pub mod chat;
pub mod gemini;
pub(crate) mod json;
pub mod messages;
pub mod outputs;
pub mod reply;
pub mod responses;
pub mod scan_memo;
pub(crate) mod split;

use std::ops::Range;

use std::collections::BTreeMap;

use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::estimate::LazyEstimator;
use crate::transcript::{Message, Part, Role, Transcript};
use scan_memo::Remembering;

/// Why a body could not be read or rewritten in its dialect. Every one of these sends the
/// request upstream unchanged.
#[derive(Debug, thiserror::Error)]
pub enum DialectError {
    /// Not JSON, or JSON of an unexpected shape.
    #[error("invalid request body: {0}")]
    Json(#[from] serde_json::Error),
    /// The body is not JSON where the scan looked (no valid UTF-8, or broken structure).
    #[error("invalid request body at byte {at}")]
    Malformed {
        /// Where the scan stopped.
        at: usize,
    },
    /// A top-level field the scan reads appears twice.
    #[error("request repeats `{0}`")]
    Repeated(String),
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
    /// The conversation lives on the provider (`previous_response_id`, `conversation`, or
    /// `item_reference` items): there is no history to compact, so the request passes through
    /// (counted as `server_state`).
    #[error("history held by the provider; passed through")]
    ServerState,
}

/// A chat request read once: everything the pipeline decides from, borrowed from the body.
///
/// One pass splits the body into its conversation's raw messages (Responses: input items) and
/// counts what the model reads of each; the session id, the checkpoint lookup, the trigger and
/// the rewrite all work from this. Neutral messages ([`Scan::transcript`]) are built only when
/// a compaction is due, and a rewrite ([`Scan::rewrite`]) splices bytes of the body.
#[derive(Debug)]
pub struct Scan<'a> {
    dialect: DialectKind,
    body: &'a [u8],
    /// Responses: `input` is one string, written back as a user message item on rewrite.
    input_is_string: bool,
    /// The wire messages (Responses: input items) as raw JSON slices of the body, in order.
    pub messages: Vec<&'a str>,
    /// Estimated tokens of each message.
    pub message_tokens: Vec<usize>,
    /// Each message's output marks (`outputs::marks`): how many outputs it may hold, and
    /// whether it may be a user turn.
    marks: Vec<u32>,
    /// The `model` field.
    pub model: Option<String>,
    /// Output tokens the request reserves (`max_tokens` and friends).
    pub requested_output: Option<usize>,
    /// Estimated tokens outside the messages (tool definitions, top-level system prompts).
    pub fixed_tokens: usize,
    /// Estimated tokens of the whole request as received.
    pub tokens: usize,
}

impl<'a> Scan<'a> {
    /// Pairs raw messages with their estimates.
    fn new(
        dialect: DialectKind,
        body: &'a [u8],
        messages: Vec<&'a str>,
        message_tokens: Vec<usize>,
        marks: Vec<u32>,
        fields: ScanFields,
    ) -> Scan<'a> {
        let tokens = message_tokens
            .iter()
            .fold(fields.fixed_tokens, |acc, t| acc.saturating_add(*t));
        Scan {
            dialect,
            body,
            input_is_string: fields.input_is_string,
            messages,
            message_tokens,
            marks,
            model: fields.model,
            requested_output: fields.requested_output,
            fixed_tokens: fields.fixed_tokens,
            tokens,
        }
    }

    /// The scan with its model taken from the request's API prefix
    /// ([`DialectKind::api_prefix`]) when the format names it in the path (Gemini) and the
    /// body names none.
    pub fn with_model_from_prefix(mut self, api_prefix: &str) -> Scan<'a> {
        if self.model.is_none() {
            self.model = self.dialect.model_in_prefix(api_prefix).map(str::to_string);
        }
        self
    }

    /// The dialect the body was read in.
    pub fn dialect(&self) -> DialectKind {
        self.dialect
    }

    /// The body the scan borrows from.
    pub fn body(&self) -> &'a [u8] {
        self.body
    }

    /// Number of messages.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether the conversation is empty.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Estimated tokens of `messages[range]` (clamped to the conversation).
    pub fn tokens_of(&self, range: Range<usize>) -> usize {
        let end = range.end.min(self.message_tokens.len());
        let start = range.start.min(end);
        self.message_tokens[start..end]
            .iter()
            .fold(0, |acc, t| acc.saturating_add(*t))
    }

    /// Message `index` in neutral form (its estimate from the scan).
    pub fn message(&self, index: usize) -> Result<Message, DialectError> {
        let raw = self.messages.get(index).ok_or(DialectError::BadMessage {
            index,
            reason: "no such message",
        })?;
        let mut message = match self.dialect {
            DialectKind::ChatCompletions => chat::message(raw, index)?,
            DialectKind::Messages => messages::message(raw, index)?,
            DialectKind::Responses if self.input_is_string => responses::string_input(raw)?,
            DialectKind::Responses => responses::message(raw, index)?,
            DialectKind::Gemini => gemini::message(raw, index)?,
        };
        message.tokens = self.message_tokens.get(index).copied().unwrap_or_default();
        Ok(message)
    }

    /// How many leading messages are the head that is never compacted, as
    /// [`Transcript::head_len`] counts them for `scan.transcript(opening_budget)`: the leading
    /// system and developer messages, the opening when it is at most `opening_budget` tokens
    /// ([`Transcript::keeping_opening`]), and everything through the last provider summary.
    /// Reads the leading messages through the model's first reply, and only the later
    /// messages whose marks say they may hold a provider summary.
    pub fn head_len(&self, opening_budget: usize) -> Result<usize, DialectError> {
        let n = self.messages.len();
        let mut leading = 0;
        while leading < n && self.message(leading)?.role == Role::System {
            leading += 1;
        }
        let mut head = leading;
        let mut end = leading;
        while end < n {
            let m = self.message(end)?;
            if m.role == Role::Assistant || m.is_tool_answer() {
                let replied = m.role == Role::Assistant;
                if replied && self.tokens_of(leading..end) <= opening_budget {
                    head = end;
                }
                break;
            }
            end += 1;
        }
        for i in (leading..n).rev() {
            let marked = self
                .marks
                .get(i)
                .is_some_and(|&m| outputs::may_hold_provider_summary(m));
            if marked && self.message(i)?.parts.iter().any(Part::is_provider_summary) {
                return Ok(head.max(i + 1));
            }
        }
        Ok(head)
    }

    /// The whole conversation in neutral form, tool names resolved across messages, its
    /// opening kept in the head when it is at most `opening_budget` tokens
    /// ([`Transcript::keeping_opening`]).
    pub fn transcript(&self, opening_budget: usize) -> Result<Transcript, DialectError> {
        self.transcript_cutting_outputs(opening_budget, usize::MAX)
    }

    /// [`Scan::transcript`] with each tool output's text cut to at most `output_chars`
    /// characters as it is read ([`Message::cut_outputs`]; the token estimates stay those of
    /// the whole messages): for a compaction, whose prompt shows no more of an output, so a
    /// request being summarised is held about once rather than twice (its bytes, and a copy of
    /// every output).
    pub fn transcript_cutting_outputs(
        &self,
        opening_budget: usize,
        output_chars: usize,
    ) -> Result<Transcript, DialectError> {
        let messages = (0..self.messages.len())
            .map(|i| {
                let mut message = self.message(i)?;
                message.cut_outputs(output_chars);
                Ok(message)
            })
            .collect::<Result<Vec<_>, DialectError>>()?;
        let mut transcript = Transcript::new(messages).keeping_opening(opening_budget);
        transcript.resolve_tool_names();
        Ok(transcript)
    }

    /// The request with messages `[head..boundary]` replaced by one user message holding
    /// `summary_message`: the bytes before and after them are copied as received, so every
    /// other field, its order and its whitespace are untouched.
    pub fn rewrite(
        &self,
        head: usize,
        boundary: usize,
        summary_message: &str,
    ) -> Result<Vec<u8>, DialectError> {
        let len = self.messages.len();
        if head > boundary || boundary > len {
            return Err(DialectError::BadPlan {
                head,
                boundary,
                len,
            });
        }
        match self.dialect {
            DialectKind::ChatCompletions => chat::rewrite(self, head, boundary, summary_message),
            DialectKind::Messages => messages::rewrite(self, head, boundary, summary_message),
            DialectKind::Responses => responses::rewrite(self, head, boundary, summary_message),
            DialectKind::Gemini => gemini::rewrite(self, head, boundary, summary_message),
        }
    }

    /// The user neighbours a summary joins where roles must alternate (Anthropic, Gemini):
    /// the head's last message when it is the user's, and the first kept message when it is
    /// the user's. A tail opening with tool answers is refused: they must follow the calls
    /// they answer, which the boundary rules never cut away.
    fn user_neighbours(
        &self,
        head: usize,
        boundary: usize,
    ) -> Result<(Option<&'a str>, Option<&'a str>), DialectError> {
        let after = match self.messages.get(boundary) {
            Some(raw) => {
                let first = self.message(boundary)?;
                if first.role != Role::User {
                    None
                } else if first.is_tool_answer() {
                    return Err(DialectError::TailStartsWithToolResult);
                } else {
                    Some(*raw)
                }
            }
            None => None,
        };
        let before = match head.checked_sub(1) {
            Some(last) if self.message(last)?.role == Role::User => Some(self.messages[last]),
            _ => None,
        };
        Ok((before, after))
    }

    /// Byte range of message `index` in the body.
    fn span(&self, index: usize) -> Result<Range<usize>, DialectError> {
        self.messages
            .get(index)
            .and_then(|raw| span_in(self.body, raw))
            .ok_or(DialectError::BadMessage {
                index,
                reason: "not a slice of the body",
            })
    }

    /// The body with messages `[head..boundary]` replaced by what `write` writes (with
    /// `merge`, the message at `boundary` too: `write` writes it merged with the summary).
    /// `extra` is a capacity hint for what `write` adds.
    fn splice(
        &self,
        head: usize,
        boundary: usize,
        merge: bool,
        extra: usize,
        write: impl FnOnce(&mut Vec<u8>) -> Result<(), serde_json::Error>,
    ) -> Result<Vec<u8>, DialectError> {
        let start = self.span(head)?.start;
        let (end, separator) = if merge {
            (self.span(boundary)?.end, false)
        } else if boundary < self.messages.len() {
            (self.span(boundary)?.start, true)
        } else {
            (self.span(boundary - 1)?.end, false)
        };
        let kept = self.body.len() - (end - start);
        let mut out = Vec::with_capacity(kept.saturating_add(extra).saturating_add(64));
        out.extend_from_slice(&self.body[..start]);
        write(&mut out)?;
        if separator {
            out.push(b',');
        }
        out.extend_from_slice(&self.body[end..]);
        Ok(out)
    }
}

/// The byte range of `part` inside `whole`, when `part` is a slice of it.
fn span_in(whole: &[u8], part: &str) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (end <= whole.len()).then_some(start..end)
}

/// The top-level fields a dialect's scan reads besides the conversation.
#[derive(Debug, Default)]
struct ScanFields {
    model: Option<String>,
    requested_output: Option<usize>,
    fixed_tokens: usize,
    input_is_string: bool,
}

/// Declares [`DialectKind`] and [`DialectKind::ALL`] from the one list of wire formats, the
/// plugin contract's (`compactor_plugin_api::wire_formats!`, which declares its `Api` from it
/// too, in the same order), so they cannot disagree: every table indexed by dialect (metric
/// label arrays, the Redis codec's labels, the command line's `--dialect`, the replay's
/// detection) is built from `ALL` and [`DialectKind::index`], the conversion to and from
/// `Api` is by index, and every behaviour of a format is an exhaustive `match`, so a format
/// added to the list and not handled here is a compile error (docs/architecture.md, *Adding a
/// wire format*).
macro_rules! declare_dialects {
    ($($(#[$doc:meta])* $variant:ident,)+) => {
        /// The chat wire formats compactor can compact.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum DialectKind {
            $($(#[$doc])* $variant,)+
        }

        impl DialectKind {
            /// Every format, in declaration order (the order of metric label arrays).
            pub const ALL: [DialectKind; [$(DialectKind::$variant),+].len()] =
                [$(DialectKind::$variant),+];
        }
    };
}

compactor_plugin_api::wire_formats!(declare_dialects);

impl DialectKind {
    /// The dialect of a `POST` to `path` (after route prefix handling), if it is a chat call.
    ///
    /// A chat path is a prefix followed by the API path (`chat/completions`, `messages` or
    /// `responses`) as whole segments, so `/v1/chat/completions`, `/chat/completions`,
    /// `/anthropic/v1/messages` and `/openai/deployments/x/chat/completions` all count. The
    /// providers' other calls must pass through unread: those under a chat path
    /// (`/v1/messages/count_tokens`, `/v1/responses/{id}/cancel`) do not end in an API path,
    /// and those that do (an Assistants thread's `/v1/threads/{id}/messages`, a stored chat
    /// completion's `/v1/chat/completions/{id}/messages`) have a prefix that ends in a thread
    /// or a stored completion, which no route prefix or base path does.
    pub fn from_path(path: &str) -> Option<DialectKind> {
        split_path(path).map(|(dialect, _)| dialect)
    }

    /// Reads a request once (see [`Scan`]).
    pub fn scan<'a>(
        self,
        body: &'a [u8],
        estimator: &LazyEstimator,
    ) -> Result<Scan<'a>, DialectError> {
        self.scan_with(body, estimator, None)
    }

    /// [`DialectKind::scan`], reading only what `memo` has not seen of the conversation (see
    /// [`scan_memo`]): the same scan, for less work on the next request of a conversation.
    pub fn scan_remembering<'a>(
        self,
        memo: &Remembering<'a>,
        estimator: &LazyEstimator,
    ) -> Result<Scan<'a>, DialectError> {
        self.scan_with(memo.body, estimator, Some(memo))
    }

    fn scan_with<'a>(
        self,
        body: &'a [u8],
        estimator: &LazyEstimator,
        memo: Option<&Remembering<'_>>,
    ) -> Result<Scan<'a>, DialectError> {
        // `compat` for where an invalid body stops being UTF-8, as `std::str::from_utf8` says.
        let text = simdutf8::compat::from_utf8(body).map_err(|e| DialectError::Malformed {
            at: e.valid_up_to(),
        })?;
        match self {
            DialectKind::ChatCompletions => chat::scan(text, estimator, memo),
            DialectKind::Messages => messages::scan(text, estimator, memo),
            DialectKind::Responses => responses::scan(text, estimator, memo),
            DialectKind::Gemini => gemini::scan(text, estimator, memo),
        }
    }

    /// The dialect of a wire API: the one at its place in the list both are declared from.
    pub fn of_api(api: compactor_plugin_api::Api) -> DialectKind {
        DialectKind::ALL[api as usize]
    }

    /// The wire API a summarizer calling the caller's provider should speak.
    pub fn api(self) -> compactor_plugin_api::Api {
        compactor_plugin_api::Api::ALL[self.index()]
    }

    /// A request asking the caller's own model for a compaction summary inside the
    /// conversation ([`compactor_plugin_api::SummaryRequest::in_conversation`]): `body`, the
    /// request as the provider last received it, followed by `turn`, answered in at most
    /// `max_output` tokens (see each dialect's `ask_for_summary`). The messages are copied
    /// byte for byte (only the last may change, to hold the turn) and written after every
    /// other field. The body and the output tokens it asks for (Anthropic adds the thinking
    /// budget the request keeps).
    pub fn ask_for_summary(
        self,
        body: &[u8],
        turn: &str,
        max_output: u32,
    ) -> Result<(Vec<u8>, usize), DialectError> {
        let field = self.conversation_field();
        let fields: BTreeMap<String, Box<RawValue>> = serde_json::from_slice(body)?;
        let mut params = Map::new();
        let mut conversation = None;
        for (name, value) in fields {
            if name == field {
                conversation = Some(value);
            } else {
                params.insert(name, serde_json::from_str(value.get())?);
            }
        }
        let conversation = conversation.ok_or(DialectError::NoConversation(field))?;
        let mut items: Vec<Box<RawValue>> = match serde_json::from_str(conversation.get()) {
            Ok(items) => items,
            // Responses' `input` may be one string: the user's message.
            Err(_) if self == DialectKind::Responses => {
                let text: String = serde_json::from_str(conversation.get())?;
                vec![serde_json::value::to_raw_value(
                    &serde_json::json!({"role": "user", "content": text}),
                )?]
            }
            Err(e) => return Err(e.into()),
        };
        let asked = match self {
            DialectKind::ChatCompletions => {
                chat::ask_for_summary(&mut params, &mut items, turn, max_output)?
            }
            DialectKind::Messages => {
                messages::ask_for_summary(&mut params, &mut items, turn, max_output)?
            }
            DialectKind::Responses => {
                responses::ask_for_summary(&mut params, &mut items, turn, max_output)?
            }
            DialectKind::Gemini => {
                gemini::ask_for_summary(&mut params, &mut items, turn, max_output)?
            }
        };
        let mut out = Vec::with_capacity(body.len() + turn.len() + 256);
        out.push(b'{');
        for (name, value) in &params {
            serde_json::to_writer(&mut out, name)?;
            out.push(b':');
            serde_json::to_writer(&mut out, value)?;
            out.push(b',');
        }
        serde_json::to_writer(&mut out, field)?;
        out.extend_from_slice(b":[");
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(item.get().as_bytes());
        }
        out.extend_from_slice(b"]}");
        Ok((out, asked))
    }

    /// The field holding the conversation.
    pub(crate) fn conversation_field(self) -> &'static str {
        match self {
            DialectKind::ChatCompletions | DialectKind::Messages => "messages",
            DialectKind::Responses => "input",
            DialectKind::Gemini => "contents",
        }
    }

    /// How many formats there are.
    pub const COUNT: usize = DialectKind::ALL.len();

    /// This format's place in [`DialectKind::ALL`] (and in every array indexed by format).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The format whose [`DialectKind::label`] is `label`.
    pub fn from_label(label: &str) -> Option<DialectKind> {
        DialectKind::ALL.into_iter().find(|d| d.label() == label)
    }

    /// The end of the format's chat path, after any prefix (see [`DialectKind::from_path`]);
    /// Gemini's follows the model (`…/models/{model}:generateContent`, or
    /// `:streamGenerateContent` when streamed).
    pub fn api_path(self) -> &'static str {
        match self {
            DialectKind::ChatCompletions => "/chat/completions",
            DialectKind::Messages => "/messages",
            DialectKind::Responses => "/responses",
            DialectKind::Gemini => ":generateContent",
        }
    }

    /// The prefix of `path` before this format's API path, when `path` is one of its chat
    /// paths (before any collection check, see [`split_path`]).
    fn prefix_of(self, path: &str) -> Option<&str> {
        match self {
            DialectKind::Gemini => gemini::split_path(path),
            _ => path.strip_suffix(self.api_path()),
        }
    }

    /// The model a request's API prefix names, for formats that name it in the path
    /// (Gemini); `None` for the others, whose body names it.
    pub fn model_in_prefix(self, api_prefix: &str) -> Option<&str> {
        match self {
            DialectKind::Gemini => gemini::model_of_prefix(api_prefix),
            DialectKind::ChatCompletions | DialectKind::Messages | DialectKind::Responses => None,
        }
    }

    /// The format's name on the command line (`compactor compact --dialect`).
    pub fn cli_name(self) -> &'static str {
        match self {
            DialectKind::ChatCompletions => "chat-completions",
            DialectKind::Messages => "messages",
            DialectKind::Responses => "responses",
            DialectKind::Gemini => "gemini",
        }
    }

    /// The format a request body has, from its shape alone (a recording without a path):
    /// the first of [`DialectKind::ALL`] that recognises it (each format's `looks_like`).
    pub fn detect(request: &Map<String, Value>) -> Option<DialectKind> {
        DialectKind::ALL.into_iter().find(|d| match d {
            DialectKind::ChatCompletions => chat::looks_like(request),
            DialectKind::Messages => messages::looks_like(request),
            DialectKind::Responses => responses::looks_like(request),
            DialectKind::Gemini => gemini::looks_like(request),
        })
    }

    /// The bounded metric label of this dialect.
    pub fn label(self) -> &'static str {
        match self {
            DialectKind::ChatCompletions => "chat_completions",
            DialectKind::Messages => "messages",
            DialectKind::Responses => "responses",
            DialectKind::Gemini => "gemini",
        }
    }

    /// The path prefix before the API path: `/v1` for `/v1/chat/completions`; empty when
    /// `path` is not a chat path of this dialect.
    pub fn api_prefix(self, path: &str) -> &str {
        match split_path(path) {
            Some((dialect, prefix)) if dialect == self => prefix,
            _ => "",
        }
    }
}

/// Collections of the providers' APIs whose items have a `messages` path of their own: an
/// Assistants thread's `/v1/threads/{id}/messages` and a stored chat completion's
/// `/v1/chat/completions/{id}/messages`. A path whose prefix ends in one of these (or in one
/// of these and an id) is a call on that item, not a chat call. Only the end of the prefix is
/// looked at, so a route prefix or base path may have any name.
const COLLECTIONS: [&str; 2] = ["threads", "completions"];

/// Splits a chat path into its dialect and the prefix before the API path (no trailing
/// slash); `None` for any other path. See [`DialectKind::from_path`].
fn split_path(path: &str) -> Option<(DialectKind, &str)> {
    let path = path.trim_end_matches('/');
    let (dialect, prefix) = DialectKind::ALL
        .into_iter()
        .find_map(|dialect| Some((dialect, dialect.prefix_of(path)?)))?;
    let under_collection = prefix
        .rsplit('/')
        .take(2)
        .any(|segment| COLLECTIONS.contains(&segment));
    (!under_collection).then_some((dialect, prefix))
}

/// What tests read of a body: its scan and the transcript built from it.
#[cfg(test)]
pub(crate) struct Parsed<'a> {
    pub scan: Scan<'a>,
    pub transcript: Transcript,
}

#[cfg(test)]
impl DialectKind {
    /// Scans `body` with the default estimator and builds its transcript (tests only).
    pub(crate) fn parse(self, body: &[u8]) -> Result<Parsed<'_>, DialectError> {
        let scan = self.scan(body, &LazyEstimator::default())?;
        let transcript = scan.transcript(0)?;
        Ok(Parsed { scan, transcript })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chat calls are recognised under any route prefix or base path; every other `POST` the
    /// providers have that ends in, or sits under, `messages`, `responses` or
    /// `chat/completions` is not a chat call.
    #[test]
    fn chat_paths_are_recognised_by_their_whole_shape() {
        use DialectKind::*;
        let chat = [
            ("/v1/chat/completions", ChatCompletions, "/v1"),
            ("/chat/completions", ChatCompletions, ""),
            ("/v1/chat/completions/", ChatCompletions, "/v1"),
            (
                "/openai/deployments/gpt-4o/chat/completions",
                ChatCompletions,
                "/openai/deployments/gpt-4o",
            ),
            ("/api/v1/chat/completions", ChatCompletions, "/api/v1"),
            (
                "/v1beta/openai/chat/completions",
                ChatCompletions,
                "/v1beta/openai",
            ),
            ("/chat/v1/chat/completions", ChatCompletions, "/chat/v1"),
            ("/v1/messages", Messages, "/v1"),
            ("/messages", Messages, ""),
            ("/anthropic/v1/messages", Messages, "/anthropic/v1"),
            ("/v1/messages/", Messages, "/v1"),
            ("/v1/responses", Responses, "/v1"),
            ("/v1/responses/", Responses, "/v1"),
            ("/responses", Responses, ""),
            ("/openai/responses", Responses, "/openai"),
            ("/openai/v1/responses", Responses, "/openai/v1"),
            (
                "/v1beta/models/gemini-2.5-pro:generateContent",
                Gemini,
                "/v1beta/models/gemini-2.5-pro",
            ),
            (
                "/v1beta/models/gemini-2.5-flash:streamGenerateContent",
                Gemini,
                "/v1beta/models/gemini-2.5-flash",
            ),
            (
                "/google/v1beta/tunedModels/mine:generateContent",
                Gemini,
                "/google/v1beta/tunedModels/mine",
            ),
            (
                "/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-pro:streamGenerateContent",
                Gemini,
                "/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-pro",
            ),
        ];
        for (path, dialect, prefix) in chat {
            assert_eq!(DialectKind::from_path(path), Some(dialect), "{path}");
            assert_eq!(dialect.api_prefix(path), prefix, "{path}");
        }
        let not_chat = [
            // OpenAI Assistants: threads, their messages and runs.
            "/v1/threads",
            "/v1/threads/thread_abc/messages",
            "/v1/threads/thread_abc/messages/",
            "/v1/threads/thread_abc/messages/msg_abc",
            "/v1/threads/runs",
            "/v1/threads/thread_abc/runs",
            "/v1/threads/thread_abc/runs/run_abc/cancel",
            "/v1/threads/thread_abc/runs/run_abc/submit_tool_outputs",
            "/openai/threads/thread_abc/messages",
            "/v1/assistants",
            // OpenAI Responses: everything under a response, and the other calls.
            "/v1/responses/resp_abc",
            "/v1/responses/resp_abc/cancel",
            "/v1/responses/compact",
            "/v1/responses/input_tokens",
            "/v1/responses/resp_abc/input_items",
            "/v1/conversations",
            "/v1/conversations/conv_abc/items",
            // Stored chat completions.
            "/v1/chat/completions/chatcmpl_abc",
            "/v1/chat/completions/chatcmpl_abc/messages",
            // Anthropic: token counting and batches.
            "/v1/messages/count_tokens",
            "/v1/messages/batches",
            "/v1/messages/batches/msgbatch_abc/cancel",
            "/v1/messages/batches/msgbatch_abc/results",
            "/anthropic/v1/messages/count_tokens",
            // Neither provider's chat.
            "/v1/completions",
            "/v1/embeddings",
            "/v1/models",
            "/v1/batches",
            // Gemini: everything but generating content, and verbs without a model.
            "/v1beta/models/gemini-2.5-pro:countTokens",
            "/v1beta/models/gemini-2.5-pro:embedContent",
            "/v1beta/models/gemini-2.5-pro:batchGenerateContent",
            "/v1beta/models/gemini-2.5-pro",
            "/v1beta/models",
            "/v1beta/models/:generateContent",
            "/v1beta/cachedContents/abc:generateContent",
            "/v1beta/files/abc:generateContent",
            ":generateContent",
            "/",
            "",
        ];
        for path in not_chat {
            assert_eq!(DialectKind::from_path(path), None, "{path}");
            for dialect in DialectKind::ALL {
                assert_eq!(dialect.api_prefix(path), "", "{dialect:?} {path}");
            }
        }
    }

    /// A body that is not UTF-8 does not scan, in any dialect, and the error says where it
    /// stops being UTF-8 (as `std::str::from_utf8` does), in short bodies and long ones.
    #[test]
    fn bodies_that_are_not_utf8_are_malformed_where_they_stop_being_utf8() {
        for pad in [0, 5, 100, 5_000] {
            for bad in [
                &b"\xff"[..],
                b"\xc3",
                b"\xe6\x97",
                b"\xed\xa0\x80",
                b"\xc3\xa9\x80",
            ] {
                let mut body = br#"{"model":"m","messages":[{"role":"user","content":""#.to_vec();
                body.extend(std::iter::repeat_n(b'a', pad));
                body.extend_from_slice("é".as_bytes());
                body.extend_from_slice(bad);
                body.extend_from_slice(br#""}],"input":[]}"#);
                let expected = std::str::from_utf8(&body)
                    .expect_err("not UTF-8")
                    .valid_up_to();
                for dialect in DialectKind::ALL {
                    match dialect.scan(&body, &LazyEstimator::default()) {
                        Err(DialectError::Malformed { at }) => assert_eq!(at, expected),
                        other => panic!("{dialect:?} {pad} {bad:?}: {other:?}"),
                    }
                }
            }
        }
    }

    /// A rewrite copies every byte outside the replaced messages: whitespace, field order and
    /// escapes of the other fields survive, in every dialect.
    #[test]
    fn a_rewrite_splices_bytes() {
        let bodies = [
            (
                DialectKind::ChatCompletions,
                "{ \"model\" : \"m\",\n \"messages\":[{\"role\":\"system\",\"content\":\"s\"}, {\"role\":\"user\",\"content\":\"a\"},\n{\"role\":\"assistant\",\"content\":\"b\"} , {\"role\":\"user\",\"content\":\"c\"}], \"x\":\"\\u00e9\"}",
                1,
            ),
            (
                DialectKind::Messages,
                "{\"messages\": [{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\",\"content\":\"b\"},\t{\"role\":\"assistant\",\"content\":\"c\"}] ,\"model\":\"m\"}",
                0,
            ),
            (
                DialectKind::Responses,
                "{\"input\":[{\"role\":\"developer\",\"content\":\"d\"},{\"role\":\"user\",\"content\":\"a\"} ,{\"role\":\"assistant\",\"content\":\"b\"},{\"role\":\"user\",\"content\":\"c\"}],\"store\" : false}",
                1,
            ),
            (
                DialectKind::Gemini,
                "{\"contents\" : [{\"role\":\"user\",\"parts\":[{\"text\":\"a\"}]},{\"role\":\"model\",\"parts\":[{\"text\":\"b\"}]},\n{\"role\":\"model\",\"parts\":[{\"text\":\"c\"}]}, {\"role\":\"user\",\"parts\":[{\"text\":\"d\"}]}], \"generationConfig\":{\"x\":\"\\u00e9\"}}",
                0,
            ),
        ];
        let est = LazyEstimator::default();
        for (dialect, body, head) in bodies {
            let scan = dialect.scan(body.as_bytes(), &est).expect("scan");
            assert_eq!(scan.head_len(0).expect("head"), head, "{body}");
            let out = scan.rewrite(head, head + 2, "SUMMARY").expect("rewrite");
            let out = String::from_utf8(out).expect("utf-8");
            let start = body.find(scan.messages[head]).expect("head message");
            let end = body.find(scan.messages[head + 2]).expect("tail message");
            assert_eq!(out[..start], body[..start], "{dialect:?}: bytes before");
            assert!(
                out.ends_with(&body[end..]),
                "{dialect:?}: bytes after: {out}"
            );
            assert!(out.contains("SUMMARY"), "{out}");
            let v: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
            let field = dialect.conversation_field();
            assert_eq!(
                v[field].as_array().map(Vec::len),
                Some(scan.len() - 1),
                "{out}"
            );
        }
    }

    /// The summary asked inside the conversation: the request as received, then the turn
    /// asking for it, valid for the provider, with nothing else of the conversation changed.
    #[test]
    fn a_summary_is_asked_after_the_conversation_in_each_format() {
        use crate::testing::valid_for_provider;
        use serde_json::Value;
        let turn = "Summarize the conversation above.";
        let tools = serde_json::json!([{"type": "function",
            "function": {"name": "bash", "parameters": {"type": "object"}}}]);

        // Chat Completions: a user message after the tool results; tools kept, not callable.
        let chat = serde_json::json!({
            "model": "gpt-4o", "stream": true, "stream_options": {"include_usage": true},
            "max_completion_tokens": 32000, "tools": tools, "n": 1,
            "messages": [
                {"role": "system", "content": "agent"},
                {"role": "user", "content": "fix it"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                    "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}
            ]
        });
        let body = serde_json::to_vec(&chat).expect("json");
        let (asked, tokens) = DialectKind::ChatCompletions
            .ask_for_summary(&body, turn, 2_000)
            .expect("asks");
        assert_eq!(tokens, 2_000);
        valid_for_provider(DialectKind::ChatCompletions, &asked).expect("valid");
        let v: Value = serde_json::from_slice(&asked).expect("json");
        let messages = v["messages"].as_array().expect("messages");
        assert_eq!(
            &messages[..4],
            chat["messages"].as_array().expect("sent").as_slice()
        );
        assert_eq!(
            messages[4],
            serde_json::json!({"role": "user", "content": turn})
        );
        assert_eq!(v["stream"], false);
        assert!(v.get("stream_options").is_none() && v.get("n").is_none());
        assert_eq!(v["max_completion_tokens"], 2_000, "the name the agent used");
        assert!(v.get("max_tokens").is_none());
        assert_eq!(v["tools"], tools);
        assert_eq!(v["tool_choice"], "none");
        // The messages are the bytes sent (a provider's cache of a replayed request compares
        // them), after every other field.
        let sent = DialectKind::ChatCompletions
            .scan(&body, &LazyEstimator::default())
            .expect("scan");
        let written = String::from_utf8(asked.clone()).expect("utf-8");
        let at = written
            .find(sent.messages[0])
            .expect("the first message as sent");
        assert!(
            written[at..].starts_with(&sent.messages.join(",")),
            "{written}"
        );
        assert!(written.ends_with("\"}]}"));

        // Responses: an input item; instructions, reasoning and the cache key as sent.
        let responses = serde_json::json!({
            "model": "gpt-5", "instructions": "agent", "stream": true, "store": true,
            "reasoning": {"effort": "medium"}, "prompt_cache_key": "conv-1",
            "text": {"verbosity": "low", "format": {"type": "json_object"}},
            "include": ["reasoning.encrypted_content"], "tools": tools,
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix it"}]},
                {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"}
            ]
        });
        let body = serde_json::to_vec(&responses).expect("json");
        let (asked, _) = DialectKind::Responses
            .ask_for_summary(&body, turn, 3_000)
            .expect("asks");
        valid_for_provider(DialectKind::Responses, &asked).expect("valid");
        let v: Value = serde_json::from_slice(&asked).expect("json");
        let input = v["input"].as_array().expect("input");
        assert_eq!(
            &input[..3],
            responses["input"].as_array().expect("sent").as_slice()
        );
        assert_eq!(input[3]["role"], "user");
        assert_eq!(input[3]["content"][0]["text"], turn);
        assert_eq!(
            (v["stream"].clone(), v["store"].clone()),
            (false.into(), false.into())
        );
        assert_eq!(v["max_output_tokens"], 3_000);
        assert_eq!(v["tool_choice"], "none");
        assert_eq!(v["text"], serde_json::json!({"verbosity": "low"}));
        for kept in [
            "instructions",
            "reasoning",
            "prompt_cache_key",
            "include",
            "model",
        ] {
            assert_eq!(v[kept], responses[kept], "{kept}");
        }

        // Messages: a text block after the tool results, markers and thinking as sent, the
        // thinking budget on top of the summary's.
        let messages = serde_json::json!({
            "model": "claude-sonnet-4-5", "stream": true, "max_tokens": 32000,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "system": [{"type": "text", "text": "agent", "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "fix it"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "sig"},
                    {"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                    "content": "ok", "cache_control": {"type": "ephemeral"}}]}
            ]
        });
        let body = serde_json::to_vec(&messages).expect("json");
        let (asked, tokens) = DialectKind::Messages
            .ask_for_summary(&body, turn, 2_000)
            .expect("asks");
        assert_eq!(tokens, 3_024);
        valid_for_provider(DialectKind::Messages, &asked).expect("valid");
        let v: Value = serde_json::from_slice(&asked).expect("json");
        let sent = messages["messages"].as_array().expect("sent");
        let got = v["messages"].as_array().expect("messages");
        assert_eq!(
            got.len(),
            3,
            "roles alternate: the turn joins the tool results"
        );
        assert_eq!(&got[..2], &sent[..2]);
        assert_eq!(
            got[2]["content"][0], sent[2]["content"][0],
            "the marker stays"
        );
        assert_eq!(
            got[2]["content"][1],
            serde_json::json!({"type": "text", "text": turn})
        );
        assert_eq!(
            (v["stream"].clone(), v["max_tokens"].clone()),
            (false.into(), 3_024.into())
        );
        for kept in ["thinking", "system", "tools", "model"] {
            assert_eq!(v[kept], messages[kept], "{kept}");
        }

        // Gemini: a text part after the function responses (roles alternate), tools kept but
        // not callable, the thinking budget on top of the summary's, a JSON answer not asked.
        let gemini = serde_json::json!({
            "systemInstruction": {"parts": [{"text": "agent"}]},
            "tools": [{"functionDeclarations": [{"name": "run_shell_command"}]}],
            "generationConfig": {"temperature": 1, "responseMimeType": "application/json",
                "thinkingConfig": {"includeThoughts": true, "thinkingBudget": 512}},
            "contents": [
                {"role": "user", "parts": [{"text": "fix it"}]},
                {"role": "model", "parts": [{"functionCall": {"name": "run_shell_command", "args": {}},
                    "thoughtSignature": "c2ln"}]},
                {"role": "user", "parts": [{"functionResponse": {"name": "run_shell_command",
                    "response": {"output": "ok"}}}]}
            ]
        });
        let body = serde_json::to_vec(&gemini).expect("json");
        let (asked, tokens) = DialectKind::Gemini
            .ask_for_summary(&body, turn, 2_000)
            .expect("asks");
        assert_eq!(tokens, 2_512);
        valid_for_provider(DialectKind::Gemini, &asked).expect("valid");
        let v: Value = serde_json::from_slice(&asked).expect("json");
        let sent = gemini["contents"].as_array().expect("sent");
        let got = v["contents"].as_array().expect("contents");
        assert_eq!(got.len(), 3, "the turn joins the function responses");
        assert_eq!(&got[..2], &sent[..2]);
        assert_eq!(got[2]["parts"][0], sent[2]["parts"][0]);
        assert_eq!(got[2]["parts"][1], serde_json::json!({"text": turn}));
        assert_eq!(v["generationConfig"]["maxOutputTokens"], 2_512);
        assert!(v["generationConfig"].get("responseMimeType").is_none());
        assert_eq!(
            v["generationConfig"]["thinkingConfig"],
            gemini["generationConfig"]["thinkingConfig"]
        );
        assert_eq!(v["toolConfig"]["functionCallingConfig"]["mode"], "NONE");
        for kept in ["systemInstruction", "tools"] {
            assert_eq!(v[kept], gemini[kept], "{kept}");
        }

        // Without a marker in its messages nothing would be read from the cache: refused.
        let mut unmarked = messages.clone();
        unmarked["messages"][2]["content"][0]
            .as_object_mut()
            .expect("block")
            .remove("cache_control");
        let body = serde_json::to_vec(&unmarked).expect("json");
        assert!(DialectKind::Messages
            .ask_for_summary(&body, turn, 2_000)
            .is_err());
        // Not a request of the format: refused, never a panic.
        for dialect in DialectKind::ALL {
            for bad in [
                &b"[]"[..],
                b"{}",
                b"{\"messages\": 3, \"input\": 3}",
                b"not json",
            ] {
                assert!(
                    dialect.ask_for_summary(bad, turn, 1).is_err(),
                    "{dialect:?}"
                );
            }
        }
    }

    /// Every table indexed by format agrees with the one list (`wire_formats!`): a format
    /// added there is found by its index, label, command-line name, path and shape, and
    /// converts to the plugin API's wire API and back.
    #[test]
    fn every_format_is_in_every_table() {
        use compactor_plugin_api::Api;
        use std::collections::HashSet;
        assert_eq!(DialectKind::COUNT, DialectKind::ALL.len());
        let mut labels = HashSet::new();
        let mut names = HashSet::new();
        for (i, d) in DialectKind::ALL.into_iter().enumerate() {
            assert_eq!(d.index(), i);
            assert!(
                labels.insert(d.label()) && names.insert(d.cli_name()),
                "{d:?}"
            );
            assert_eq!(DialectKind::from_label(d.label()), Some(d));
            let path = match d {
                DialectKind::Gemini => format!("/v1beta/models/m{}", d.api_path()),
                _ => format!("/v1{}", d.api_path()),
            };
            assert_eq!(DialectKind::from_path(&path), Some(d));
            assert_eq!(DialectKind::of_api(d.api()), d);
            // A body of the format's shape is told apart from the others'.
            let sample = match d {
                DialectKind::ChatCompletions => {
                    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                }
                DialectKind::Messages => serde_json::json!({"model": "m", "system": "s",
                    "messages": [{"role": "user", "content": "hi"}]}),
                DialectKind::Responses => serde_json::json!({"model": "m", "input": "hi"}),
                DialectKind::Gemini => {
                    serde_json::json!({"contents": [{"role": "user", "parts": [{"text": "hi"}]}]})
                }
            };
            let Value::Object(sample) = sample else {
                panic!("an object")
            };
            assert_eq!(DialectKind::detect(&sample), Some(d));
        }
        assert_eq!(Api::ALL.len(), DialectKind::COUNT);
        assert_eq!(Api::default(), Api::ChatCompletions, "when unknown");
        for api in Api::ALL {
            assert_eq!(DialectKind::of_api(api).api(), api);
            assert_eq!(
                format!("{api:?}"),
                format!("{:?}", DialectKind::of_api(api))
            );
        }
    }
}
