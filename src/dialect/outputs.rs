//! Tool outputs where they sit in the wire JSON: finding them in a scanned request, reading
//! what they say, and writing the request back with some of them replaced.
//!
//! Masking old observations in the forwarded request (`compaction.strategy` `mask` and
//! `hybrid`, docs/architecture.md, *Masking of old observations*) replaces the value of an
//! output in place and nothing else: a Chat Completions `tool` (or legacy `function`)
//! message's `content`, an Anthropic `tool_result` block's `content`, an OpenAI Responses
//! `function_call_output` or `custom_tool_call_output` item's `output`. The message, its
//! role, the call id, `is_error`, `cache_control` and every other block or item (signed
//! `thinking` blocks, `reasoning` items with `encrypted_content`) are copied byte for byte, so
//! tool calls stay paired with their results and nothing signed changes. Each output is found
//! by a structural pass over its own message only, after a substring test that skips messages
//! that cannot hold one, so a request with nothing to mask costs little more than the scan.
//!
//! Outputs of other shapes (`computer_call_output` screenshots, `shell_call_output` objects)
//! are counted as outputs but never replaced: a string is not a valid value for them.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::LazyLock;

use memchr::memmem::Finder;

use serde::de::IgnoredAny;
use serde_json::Value;

use super::json::Piece;
use super::split::{decode, object_fields, present, read_array, value_len, Field};
use super::{span_in, DialectError, DialectKind, Scan};
use crate::transcript::Role;

/// One tool output of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireOutput<'a> {
    /// The message (Responses: input item) holding it.
    pub message: usize,
    /// The id of the call it answers, when it names one.
    pub call_id: Option<String>,
    /// The tool's name, when the output itself names it (Chat Completions `name`).
    pub name: Option<String>,
    /// Its value as sent (a slice of the body), when it is one a placeholder string may
    /// replace; `None` for an output without content or of another shape.
    pub value: Option<&'a str>,
}

/// What an output says: its text (text parts joined by line breaks) and how many images it
/// holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutputText {
    /// The text, decoded.
    pub text: String,
    /// Images among its parts.
    pub images: usize,
}

/// An output value replaced by a JSON string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edit<'a> {
    /// The value replaced: a slice of the body ([`WireOutput::value`]).
    pub value: &'a str,
    /// The text of the JSON string written in its place.
    pub text: String,
}

/// The substrings that tell a message may hold an output, each searched with SIMD
/// (`memchr::memmem`): the test runs on every message of every `hybrid` request, and
/// `str::contains` was 8% of a 200 KB request's CPU.
pub(super) struct Markers {
    pub(super) tool: Finder<'static>,
    pub(super) function: Finder<'static>,
    user: Finder<'static>,
    pub(super) tool_result: Finder<'static>,
    pub(super) call_output: Finder<'static>,
    pub(super) function_response: Finder<'static>,
    pub(super) function_response_snake: Finder<'static>,
    provider_summary: Finder<'static>,
    item_reference: Finder<'static>,
}

pub(super) static MARKERS: LazyLock<Markers> = LazyLock::new(|| Markers {
    tool: Finder::new("\"tool\""),
    function: Finder::new("\"function\""),
    user: Finder::new("\"user\""),
    tool_result: Finder::new("tool_result"),
    call_output: Finder::new("_call_output"),
    function_response: Finder::new("\"functionResponse\""),
    function_response_snake: Finder::new("\"function_response\""),
    // A JSON string holding exactly the kind (an escaped one in text has a backslash before
    // its closing quote).
    provider_summary: Finder::new(PROVIDER_SUMMARY_MARK),
    item_reference: Finder::new("\"item_reference\""),
});

/// What [`Markers::provider_summary`] looks for:
/// [`PROVIDER_SUMMARY_KIND`](crate::transcript::PROVIDER_SUMMARY_KIND) as a JSON string.
const PROVIDER_SUMMARY_MARK: &str = "\"compaction\"";

/// [`PROVIDER_SUMMARY_MARK`] without its quotes.
const PROVIDER_SUMMARY_WORD: &[u8] = b"compaction";

/// Whether `raw` holds what `marker` finds.
pub(super) fn holds(raw: &str, marker: &Finder<'_>) -> bool {
    marker.find(raw.as_bytes()).is_some()
}

/// The outputs part of a message's marks.
const OUTPUTS: u32 = 0xFFFF;
/// The mark of a message that may be a user turn.
const USER: u32 = 1 << 16;
/// The mark of a message that may hold a provider summary
/// ([`Part::is_provider_summary`](crate::transcript::Part::is_provider_summary)).
const SUMMARY: u32 = 1 << 17;

/// The mark of a Responses item that may be an `item_reference` (an item held by OpenAI).
const REFERENCE: u32 = 1 << 18;

/// Whether a message with mark `mark` may hold a provider summary.
pub(super) fn may_hold_provider_summary(mark: u32) -> bool {
    mark & SUMMARY != 0
}

/// Whether a Responses item with mark `mark` may be an `item_reference`.
pub(super) fn may_be_item_reference(mark: u32) -> bool {
    mark & REFERENCE != 0
}

/// A message's marks, found by substring search: how many outputs of `dialect` it may hold
/// (at least as many as [`Scan::outputs`] finds), [`USER`] if it may be a user turn
/// ([`Scan::observation`] needs one), and [`SUMMARY`] if it may hold a provider summary
/// ([`Scan::head_len`] needs one), and for Responses [`REFERENCE`] if it may be an
/// `item_reference` (its scan needs one).
pub(super) fn marks(dialect: DialectKind, raw: &str) -> u32 {
    let m = &*MARKERS;
    let outputs = match dialect {
        DialectKind::ChatCompletions => usize::from(holds(raw, &m.tool) || holds(raw, &m.function)),
        DialectKind::Messages => m.tool_result.find_iter(raw.as_bytes()).count(),
        DialectKind::Responses => usize::from(holds(raw, &m.call_output)),
        DialectKind::Gemini => m
            .function_response
            .find_iter(raw.as_bytes())
            .count()
            .saturating_add(m.function_response_snake.find_iter(raw.as_bytes()).count()),
    };
    let outputs = u32::try_from(outputs).unwrap_or(OUTPUTS).min(OUTPUTS);
    let user = if holds(raw, &m.user) { USER } else { 0 };
    let summary = if holds(raw, &m.provider_summary) {
        SUMMARY
    } else {
        0
    };
    let reference = if dialect == DialectKind::Responses && holds(raw, &m.item_reference) {
        REFERENCE
    } else {
        0
    };
    outputs | user | summary | reference
}

/// A dialect's mark patterns as member-by-member reading finds them ([`value_marks`]): the
/// JSON strings that are a pattern whole, and the text a string ending with it stands for.
struct StringMarks {
    /// Strings equal to the word (`"user"`), or ending with an escaped quote and the word.
    quoted: &'static [(&'static [u8], Mark)],
    /// Strings ending with the word (`tool_result`: a block's type; `_call_output`: an item's).
    ending: &'static [(&'static [u8], Mark)],
    /// The last bytes of all the words: a string ending otherwise (most) is none of them.
    last: [bool; 256],
    /// The last two bytes of each word (every word is longer), little-endian, the list padded
    /// with its first: the last byte alone lets a fifth of English text through (`r`, `n`,
    /// `l` end many words).
    ends: [u16; ENDS],
}

/// Room for the words of a dialect's [`StringMarks`].
const ENDS: usize = 8;

impl StringMarks {
    const fn new(
        quoted: &'static [(&'static [u8], Mark)],
        ending: &'static [(&'static [u8], Mark)],
    ) -> StringMarks {
        assert!(quoted.len() + ending.len() <= ENDS);
        let mut ends = [0; ENDS];
        let mut last = [false; 256];
        let mut i = 0;
        while i < ENDS {
            let n = i % (quoted.len() + ending.len());
            let word = if n < quoted.len() {
                quoted[n].0
            } else {
                ending[n - quoted.len()].0
            };
            let [.., a, b] = word else {
                panic!("a mark word is at least two bytes long");
            };
            ends[i] = u16::from_le_bytes([*a, *b]);
            last[*b as usize] = true;
            i += 1;
        }
        StringMarks {
            quoted,
            ending,
            last,
            ends,
        }
    }
}

/// What one pattern found says.
#[derive(Debug, Clone, Copy)]
enum Mark {
    /// An output more (counted).
    Output,
    /// The message holds an output (at most one).
    HasOutput,
    /// A flag of the marks.
    Flag(u32),
}

#[inline]
fn string_marks(dialect: DialectKind) -> &'static StringMarks {
    const USER_WORD: (&[u8], Mark) = (b"user", Mark::Flag(USER));
    const SUMMARY_WORD: (&[u8], Mark) = (PROVIDER_SUMMARY_WORD, Mark::Flag(SUMMARY));
    static CHAT: StringMarks = StringMarks::new(
        &[
            (b"tool", Mark::HasOutput),
            (b"function", Mark::HasOutput),
            USER_WORD,
            SUMMARY_WORD,
        ],
        &[],
    );
    static MESSAGES: StringMarks = StringMarks::new(
        &[USER_WORD, SUMMARY_WORD],
        &[(b"tool_result", Mark::Output)],
    );
    static RESPONSES: StringMarks = StringMarks::new(
        &[
            USER_WORD,
            SUMMARY_WORD,
            (b"item_reference", Mark::Flag(REFERENCE)),
        ],
        &[(b"_call_output", Mark::HasOutput)],
    );
    static GEMINI: StringMarks = StringMarks::new(
        &[
            (b"functionResponse", Mark::Output),
            (b"function_response", Mark::Output),
            USER_WORD,
            SUMMARY_WORD,
        ],
        &[],
    );
    match dialect {
        DialectKind::ChatCompletions => &CHAT,
        DialectKind::Messages => &MESSAGES,
        DialectKind::Responses => &RESPONSES,
        DialectKind::Gemini => &GEMINI,
    }
}

/// The marks of a JSON string whose inside (as written, escapes and all) is `inner`: a key, or
/// a value. A quoted pattern (a whole JSON string: `"user"`) can end inside a string only at
/// its closing quote, every other quote in it being escaped: the string is the word, or ends
/// with an escaped quote and the word; a search of the message finds no other. An unquoted
/// pattern counts when the string ends with it, as every real output's `type` does
/// (`"tool_result"`, `"function_call_output"`); a search also counts text that mentions one
/// further in, which holds no output: fewer marks, never fewer than the outputs.
///
/// Most strings end otherwise than every pattern: the last byte, then the last two, tell,
/// inlined where the readers pass (a key and a value of every member of every message), and
/// only a string that ends like a pattern is compared with them, out of line.
#[inline]
fn string_marks_of(dialect: DialectKind, inner: &[u8]) -> u32 {
    let patterns = string_marks(dialect);
    match inner {
        [.., a, b]
            if patterns.last[usize::from(*b)]
                && patterns.ends.contains(&u16::from_le_bytes([*a, *b])) =>
        {
            string_marks_compared(dialect, patterns, inner)
        }
        _ => 0,
    }
}

/// [`string_marks_of`] for a string ending with the last two bytes of a pattern.
#[inline(never)]
fn string_marks_compared(dialect: DialectKind, patterns: &StringMarks, inner: &[u8]) -> u32 {
    let mut marks = 0;
    for &(word, mark) in patterns.quoted {
        // The string is the word, or ends with a quote (escaped) and the word: where the
        // word would start tells, before the bytes are compared.
        let quoted = inner.len().checked_sub(word.len()).is_some_and(|start| {
            (start == 0 || inner.get(start - 1) == Some(&b'"')) && inner.ends_with(word)
        });
        if quoted {
            marks = add_marks(dialect, marks, found(mark));
        }
    }
    for &(word, mark) in patterns.ending {
        if inner.ends_with(word) {
            marks = add_marks(dialect, marks, found(mark));
        }
    }
    marks
}

/// The marks one found pattern gives.
fn found(mark: Mark) -> u32 {
    match mark {
        Mark::Output | Mark::HasOutput => 1,
        Mark::Flag(bit) => bit,
    }
}

/// The marks of two parts of one message together: flags of either; outputs added where
/// they are counted (Anthropic's `tool_result` blocks, Gemini's responses), else at most one.
fn add_marks(dialect: DialectKind, a: u32, b: u32) -> u32 {
    let outputs = match dialect {
        DialectKind::Messages | DialectKind::Gemini => ((a & OUTPUTS) + (b & OUTPUTS)).min(OUTPUTS),
        DialectKind::ChatCompletions | DialectKind::Responses => (a | b) & OUTPUTS,
    };
    outputs | (a | b) & !OUTPUTS
}

/// The marks of a message found piece by piece as a fast reader passes over it
/// ([`Piece`]): the same as [`marks`] of the whole message but for text that mentions an
/// unquoted pattern further in than its end ([`string_marks_of`]).
pub(super) struct MarksFound {
    dialect: DialectKind,
    pub(super) marks: u32,
}

impl MarksFound {
    pub(super) fn new(dialect: DialectKind) -> MarksFound {
        MarksFound { dialect, marks: 0 }
    }

    #[inline(always)]
    pub(super) fn see(&mut self, piece: Piece<'_>) {
        let marks = match piece {
            Piece::Key(key) => string_marks_of(self.dialect, key.as_bytes()),
            Piece::Value(value) => value_marks(self.dialect, value),
        };
        // Adding none changes nothing (most pieces).
        if marks != 0 {
            self.marks = add_marks(self.dialect, self.marks, marks);
        }
    }
}

/// The marks of one value of a message as written, for readers that read a message member by
/// member: a string is tested at its end ([`string_marks_of`]), anything else searched.
#[inline(always)]
fn value_marks(dialect: DialectKind, value: &str) -> u32 {
    match value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
        Some(inner) => string_marks_of(dialect, inner.as_bytes()),
        None => marks(dialect, value),
    }
}

/// How far back from an output [`CallNames::name`] looks for the call it answers.
pub const CALL_SEARCH_MESSAGES: usize = 64;

/// How many times the body's length [`CallNames`] may read in all, looking for calls.
const CALL_SEARCH_BUDGET: usize = 4;

/// Finds the names of the tool calls that outputs answer, for their placeholders.
///
/// A lookup searches back from the output for the nearest message making a call with its id.
/// Messages holding outputs make no calls and are passed unread (so the outputs of parallel
/// calls do not search through each other); any other message is searched for the id, and one
/// holding it is parsed, once: its calls are remembered. A request can still name ids found
/// nowhere (or everywhere: an empty one), and thousands of outputs can sit in one Anthropic
/// message, each searching the same messages back: all lookups of a request together read at
/// most four times the body's length (`CALL_SEARCH_BUDGET`), and past that outputs go without
/// a name (their placeholders say less, nothing else changes).
pub struct CallNames<'s, 'a> {
    scan: &'s Scan<'a>,
    /// Messages holding outputs.
    answers: Vec<bool>,
    /// The calls of each message parsed so far: id → name (of the last call with that id).
    calls: HashMap<usize, HashMap<String, String>>,
    /// Bytes the lookups may still read.
    budget: usize,
    /// Bytes read so far.
    read: usize,
}

impl<'s, 'a> CallNames<'s, 'a> {
    /// Lookups in `scan` for `outputs` (those [`Scan::outputs`] found), with the budget the
    /// body's length allows.
    pub fn new(scan: &'s Scan<'a>, outputs: &[WireOutput<'_>]) -> CallNames<'s, 'a> {
        let mut answers = vec![false; scan.messages.len()];
        for output in outputs {
            if let Some(answer) = answers.get_mut(output.message) {
                *answer = true;
            }
        }
        CallNames {
            scan,
            answers,
            calls: HashMap::new(),
            budget: scan.body().len().saturating_mul(CALL_SEARCH_BUDGET),
            read: 0,
        }
    }

    /// The name of the call `call_id` that an output in message `before` answers: the nearest
    /// earlier message (at most [`CALL_SEARCH_MESSAGES`] back) making a call with that id.
    pub fn name(&mut self, call_id: &str, before: usize) -> Option<String> {
        let messages = &self.scan.messages;
        let end = before.min(messages.len());
        for j in (end.saturating_sub(CALL_SEARCH_MESSAGES)..end).rev() {
            if self.answers[j] {
                continue;
            }
            if let Some(calls) = self.calls.get(&j) {
                match calls.get(call_id) {
                    Some(name) => return Some(name.clone()),
                    None => continue,
                }
            }
            let raw = messages[j];
            // A search, then (for a message holding the id) a parse: each reads the message.
            if !self.spend(raw.len()) {
                return None;
            }
            if !raw.contains(call_id) {
                continue;
            }
            if !self.spend(raw.len()) {
                return None;
            }
            let calls: HashMap<String, String> = match self.scan.message(j) {
                Ok(message) => message
                    .tool_calls()
                    .filter_map(|call| Some((call.id.clone()?, call.name.clone())))
                    .collect(),
                Err(_) => HashMap::new(),
            };
            let found = calls.get(call_id).cloned();
            self.calls.insert(j, calls);
            if found.is_some() {
                return found;
            }
        }
        None
    }

    /// Takes `bytes` from the budget; `false` (taking nothing) when it has not that many left.
    fn spend(&mut self, bytes: usize) -> bool {
        let Some(left) = self.budget.checked_sub(bytes) else {
            self.budget = 0;
            return false;
        };
        self.budget = left;
        self.read += bytes;
        true
    }

    /// Bytes the lookups have read.
    pub fn read(&self) -> usize {
        self.read
    }
}

/// Part `type`s that carry an image, in any dialect's tool output.
const IMAGE_TYPES: &[&str] = &["image", "image_url", "input_image", "computer_screenshot"];

impl<'a> Scan<'a> {
    /// The messages of `range` (clamped to the conversation) as the message-count trigger
    /// counts them: one each, except that in Responses a run of the model's own items
    /// (reasoning, function calls, its message) is one message, as Chat Completions carries a
    /// reply and its calls in one assistant message. So a tool step counts two in every
    /// dialect (the reply with its call, and the output) rather than three or four items in
    /// Responses. Read off the marks: an item that may be neither a user turn nor an output
    /// continues the run of the item before it when that one may be neither either.
    pub fn counted(&self, range: Range<usize>) -> usize {
        let end = range.end.min(self.marks.len());
        let start = range.start.min(end);
        if self.dialect != DialectKind::Responses {
            return end - start;
        }
        let model = |mark: u32| mark & (OUTPUTS | USER) == 0;
        let marks = &self.marks[start..end];
        marks.len()
            - marks
                .windows(2)
                .filter(|pair| model(pair[0]) && model(pair[1]))
                .count()
    }

    /// At most how many outputs message `index` holds, [`Scan::outputs`] and, with
    /// `observations`, [`Scan::observation`] counted together: read off the marks the scan
    /// found (a substring search per message, once per conversation with the scan memo), so
    /// a request with too few outputs to mask any is known without reading them.
    pub fn outputs_bound(&self, index: usize, observations: bool) -> usize {
        let mark = self.marks.get(index).copied().unwrap_or(0);
        (mark & OUTPUTS) as usize + usize::from(observations && mark & USER != 0)
    }

    /// The tool outputs message `index` holds, in order (Anthropic: one per `tool_result`
    /// block; otherwise at most one).
    pub fn outputs(&self, index: usize) -> Result<Vec<WireOutput<'a>>, DialectError> {
        let raw = *self.messages.get(index).ok_or(DialectError::BadMessage {
            index,
            reason: "no such message",
        })?;
        match self.dialect {
            DialectKind::ChatCompletions => super::chat::outputs(raw, index),
            DialectKind::Messages => super::messages::outputs(raw, index),
            DialectKind::Responses if self.input_is_string => Ok(Vec::new()),
            DialectKind::Responses => super::responses::outputs(raw, index),
            DialectKind::Gemini => super::gemini::outputs(raw, index),
        }
    }

    /// Message `index` as an observation sent as a person's turn, for agents that run
    /// commands without function calling (SWE-agent's classic mode writes what a command
    /// printed as the next user message): a user message of text only (a string, or text
    /// parts) whose previous message is the assistant's. The first user message, which
    /// follows the system prompt and states the task, never is one. Whether its text *is* an
    /// observation is for the caller to decide (`compaction.observation_pattern`).
    pub fn observation(&self, index: usize) -> Result<Option<WireOutput<'a>>, DialectError> {
        let Some(raw) = self.messages.get(index).copied() else {
            return Ok(None);
        };
        if index == 0 || self.input_is_string || !holds(raw, &MARKERS.user) {
            return Ok(None);
        }
        let fields = fields_of(raw)?;
        let role: Option<Value> = decode(&fields, "role")?;
        if role.as_ref().and_then(Value::as_str) != Some("user") {
            return Ok(None);
        }
        if self.dialect == DialectKind::Responses {
            let kind: Option<Value> = decode(&fields, "type")?;
            if kind.as_ref().is_some_and(|k| k.as_str() != Some("message")) {
                return Ok(None);
            }
        }
        let Some(value) = replaceable(present(&fields, "content")?) else {
            return Ok(None);
        };
        if value.starts_with('[') && !text_parts_only(value)? {
            return Ok(None);
        }
        if self.message(index - 1)?.role != Role::Assistant {
            return Ok(None);
        }
        Ok(Some(WireOutput {
            message: index,
            call_id: None,
            name: None,
            value: Some(value),
        }))
    }

    /// The first message a rewrite replacing `[head..boundary]` copies verbatim: `boundary`,
    /// or the one after it when the summary is merged into it (Anthropic and Gemini, a tail
    /// opening with a user message).
    pub fn verbatim_from(&self, boundary: usize) -> Result<usize, DialectError> {
        let merges = matches!(self.dialect, DialectKind::Messages | DialectKind::Gemini);
        if !merges || boundary >= self.messages.len() {
            return Ok(boundary);
        }
        let first = self.message(boundary)?;
        Ok(if first.role == Role::User && !first.is_tool_answer() {
            boundary + 1
        } else {
            boundary
        })
    }

    /// The request with `summary` applied as [`Scan::rewrite`] does (`(head, boundary,
    /// message)`), and each edit's output value replaced by its text as a JSON string: every
    /// other byte is copied as received. Edits must lie in messages the summary leaves verbatim
    /// ([`Scan::verbatim_from`]) and must not overlap.
    pub fn rewrite_with(
        &self,
        summary: Option<(usize, usize, &str)>,
        edits: &[Edit<'_>],
    ) -> Result<Vec<u8>, DialectError> {
        let mut ranges: Vec<(Range<usize>, &str)> = edits
            .iter()
            .map(|e| {
                span_in(self.body, e.value)
                    .map(|r| (r, e.text.as_str()))
                    .ok_or(DialectError::BadMessage {
                        index: 0,
                        reason: "masked output not a slice of the body",
                    })
            })
            .collect::<Result<_, _>>()?;
        ranges.sort_by_key(|(r, _)| r.start);
        if ranges.windows(2).any(|w| w[0].0.end > w[1].0.start) {
            return Err(DialectError::BadMessage {
                index: 0,
                reason: "masked outputs overlap",
            });
        }
        let (base, verbatim_start) = match summary {
            None => (None, 0),
            Some((head, boundary, message)) => {
                let out = self.rewrite(head, boundary, message)?;
                let from = self.verbatim_from(boundary)?;
                let start = if from < self.messages.len() {
                    self.span(from)?.start
                } else {
                    self.body.len()
                };
                (Some(out), start)
            }
        };
        if ranges.is_empty() {
            return Ok(base.unwrap_or_else(|| self.body.to_vec()));
        }
        if ranges.iter().any(|(r, _)| r.start < verbatim_start) {
            return Err(DialectError::BadMessage {
                index: 0,
                reason: "masked output inside the summarised prefix",
            });
        }
        // The bytes from `verbatim_start` on end the rewritten body as they end the original.
        let source: &[u8] = base.as_deref().unwrap_or(self.body);
        let shift = source.len() as isize - self.body.len() as isize;
        let extra: usize = ranges.iter().map(|(_, t)| t.len() + 2).sum();
        let mut out = Vec::with_capacity(source.len().saturating_add(extra));
        let mut at = 0usize;
        for (range, text) in ranges {
            let start = (range.start as isize + shift) as usize;
            let end = (range.end as isize + shift) as usize;
            out.extend_from_slice(source.get(at..start).ok_or(DialectError::BadPlan {
                head: at,
                boundary: start,
                len: source.len(),
            })?);
            serde_json::to_writer(&mut out, text)?;
            at = end;
        }
        out.extend_from_slice(source.get(at..).unwrap_or_default());
        Ok(out)
    }
}

/// What an output value says: a string, or parts whose `text` fields are its text and whose
/// image types are images.
pub fn output_text(value: &str) -> Result<OutputText, DialectError> {
    let v: Value = serde_json::from_str(value)?;
    let mut out = OutputText::default();
    let push = |out: &mut OutputText, text: &str| {
        if !out.text.is_empty() {
            out.text.push('\n');
        }
        out.text.push_str(text);
    };
    let parts = match &v {
        Value::Array(parts) => parts.as_slice(),
        other => std::slice::from_ref(other),
    };
    for part in parts {
        match part {
            Value::String(s) => push(&mut out, s),
            Value::Object(o) => {
                let kind = o.get("type").and_then(Value::as_str).unwrap_or_default();
                if IMAGE_TYPES.contains(&kind) {
                    out.images += 1;
                } else if let Some(t) = o.get("text").and_then(Value::as_str) {
                    push(&mut out, t);
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// The top-level fields of the object `raw`, values as slices of it.
pub(super) fn fields_of(raw: &str) -> Result<Vec<Field<'_>>, DialectError> {
    // No field is read specially: the conversation name matches nothing a caller reads.
    object_fields(raw, "\u{0}outputs", value_len)
}

/// A value a placeholder string may replace: a string or an array of parts.
pub(super) fn replaceable(value: Option<&str>) -> Option<&str> {
    value.filter(|v| v.starts_with('"') || v.starts_with('['))
}

/// Whether every part of the array `value` is a text part (`text`, `input_text`): a turn
/// with an image, a tool result or a document is never taken for an observation.
fn text_parts_only(value: &str) -> Result<bool, DialectError> {
    let (parts, _) = read_array::<IgnoredAny>(value)?;
    for part in parts.map(|(p, _)| p).unwrap_or_default() {
        if !part.starts_with('{') {
            return Ok(false);
        }
        let kind: Option<Value> = decode(&fields_of(part)?, "type")?;
        if !matches!(
            kind.as_ref().and_then(Value::as_str),
            Some("text" | "input_text")
        ) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// A JSON string's text.
pub(super) fn string(v: Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::LazyEstimator;
    use serde_json::json;

    /// A body of `dialect` holding one message of each shape its agents send, `text` in every
    /// place a message holds text.
    fn shapes_body(dialect: DialectKind, text: &str) -> String {
        let body = match dialect {
            DialectKind::ChatCompletions => json!({"model": "m", "messages": [
                {"role": "system", "content": text},
                {"role": "user", "content": [{"type": "text", "text": text}]},
                {"role": "tool", "tool_call_id": "c1", "content": text},
                {"role": "assistant", "content": text, "name": text},
            ]}),
            DialectKind::Messages => json!({"model": "m", "max_tokens": 1, "messages": [
                {"role": "user", "content": text},
                {"role": "assistant", "content": [{"type": "text", "text": text},
                    {"type": "tool_use", "id": "t1", "name": "sh", "input": {"cmd": text}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": text},
                    {"type": "tool_result", "tool_use_id": "t2",
                     "content": [{"type": "text", "text": text}]},
                    {"type": "text", "text": text}]},
            ]}),
            DialectKind::Responses => json!({"model": "m", "input": [
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": text}]},
                {"type": "function_call", "call_id": "c1", "name": "sh", "arguments": text},
                {"type": "function_call_output", "call_id": "c1", "output": text},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": text}]},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]},
            ]}),
            DialectKind::Gemini => json!({"contents": [
                {"role": "user", "parts": [{"text": text}]},
                {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {"a": text}}}]},
                {"role": "user", "parts": [
                    {"functionResponse": {"name": "f", "response": {"out": text}}},
                    {"text": text}]},
            ]}),
        };
        body.to_string()
    }

    proptest::proptest! {
        /// Breaks if the marks a fast reader finds on the way are not those a search of each
        /// message finds (the same flags; outputs no more than the search counts, and never
        /// fewer than the message holds), or if a message's outputs exceed its bound.
        #[test]
        fn marks_found_on_the_way_bound_the_outputs_as_a_search_does(
            pieces in proptest::collection::vec(
                "user|tool|function|compaction|tool_result|_call_output|function_call_output|item_reference|functionResponse|\"|\\\\|[a-z ]{0,4}",
                0..6,
            ),
        ) {
            let text = pieces.concat();
            let est = LazyEstimator::default();
            for dialect in [
                DialectKind::ChatCompletions,
                DialectKind::Messages,
                DialectKind::Responses,
                DialectKind::Gemini,
            ] {
                let body = shapes_body(dialect, &text);
                let scan = dialect.scan(body.as_bytes(), &est).expect("scans");
                for (i, raw) in scan.messages.iter().enumerate() {
                    let (found, searched) = (scan.marks[i], marks(dialect, raw));
                    proptest::prop_assert_eq!(found & !OUTPUTS, searched & !OUTPUTS, "{}", raw);
                    proptest::prop_assert!(found & OUTPUTS <= searched & OUTPUTS, "{}", raw);
                    let outputs = scan.outputs(i).expect("outputs").len();
                    proptest::prop_assert!(outputs <= scan.outputs_bound(i, false), "{}", raw);
                }
            }
        }
    }

    #[test]
    fn the_provider_summary_mark_is_its_kind_as_a_json_string() {
        let kind = crate::transcript::PROVIDER_SUMMARY_KIND;
        assert_eq!(PROVIDER_SUMMARY_MARK, format!("\"{kind}\""));
        let marked = |raw: &str| may_hold_provider_summary(marks(DialectKind::Responses, raw));
        assert!(marked(r#"{"type":"compaction","encrypted_content":"x"}"#));
        assert!(!marked(
            r#"{"role":"user","content":"the \"compaction\" item"}"#
        ));
    }

    fn scan(dialect: DialectKind, body: &[u8]) -> Scan<'_> {
        dialect
            .scan(body, &LazyEstimator::default())
            .unwrap_or_else(|e| panic!("scan: {e}"))
    }

    /// A tool step counts two messages in every dialect: in Responses the model's run of
    /// items (reasoning, call, its message) is one, the output another.
    #[test]
    fn the_message_count_folds_the_models_runs_of_responses_items() {
        let step = |i: usize| {
            vec![
                json!({"type": "reasoning", "summary": [], "encrypted_content": "e"}),
                json!({"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": "a \"user\" asked"}]}),
                json!({"type": "function_call", "call_id": format!("c{i}"), "name": "ls",
                       "arguments": "{\"who\":\"user\"}"}),
                json!({"type": "function_call_output", "call_id": format!("c{i}"), "output": "x"}),
            ]
        };
        let mut input = vec![
            json!({"type": "message", "role": "developer", "content": "rules"}),
            json!({"role": "user", "content": "fix it"}),
        ];
        for i in 0..5 {
            input.extend(step(i));
        }
        input.push(json!({"role": "user", "content": "and the docs"}));
        input.extend(step(5));
        let body = json!({"model": "gpt-5", "input": input}).to_string();
        let s = scan(DialectKind::Responses, body.as_bytes());
        assert_eq!(s.len(), 2 + 6 * 4 + 1);
        // The developer message, the task, 6 steps of two, the second user turn.
        assert_eq!(s.counted(0..s.len()), 2 + 6 * 2 + 1);
        // A range counts its own runs: from the middle of a run, the rest of it is one.
        assert_eq!(s.counted(3..6), 2);
        assert_eq!(s.counted(0..0), 0);
        assert_eq!(s.counted(20..1_000), s.counted(20..s.len()));
        // Chat Completions counts every message, as it carries a reply and its calls in one.
        let chat = json!({"model": "gpt-4o", "messages": [
            {"role": "user", "content": "fix it"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "ls", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "x"},
            {"role": "assistant", "content": "done"}]})
        .to_string();
        let s = scan(DialectKind::ChatCompletions, chat.as_bytes());
        assert_eq!(s.counted(0..s.len()), 4);
    }

    fn all_outputs<'a>(s: &Scan<'a>) -> Vec<WireOutput<'a>> {
        (0..s.len())
            .flat_map(|i| s.outputs(i).unwrap_or_else(|e| panic!("outputs {i}: {e}")))
            .collect()
    }

    /// Replaces every replaceable output by `MASKED <id>` and checks the bytes around them.
    fn mask_all(s: &Scan<'_>) -> Value {
        let edits: Vec<Edit<'_>> = all_outputs(s)
            .iter()
            .filter_map(|o| {
                Some(Edit {
                    value: o.value?,
                    text: format!("MASKED {}", o.call_id.as_deref().unwrap_or("?")),
                })
            })
            .collect();
        let out = s.rewrite_with(None, &edits).expect("rewrite");
        // Only the values changed: the body minus each value equals the output minus each
        // replacement.
        let body = std::str::from_utf8(s.body()).expect("utf-8");
        let out_text = String::from_utf8(out.clone()).expect("utf-8");
        let mut expected = String::new();
        let mut at = 0;
        let mut spans: Vec<_> = edits
            .iter()
            .map(|e| (span_in(s.body(), e.value).expect("span"), &e.text))
            .collect();
        spans.sort_by_key(|(r, _)| r.start);
        for (r, text) in spans {
            expected.push_str(&body[at..r.start]);
            expected.push_str(&serde_json::to_string(text).expect("json"));
            at = r.end;
        }
        expected.push_str(&body[at..]);
        assert_eq!(out_text, expected);
        serde_json::from_slice(&out).expect("valid JSON")
    }

    #[test]
    fn chat_tool_messages_are_outputs_and_only_their_content_changes() {
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "the tool role is \"tool\""},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "line 1\nline 2"},
            {"role": "tool", "tool_call_id": "c2", "name": "read", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "function", "name": "legacy", "content": "old"},
            {"role": "user", "content": "\"tool\" \"function\" is just text here"}
        ], "x": 1})
        .to_string();
        let s = scan(DialectKind::ChatCompletions, body.as_bytes());
        let outputs = all_outputs(&s);
        let summary: Vec<_> = outputs
            .iter()
            .map(|o| (o.message, o.call_id.as_deref(), o.name.as_deref()))
            .collect();
        assert_eq!(
            summary,
            [
                (2, Some("c1"), None),
                (3, Some("c2"), Some("read")),
                (4, None, Some("legacy"))
            ]
        );
        assert_eq!(
            CallNames::new(&s, &all_outputs(&s))
                .name("c1", 2)
                .as_deref(),
            Some("bash")
        );
        assert_eq!(CallNames::new(&s, &all_outputs(&s)).name("c9", 5), None);
        let read = output_text(outputs[1].value.expect("value")).expect("text");
        assert_eq!((read.text.as_str(), read.images), ("a", 1));
        let v = mask_all(&s);
        assert_eq!(v["messages"][2]["content"], "MASKED c1");
        assert_eq!(v["messages"][2]["tool_call_id"], "c1");
        assert_eq!(v["messages"][3]["content"], "MASKED c2");
        assert_eq!(v["messages"][5]["content"], body_text(&body, 5));
    }

    fn body_text(body: &str, i: usize) -> Value {
        let v: Value = serde_json::from_str(body).expect("json");
        v["messages"][i]["content"].clone()
    }

    #[test]
    fn anthropic_tool_result_blocks_are_outputs_and_thinking_is_untouched() {
        let body = json!({"model": "claude", "system": "s", "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "SIG=="},
                {"type": "tool_use", "id": "t1", "name": "Read", "input": {"p": 1}},
                {"type": "tool_use", "id": "t2", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t2", "content": "two", "cache_control": {"type": "ephemeral"}},
                {"type": "tool_result", "tool_use_id": "t1", "is_error": true, "content": [{"type": "text", "text": "one"}]},
                {"type": "tool_result", "tool_use_id": "t3"},
                {"type": "text", "text": "tool_result mentioned"}]}
        ]})
        .to_string();
        let s = scan(DialectKind::Messages, body.as_bytes());
        let outputs = all_outputs(&s);
        let ids: Vec<_> = outputs
            .iter()
            .map(|o| (o.message, o.call_id.as_deref(), o.value.is_some()))
            .collect();
        assert_eq!(
            ids,
            [
                (2, Some("t2"), true),
                (2, Some("t1"), true),
                (2, Some("t3"), false)
            ]
        );
        assert_eq!(
            CallNames::new(&s, &all_outputs(&s))
                .name("t1", 2)
                .as_deref(),
            Some("Read")
        );
        let v = mask_all(&s);
        let blocks = &v["messages"][2]["content"];
        assert_eq!(blocks[0]["content"], "MASKED t2");
        assert_eq!(blocks[0]["cache_control"]["type"], "ephemeral");
        assert_eq!(blocks[1]["content"], "MASKED t1");
        assert_eq!(blocks[1]["is_error"], true);
        assert_eq!(blocks[3]["text"], "tool_result mentioned");
        assert_eq!(v["messages"][1]["content"][0]["signature"], "SIG==");
    }

    #[test]
    fn call_lookups_read_at_most_their_budget_and_still_find_a_call_next_to_its_output() {
        // 64 messages of a kilobyte, one real call, then 2,000 outputs in one message naming
        // ids found nowhere: each would search all 64 messages back.
        let mut messages: Vec<Value> = (0..64)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                json!({"role": role, "content": "x".repeat(1000)})
            })
            .collect();
        messages.push(json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": "t_real", "name": "Read", "input": {}}]}));
        let mut results =
            vec![json!({"type": "tool_result", "tool_use_id": "t_real", "content": "ok"})];
        results.extend((0..2000).map(|i| {
            json!({"type": "tool_result", "tool_use_id": format!("nowhere-{i}"), "content": "x"})
        }));
        messages.push(json!({"role": "user", "content": results}));
        let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": messages})
            .to_string();
        let s = scan(DialectKind::Messages, body.as_bytes());
        let last = s.messages.len() - 1;
        let mut names = CallNames::new(&s, &all_outputs(&s));
        assert_eq!(names.name("t_real", last).as_deref(), Some("Read"));
        for i in 0..2000 {
            assert_eq!(names.name(&format!("nowhere-{i}"), last), None);
        }
        let unbounded: usize = 2000
            * s.messages[last - CALL_SEARCH_MESSAGES..last]
                .iter()
                .map(|m| m.len())
                .sum::<usize>();
        assert!(
            unbounded > 50 * body.len(),
            "the case is one the budget matters for"
        );
        assert!(
            names.read() <= CALL_SEARCH_BUDGET * body.len(),
            "read {} bytes of a {}-byte body",
            names.read(),
            body.len()
        );
        // An id found nowhere costs its search; the budget is what stops them.
        assert!(names.read() > (CALL_SEARCH_BUDGET - 1) * body.len());
    }

    #[test]
    fn the_outputs_of_parallel_calls_find_their_calls_without_searching_past_each_other() {
        let calls: Vec<Value> = (0..30)
            .map(|i| {
                json!({"id": format!("c{i}"), "type": "function",
                            "function": {"name": format!("tool{i}"), "arguments": "{}"}})
            })
            .collect();
        let mut messages = vec![
            json!({"role": "user", "content": "go"}),
            json!({"role": "assistant", "content": null, "tool_calls": calls}),
        ];
        messages.extend((0..30).map(|i| {
            json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": "y".repeat(10_000)})
        }));
        let body = json!({"model": "gpt-4o", "messages": messages}).to_string();
        let s = scan(DialectKind::ChatCompletions, body.as_bytes());
        let mut names = CallNames::new(&s, &all_outputs(&s));
        for i in 0..30 {
            assert_eq!(
                names.name(&format!("c{i}"), 2 + i).as_deref(),
                Some(&*format!("tool{i}"))
            );
        }
        // The calls' message, searched and parsed once; not the outputs between.
        assert_eq!(names.read(), 2 * s.messages[1].len());
    }

    #[test]
    fn responses_call_outputs_are_outputs_and_reasoning_is_untouched() {
        let body = json!({"model": "gpt", "input": [
            {"role": "user", "content": "go"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "ENC_call_output"},
            {"type": "function_call", "call_id": "f1", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "f1", "output": "done\nok"},
            {"type": "custom_tool_call", "call_id": "p1", "name": "apply_patch", "input": "x"},
            {"type": "custom_tool_call_output", "call_id": "p1", "output": [{"type": "input_text", "text": "patched"}]},
            {"type": "computer_call_output", "call_id": "k1", "output": {"type": "computer_screenshot", "image_url": "u"}}
        ]})
        .to_string();
        let s = scan(DialectKind::Responses, body.as_bytes());
        let outputs = all_outputs(&s);
        let ids: Vec<_> = outputs
            .iter()
            .map(|o| (o.message, o.call_id.as_deref(), o.value.is_some()))
            .collect();
        assert_eq!(
            ids,
            [
                (3, Some("f1"), true),
                (5, Some("p1"), true),
                (6, Some("k1"), false)
            ]
        );
        assert_eq!(
            CallNames::new(&s, &all_outputs(&s))
                .name("p1", 5)
                .as_deref(),
            Some("apply_patch")
        );
        let v = mask_all(&s);
        assert_eq!(v["input"][3]["output"], "MASKED f1");
        assert_eq!(v["input"][5]["output"], "MASKED p1");
        assert_eq!(v["input"][1]["encrypted_content"], "ENC_call_output");
        // A string input holds no outputs.
        let string = json!({"input": "function_call_output"}).to_string();
        let s = scan(DialectKind::Responses, string.as_bytes());
        assert!(all_outputs(&s).is_empty());
    }

    #[test]
    fn edits_follow_a_summary_and_stay_out_of_what_it_replaces() {
        let body = json!({"messages": [
            {"role": "user", "content": "task"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "Read", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "first"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "b", "name": "Read", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "b", "content": "second"}]},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "next"}
        ], "model": "claude"})
        .to_string();
        let s = scan(DialectKind::Messages, body.as_bytes());
        let outputs = all_outputs(&s);
        fn edit<'a>(o: &WireOutput<'a>) -> Edit<'a> {
            Edit {
                value: o.value.expect("value"),
                text: "M".into(),
            }
        }
        // Summary over [0..3): the tail opens with an assistant message, so it starts at 3.
        assert_eq!(s.verbatim_from(3).expect("from"), 3);
        let out = s
            .rewrite_with(Some((0, 3, "SUMMARY")), &[edit(&outputs[1])])
            .expect("rewrite");
        let v: Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(v["messages"][0]["content"], "SUMMARY");
        assert_eq!(v["messages"][2]["content"][0]["content"], "M");
        assert_eq!(v["messages"][4]["content"], "next");
        assert_eq!(v["model"], "claude");
        // An output the summary replaces cannot be edited.
        assert!(s
            .rewrite_with(Some((0, 3, "SUMMARY")), &[edit(&outputs[0])])
            .is_err());
        // A summary merged into the user message at the boundary rewrites it whole.
        assert_eq!(s.verbatim_from(6).expect("from"), 7);
        // Overlapping edits are refused.
        assert!(s
            .rewrite_with(None, &[edit(&outputs[0]), edit(&outputs[0])])
            .is_err());
    }

    /// The messages of each dialect's body that [`Scan::observation`] offers, with the text
    /// they hold.
    fn observations(dialect: DialectKind, body: &Value) -> Vec<(usize, String)> {
        let body = body.to_string();
        let s = scan(dialect, body.as_bytes());
        (0..s.len())
            .filter_map(|i| s.observation(i).unwrap_or_else(|e| panic!("{i}: {e}")))
            .map(|o| {
                let text = output_text(o.value.expect("a value")).expect("text").text;
                (o.message, text)
            })
            .collect()
    }

    #[test]
    fn observations_are_text_user_turns_answering_the_assistant_in_every_dialect() {
        let printed = "total 0\n(Current directory: /repo)\nbash-$";
        // Chat Completions: the task after the system prompt is not one; a user turn after
        // the assistant is, as a string or as text parts; one with an image is not.
        let chat = json!({"model": "m", "messages": [
            {"role": "system", "content": "You run commands."},
            {"role": "user", "content": "Fix the bug.\nbash-$"},
            {"role": "assistant", "content": "```\nls\n```"},
            {"role": "user", "content": printed},
            {"role": "assistant", "content": "```\nls -a\n```"},
            {"role": "user", "content": [{"type": "text", "text": printed}]},
            {"role": "assistant", "content": "look"},
            {"role": "user", "content": [{"type": "text", "text": printed},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
            {"role": "user", "content": "and a person's second turn"},
        ]});
        assert_eq!(
            observations(DialectKind::ChatCompletions, &chat),
            vec![(3, printed.to_string()), (5, printed.to_string())]
        );
        // Anthropic: a user turn of tool results is a tool output, not an observation; the
        // first message (the task) never is one.
        let anthropic = json!({"model": "claude", "system": "You run commands.", "messages": [
            {"role": "user", "content": "Fix the bug."},
            {"role": "assistant", "content": [{"type": "text", "text": "ls"}]},
            {"role": "user", "content": printed},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash",
                "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                "content": "x"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": printed,
                "cache_control": {"type": "ephemeral"}}]},
        ]});
        assert_eq!(
            observations(DialectKind::Messages, &anthropic),
            vec![(2, printed.to_string()), (6, printed.to_string())]
        );
        // Responses: message items only; a string `input` holds none.
        let responses = json!({"model": "gpt", "input": [
            {"role": "user", "content": "Fix the bug."},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                "text": "ls"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text",
                "text": printed}]},
            {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "y"},
            {"role": "user", "content": printed},
        ]});
        assert_eq!(
            observations(DialectKind::Responses, &responses),
            vec![(2, printed.to_string())]
        );
        let string_input = json!({"model": "gpt", "input": printed});
        assert!(observations(DialectKind::Responses, &string_input).is_empty());
    }
}
