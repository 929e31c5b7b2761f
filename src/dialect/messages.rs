//! Anthropic Messages (`POST …/v1/messages`): scan, neutral messages and rewrite.
//!
//! - [`scan`] (every request): one pass splitting the messages into raw slices of the body and
//!   estimating what the
//!   model reads: text, `tool_use` names and inputs (as JSON text), `tool_result` content
//!   (strings or blocks, images included), `thinking`, images at a fixed cost, and the string
//!   leaves of any other block (`document`, `redacted_thinking`, `server_tool_use`,
//!   `web_search_tool_result`, ...); ids, signatures, citations and `cache_control` are not
//!   read as text. The top-level `system` (string or blocks) and `tools` are counted as fixed
//!   tokens. Roles other than `user`, `assistant` and `system` make the body not a Messages
//!   request (it passes through). A `system` message in `messages` is a mid-conversation
//!   system turn (Claude Code 2.1 sends its environment as one, right after the first user
//!   message); it is a [`Role::System`] message like Chat Completions' `system` messages.
//! - `message` (only when a compaction is due or a stored summary is spliced in): one
//!   neutral message per wire message: `text` → text, `image` → image, `tool_use` → a
//!   tool call (id, name, input as sent), `tool_result` → a [`Part::ToolResult`] (call id,
//!   content, `is_error`), `thinking` → reasoning, anything else → opaque. Messages keep their
//!   wire role, so a user message of `tool_result` blocks stays one message answering every
//!   parallel call of the assistant message before it.
//! - `rewrite`: `system`, `tools`, `tool_choice`, `metadata`, `thinking` and every unknown
//!   field byte for byte; `messages` becomes the kept head (the opening, see
//!   `Transcript::keeping_opening`), one user message holding the summary, then the preserved
//!   tail verbatim. Roles must alternate, so the summary joins a user neighbour as a text
//!   block: after the blocks of a head ending on a user message, before those of a tail
//!   starting with one (their blocks, `cache_control` markers included, stay as they are);
//!   a tail starting with
//!   `tool_result` blocks is refused (they must answer the message right before them, which
//!   the boundary rules never cut away).

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::answer::{RefusalWording, Usage, UsageFields};
use super::json::{
    as_tokens, fast_role_content, leaf_weight, node_counts, ContentSeed, OneOf, OrderedObject,
    Rules,
};
use super::outputs::{self, fields_of, holds, replaceable, MarksFound, WireOutput, MARKERS};
use super::scan_memo::{read_conversation, Remembering};
use super::split::{decode, field, object_fields, present, read_array};
use super::{DialectError, DialectKind, Scan, ScanFields};
use crate::estimate::{Counts, LazyEstimator};
use crate::transcript::{Message, Part, Role, ToolCall, ToolResult};

/// How Anthropic content is counted.
pub(crate) static RULES: Rules = Rules {
    skip: &[
        "id",
        "tool_use_id",
        "cache_control",
        "signature",
        "citations",
        "is_error",
        "role",
    ],
    nested: &["content"],
    raw: &["input"],
    image_types: &["image"],
    image_keys: &[],
};

const ROLES: &[&str] = &["user", "assistant", "system"];

// ---------------------------------------------------------------------------------------------
// Hot path.

/// Reads a request once: its messages as raw slices of `body`, each counted (see
/// [`super::Scan`]).
pub fn scan<'a>(
    body: &'a str,
    estimator: &LazyEstimator,
    memo: Option<&Remembering<'_>>,
) -> Result<Scan<'a>, DialectError> {
    let mut conversation = None;
    let fields = object_fields(body, "messages", |rest| {
        let fast = |m| fast_message(m).map(|(stats, len, marks)| (stats.0, len, Some(marks)));
        let (read, len) =
            read_conversation::<MessageStats>(DialectKind::Messages, rest, fast, memo)?;
        conversation = read;
        Ok(len)
    })?;
    field(&fields, "messages")?;
    let (messages, stats, marks) = conversation.ok_or(DialectError::NoConversation("messages"))?;
    let tokens = stats.into_iter().map(|s| estimator.counts(s)).collect();
    let system = match present(&fields, "system")? {
        Some(raw) => {
            let mut de = serde_json::Deserializer::from_str(raw);
            let counts = de::DeserializeSeed::deserialize(ContentSeed(&RULES), &mut de)?;
            de.end()?;
            counts
        }
        None => Counts::default(),
    };
    let tools = present(&fields, "tools")?.map_or(0, |t| estimator.text(t));
    let max_tokens: Option<Value> = decode(&fields, "max_tokens")?;
    let fields = ScanFields {
        model: decode(&fields, "model")?,
        requested_output: as_tokens(max_tokens.as_ref()),
        fixed_tokens: estimator.counts(system).saturating_add(tools),
        input_is_string: false,
    };
    Ok(Scan::new(
        DialectKind::Messages,
        body.as_bytes(),
        messages,
        tokens,
        marks,
        fields,
    ))
}

/// What the model reads of one message; the role must be `user`, `assistant` or `system`.
struct MessageStats(Counts);

impl From<MessageStats> for Counts {
    fn from(stats: MessageStats) -> Counts {
        stats.0
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum MessageField {
    Role,
    Content,
    #[serde(other)]
    Other,
}

impl<'de> Deserialize<'de> for MessageStats {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MessageStats;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a message object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut counts = Counts::default();
                let mut role_ok = false;
                while let Some(field) = map.next_key::<MessageField>()? {
                    match field {
                        MessageField::Role => role_ok = map.next_value_seed(OneOf(ROLES))?,
                        MessageField::Content => {
                            counts.add(map.next_value_seed(ContentSeed(&RULES))?)
                        }
                        MessageField::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                if !role_ok {
                    return Err(de::Error::custom(
                        "role must be `user`, `assistant` or `system`",
                    ));
                }
                Ok(MessageStats(counts))
            }
        }
        d.deserialize_map(V)
    }
}

/// [`MessageStats`] of the message at the start of `text` read by hand
/// ([`super::json::fast_object`]), and the bytes it takes; `None` leaves it to serde (an
/// unknown role too, so serde says what is wrong). Its output marks are found on the way
/// ([`MarksFound`]).
fn fast_message(text: &str) -> Option<(MessageStats, usize, u32)> {
    let mut found = MarksFound::new(DialectKind::Messages);
    let shape = ("content", ROLES, true);
    let (counts, len) = fast_role_content(text, shape, &RULES, &mut |p| found.see(p))?;
    Some((MessageStats(counts), len, found.marks))
}

// ---------------------------------------------------------------------------------------------
// Full parse.

#[derive(Deserialize)]
struct WireMessage<'a> {
    role: String,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// One wire message in neutral form.
pub(super) fn message(raw: &str, index: usize) -> Result<Message, DialectError> {
    let bad = |reason| DialectError::BadMessage { index, reason };
    let wire: WireMessage<'_> =
        serde_json::from_str(raw).map_err(|_| bad("not a message object"))?;
    let role = match wire.role.as_str() {
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "system" => Role::System,
        _ => return Err(bad("role must be `user`, `assistant` or `system`")),
    };
    let parts = match wire.content {
        None => Vec::new(),
        Some(content) => content_parts(content)?,
    };
    Ok(Message::new(role, parts))
}

/// Content (string, blocks, or anything else as one opaque part) as neutral parts.
fn content_parts(raw: &RawValue) -> Result<Vec<Part>, DialectError> {
    let text = raw.get().trim_start();
    if text.starts_with('[') {
        let blocks: Vec<&RawValue> = serde_json::from_str(raw.get())?;
        let mut parts = Vec::with_capacity(blocks.len());
        for block in blocks {
            block_parts(block, &mut parts)?;
        }
        return Ok(parts);
    }
    let value: Value = serde_json::from_str(raw.get())?;
    Ok(match value {
        Value::String(s) => vec![Part::Text(s)],
        Value::Null => Vec::new(),
        _ => {
            let mut parts = Vec::new();
            block_parts(raw, &mut parts)?;
            parts
        }
    })
}

#[derive(Deserialize)]
struct WireBlock<'a> {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    thinking: Option<Value>,
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    name: Option<Value>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(default)]
    tool_use_id: Option<Value>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(default)]
    is_error: Option<Value>,
}

fn string(v: Option<Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s),
        _ => None,
    }
}

/// One content block as neutral parts (an opaque block holding images adds them as images).
fn block_parts(raw: &RawValue, parts: &mut Vec<Part>) -> Result<(), DialectError> {
    let Ok(block) = serde_json::from_str::<WireBlock<'_>>(raw.get()) else {
        // A bare string or another odd shape: count it, keep it opaque.
        let value: Value = serde_json::from_str(raw.get())?;
        parts.push(match value {
            Value::String(s) => Part::Text(s),
            other => Part::Opaque {
                kind: "unknown".into(),
                weight: leaf_weight(&other),
            },
        });
        return Ok(());
    };
    let kind = block.kind.clone().unwrap_or_else(|| "unknown".into());
    match kind.as_str() {
        "text" if matches!(block.text, Some(Value::String(_))) => {
            parts.push(Part::Text(string(block.text).unwrap_or_default()));
        }
        "image" => parts.push(Part::Image),
        "thinking" if matches!(block.thinking, Some(Value::String(_))) => {
            parts.push(Part::Reasoning(string(block.thinking).unwrap_or_default()));
        }
        "tool_use" if matches!(block.name, Some(Value::String(_))) => {
            parts.push(Part::ToolCall(ToolCall {
                id: string(block.id),
                name: string(block.name).unwrap_or_default(),
                arguments: block.input.map(|i| i.get().to_string()).unwrap_or_default(),
            }));
        }
        "tool_result" => {
            let content = match block.content {
                Some(c) => content_parts(c)?,
                None => Vec::new(),
            };
            parts.push(Part::ToolResult(ToolResult {
                call_id: string(block.tool_use_id),
                name: None,
                content,
                is_error: matches!(block.is_error, Some(Value::Bool(true))),
            }));
        }
        _ => {
            let counts = node_counts(raw.get(), &RULES)?;
            parts.push(Part::Opaque {
                kind,
                weight: counts.text,
            });
            parts.extend(std::iter::repeat_n(Part::Image, counts.images));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Rewrite.

#[derive(Serialize)]
struct SummaryMessage<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct TextBlock<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

fn text_block(text: &str) -> TextBlock<'_> {
    TextBlock { kind: "text", text }
}

/// `messages[head..boundary]` replaced by one user message holding `summary_message`. Roles
/// must alternate, so the summary joins its user neighbours: it is appended to the last
/// message of the head when that is a user message (the conversation's opening, kept
/// verbatim), and the first kept message is merged in when that is a user message. Every
/// block of those messages stays as it was, in order.
pub(super) fn rewrite(
    scan: &Scan<'_>,
    head: usize,
    boundary: usize,
    summary_message: &str,
) -> Result<Vec<u8>, DialectError> {
    let (before, after) = scan.user_neighbours(head, boundary)?;
    let extra = summary_message.len() + before.map_or(0, str::len) + after.map_or(0, str::len);
    let start = if before.is_some() { head - 1 } else { head };
    scan.splice(start, boundary, after.is_some(), extra, |out| {
        match (before, after) {
            (None, None) => serde_json::to_writer(
                out,
                &SummaryMessage {
                    role: "user",
                    content: summary_message,
                },
            ),
            (Some(message), _) => joined_user_message(out, message, summary_message, after),
            (None, Some(message)) => {
                let fields: OrderedObject<'_> = serde_json::from_str(message)?;
                let Some(at) = fields.position("content") else {
                    return Err(serde::ser::Error::custom("user message without content"));
                };
                fields.write_replacing(out, at, |out| {
                    out.push(b'[');
                    serde_json::to_writer(&mut *out, &text_block(summary_message))?;
                    write_blocks(out, fields.0[at].1, true)?;
                    out.push(b']');
                    Ok(())
                })
            }
        }
    })
}

/// Writes the user message `raw` with its content followed by a text block holding `summary`
/// and then the content of `next` (when the message after the summary is a user message too).
fn joined_user_message(
    out: &mut Vec<u8>,
    raw: &str,
    summary: &str,
    next: Option<&str>,
) -> Result<(), serde_json::Error> {
    let fields: OrderedObject<'_> = serde_json::from_str(raw)?;
    let Some(at) = fields.position("content") else {
        return Err(serde::ser::Error::custom("user message without content"));
    };
    let next_content = match next {
        Some(next) => {
            let next: OrderedObject<'_> = serde_json::from_str(next)?;
            let Some(at) = next.position("content") else {
                return Err(serde::ser::Error::custom("user message without content"));
            };
            Some(next.0[at].1)
        }
        None => None,
    };
    fields.write_replacing(out, at, |out| {
        out.push(b'[');
        let wrote = write_blocks(out, fields.0[at].1, false)?;
        if wrote {
            out.push(b',');
        }
        serde_json::to_writer(&mut *out, &text_block(summary))?;
        if let Some(content) = next_content {
            write_blocks(out, content, true)?;
        }
        out.push(b']');
        Ok(())
    })
}

/// Writes the blocks of a message's `content` (each block byte for byte; a string as one text
/// block, none when empty), each preceded by a comma when `comma_first`, else separated by
/// commas; whether any block was written.
fn write_blocks(
    out: &mut Vec<u8>,
    content: &RawValue,
    comma_first: bool,
) -> Result<bool, serde_json::Error> {
    let mut wrote = false;
    let separate = |out: &mut Vec<u8>, wrote: &mut bool| {
        if comma_first || *wrote {
            out.push(b',');
        }
        *wrote = true;
    };
    if content.get().trim_start().starts_with('[') {
        let blocks: Vec<&RawValue> = serde_json::from_str(content.get())?;
        for block in blocks {
            separate(out, &mut wrote);
            out.extend_from_slice(block.get().as_bytes());
        }
        return Ok(wrote);
    }
    match serde_json::from_str::<Value>(content.get())? {
        Value::String(text) if text.is_empty() => {}
        Value::String(text) => {
            separate(out, &mut wrote);
            serde_json::to_writer(&mut *out, &text_block(&text))?;
        }
        Value::Null => {}
        _ => return Err(serde::ser::Error::custom("unexpected content shape")),
    }
    Ok(wrote)
}

// ---------------------------------------------------------------------------------------------
// Tool outputs (for masking; see `outputs`).

/// Anthropic Messages: each `tool_result` block of a message is one output, its `content`.
pub(super) fn outputs(raw: &str, index: usize) -> Result<Vec<WireOutput<'_>>, DialectError> {
    if !holds(raw, &MARKERS.tool_result) {
        return Ok(Vec::new());
    }
    let fields = fields_of(raw)?;
    let Some(content) = present(&fields, "content")? else {
        return Ok(Vec::new());
    };
    if !content.starts_with('[') {
        return Ok(Vec::new());
    }
    let (blocks, _) = read_array::<IgnoredAny>(content)?;
    let mut out = Vec::new();
    for block in blocks.map(|(b, _)| b).unwrap_or_default() {
        if !block.starts_with('{') || !holds(block, &MARKERS.tool_result) {
            continue;
        }
        let fields = fields_of(block)?;
        let kind: Option<Value> = decode(&fields, "type")?;
        if kind.as_ref().and_then(Value::as_str) != Some("tool_result") {
            continue;
        }
        out.push(WireOutput {
            message: index,
            call_id: decode::<Value>(&fields, "tool_use_id")?.and_then(outputs::string),
            name: None,
            value: replaceable(present(&fields, "content")?),
        });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Recognising a body.

/// Whether a request body is Anthropic Messages: a `messages` array with a top-level `system`
/// or a `tool_use` or `tool_result` block.
pub(crate) fn looks_like(request: &Map<String, Value>) -> bool {
    let Some(Value::Array(messages)) = request.get("messages") else {
        return false;
    };
    let tool_block = |message: &Value| {
        message
            .get("content")
            .and_then(Value::as_array)
            .is_some_and(|blocks| {
                blocks.iter().any(|b| {
                    matches!(
                        b.get("type").and_then(Value::as_str),
                        Some("tool_use" | "tool_result")
                    )
                })
            })
    };
    request.contains_key("system") || messages.iter().any(tool_block)
}

// ---------------------------------------------------------------------------------------------
// The summary asked inside the conversation.

/// Turns `body` (a request as the provider received it) into one asking the same model for
/// the summary: `turn` as a text block after the last user message's blocks (a new user
/// message after an assistant one), no streaming, `max_output` tokens beyond any thinking
/// budget, and everything else as sent: `system`, `tools`, `tool_choice` and `thinking`
/// (changing them would invalidate the provider's cache of the messages) and the agent's
/// `cache_control` markers, which are where the provider reads its cache from. A request
/// without a marker in its messages is refused: nothing of it would be read from the cache,
/// and the standalone prompt is smaller. The output tokens asked.
pub(crate) fn ask_for_summary(
    params: &mut Map<String, Value>,
    messages: &mut Vec<Box<RawValue>>,
    turn: &str,
    max_output: u32,
) -> Result<usize, DialectError> {
    if !messages
        .iter()
        .any(|m| m.get().contains("\"cache_control\""))
    {
        return Err(DialectError::BadMessage {
            index: messages.len(),
            reason: "no cache breakpoint in the messages",
        });
    }
    let block = serde_json::json!({"type": "text", "text": turn});
    let last = match messages.last() {
        Some(raw) => serde_json::from_str::<Value>(raw.get())?,
        None => Value::Null,
    };
    if last["role"] == "user" {
        let mut last = last;
        match last.get_mut("content") {
            Some(Value::Array(blocks)) => blocks.push(block),
            Some(Value::String(text)) => {
                let text = std::mem::take(text);
                last["content"] = serde_json::json!([{"type": "text", "text": text}, block]);
            }
            _ => {
                return Err(DialectError::BadMessage {
                    index: messages.len() - 1,
                    reason: "user message without content",
                })
            }
        }
        messages.pop();
        messages.push(serde_json::value::to_raw_value(&last)?);
    } else {
        messages.push(serde_json::value::to_raw_value(
            &serde_json::json!({"role": "user", "content": [block]}),
        )?);
    }
    let thinking = params
        .get("thinking")
        .filter(|t| t["type"] == "enabled")
        .and_then(|t| t["budget_tokens"].as_u64())
        .unwrap_or(0);
    let asked = thinking.saturating_add(u64::from(max_output));
    params.insert("stream".into(), Value::Bool(false));
    params.insert("max_tokens".into(), asked.into());
    Ok(usize::try_from(asked).unwrap_or(usize::MAX))
}

// ---------------------------------------------------------------------------------------------
// Answers.

/// Anthropic's refusal for length: `prompt is too long: M tokens > N maximum`.
pub(crate) static REFUSAL: RefusalWording = RefusalWording {
    phrases: &["prompt is too long"],
    window_after: &[],
    window_between: Some(("tokens >", "maximum")),
    requested_after: &["prompt is too long:"],
    fields: None,
};

/// Anthropic's `usage`: `input_tokens` excludes both cache counts, so the input is the sum of
/// all three. Without cache fields it reads as Responses' (the same names, the same sum).
pub(crate) fn usage(f: &UsageFields) -> Option<Usage> {
    let cached = f.cache_read_input_tokens.is_some() || f.cache_creation_input_tokens.is_some();
    let counted = f.input_tokens.is_some() || f.output_tokens.is_some();
    (cached && counted).then(|| {
        let read = f.cache_read_input_tokens.unwrap_or(0);
        let write = f.cache_creation_input_tokens.unwrap_or(0);
        Usage {
            input: f
                .input_tokens
                .unwrap_or(0)
                .saturating_add(read)
                .saturating_add(write),
            output: f.output_tokens.unwrap_or(0),
            cache_read: read,
            cache_write: write,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dialect::Parsed;

    fn parse(body: &[u8]) -> Result<Parsed<'_>, DialectError> {
        DialectKind::Messages.parse(body)
    }

    fn scan<'a>(body: &'a [u8], est: &LazyEstimator) -> Result<Scan<'a>, DialectError> {
        DialectKind::Messages.scan(body, est)
    }
    use crate::dialect::json::OrderedObject;
    use crate::estimate::IMAGE_TOKENS;
    use serde_json::json;

    fn est() -> LazyEstimator {
        LazyEstimator::default()
    }

    fn messages_of(body: &[u8]) -> Vec<Value> {
        let v: Value = serde_json::from_slice(body).expect("JSON");
        v["messages"].as_array().cloned().expect("messages")
    }

    #[test]
    fn a_compaction_block_ends_the_head_as_in_the_other_dialects() {
        // A provider's own summary block: kept with everything before it, never summarised.
        let body = json!({"model": "claude-x", "max_tokens": 10, "messages": [
            {"role": "user", "content": "long task"},
            {"role": "assistant", "content": [{"type": "compaction", "content": "what happened"}]},
            {"role": "user", "content": "go on"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "and \"compaction\"?"}
        ]})
        .to_string();
        let r = parse(body.as_bytes()).expect("parses");
        assert_eq!(r.transcript.head_len(), 2);
        assert_eq!(r.scan.head_len(0).expect("head"), 2);
    }

    #[test]
    fn peek_counts_what_the_model_reads() {
        let body = json!({
            "model": "claude-sonnet-4-5",
            "max_tokens": 1024,
            "system": [{"type": "text", "text": "abcd", "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "Read", "input_schema": {"type": "object"}}],
            "metadata": {"user_id": "x".repeat(400)},
            "messages": [
                {"role": "user", "content": "abcdefgh"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "abcd", "signature": "s".repeat(500)},
                    {"type": "text", "text": "ok", "citations": [{"cited_text": "z".repeat(80)}]},
                    {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": false, "content": [
                        {"type": "text", "text": "abcd"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A".repeat(999)}}
                    ]},
                    {"type": "text", "text": "more", "cache_control": {"type": "ephemeral"}}
                ]},
                {"role": "assistant", "content": [
                    {"type": "redacted_thinking", "data": "abcdabcd"},
                    {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "q"}},
                    {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
                        {"type": "web_search_result", "url": "u", "title": "t", "encrypted_content": "e"}
                    ]}
                ]},
                {"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc!"}}]}
            ]
        })
        .to_string();
        let p = scan(body.as_bytes(), &est()).expect("peeks");
        assert_eq!(p.model.as_deref(), Some("claude-sonnet-4-5"));
        assert_eq!(p.requested_output, Some(1024));
        assert_eq!(p.len(), 5);
        let tools = r#"[{"input_schema":{"type":"object"},"name":"Read"}]"#;
        assert_eq!(p.fixed_tokens, 1 + est().text(tools), "system text + tools");
        let input = r#"{"file_path":"a"}"#;
        let expected = p.fixed_tokens
            + 2                                       // "abcdefgh"
            + est().text(&format!("abcdokRead{input}")) // thinking, text, tool name + input
            + est().text("abcdmore") + IMAGE_TOKENS       // tool_result text + image, "more"
            // redacted data, server tool name + input, result url + title + content (a nested
            // node's `type` is not read)
            + est().text(r#"abcdabcdweb_search{"query":"q"}ute"#)
            + est().text("texttext/plaindoc!"); // document source leaves
        let r = parse(body.as_bytes()).expect("parses");
        let per: Vec<usize> = r.transcript.messages.iter().map(|m| m.tokens).collect();
        assert_eq!(p.tokens, expected, "{per:?}");

        assert_eq!(r.scan.tokens, p.tokens, "peek and parse agree");
        assert_eq!(r.scan.fixed_tokens, p.fixed_tokens);
        for m in &r.transcript.messages {
            assert_eq!(
                est().counts(m.counts()),
                m.tokens,
                "parts estimate of {m:?}"
            );
        }
    }

    #[test]
    fn peek_rejects_what_is_not_a_messages_request() {
        for body in [
            &b"nope"[..],
            b"{}",
            br#"{"messages": 5}"#,
            br#"{"messages": [], "messages": []}"#,
            br#"{"messages": [{"role": "tool", "content": "s"}]}"#,
            br#"{"messages": [{"content": "no role"}]}"#,
        ] {
            assert!(
                scan(body, &est()).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let p = scan(
            br#"{"messages":[],"max_tokens":-3,"system":"abcd"}"#,
            &est(),
        )
        .expect("peeks");
        assert_eq!((p.requested_output, p.tokens), (None, 1));
    }

    #[test]
    fn parse_builds_one_message_per_wire_message() {
        let body = json!({"model": "claude-x", "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "plan", "signature": "sig"},
                {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.rs"}},
                {"type": "tool_use", "id": "t2", "name": "Bash", "input": {"command": "ls"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t2", "content": "src", "is_error": true},
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "fn a"}]},
                {"type": "text", "text": "and?"}
            ]},
            {"role": "assistant", "content": "done"}
        ]})
        .to_string();
        let r = parse(body.as_bytes()).expect("parses");
        let t = &r.transcript;
        assert_eq!(t.len(), 4);
        assert_eq!(t.head_len(), 0, "no system role in messages");
        assert_eq!(t.last_user(), Some(0), "tool results are not a user turn");
        assert_eq!(t.pairs(), vec![None, None, Some(1), None]);
        let m = &t.messages;
        assert_eq!(m[1].parts[0], Part::Reasoning("plan".into()));
        assert_eq!(
            m[1].parts[1],
            Part::ToolCall(ToolCall {
                id: Some("t1".into()),
                name: "Read".into(),
                arguments: r#"{"file_path":"a.rs"}"#.into()
            })
        );
        assert!(m[2].is_tool_answer());
        let results: Vec<_> = m[2].tool_results().collect();
        assert_eq!(results[0].name.as_deref(), Some("Bash"), "resolved");
        assert!(results[0].is_error);
        assert_eq!(results[1].content, vec![Part::Text("fn a".into())]);
        assert_eq!(m[2].parts[2], Part::Text("and?".into()));
        assert_eq!(m[3].parts, vec![Part::Text("done".into())]);
        assert!(matches!(
            parse(br#"{"messages":[{"role":"tool","content":"x"}]}"#),
            Err(DialectError::Json(_) | DialectError::BadMessage { .. })
        ));
    }

    #[test]
    fn a_system_turn_in_messages_is_a_system_message() {
        // Claude Code 2.1: CLAUDE.md and the task, its environment as a system turn, then the
        // tool loop.
        let body = json!({"model": "claude-x", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>rules</system-reminder>"},
                                         {"type": "text", "text": "fix it"}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "Bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "b"}]}
        ]})
        .to_string();
        let fast = scan(body.as_bytes(), &est()).expect("scans");
        assert_eq!(fast.messages.len(), 6);
        let r = parse(body.as_bytes()).expect("parses");
        let roles: Vec<Role> = r.transcript.messages.iter().map(|m| m.role).collect();
        use Role::{Assistant, System, User};
        assert_eq!(roles, [User, System, Assistant, User, Assistant, User]);
        assert_eq!(
            r.scan.head_len(1000).expect("head"),
            2,
            "the opening, the system turn included"
        );
        // The opening kept, the summary after the system turn, the tail as sent.
        let m = messages_of(&r.scan.rewrite(2, 4, "S").expect("rewrites"));
        let original = messages_of(body.as_bytes());
        assert_eq!(&m[..2], &original[..2]);
        assert_eq!(m[2], json!({"role": "user", "content": "S"}));
        assert_eq!(&m[3..], &original[4..]);
    }

    const BODY: &str = r#"{"model":"claude-x","system" : [{"type":"text","text":"sys","cache_control":{"type":"ephemeral"}}],
        "messages":[
          {"role":"user","content":"old task"},
          {"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"Bash","input":{"command":"ls"}}]},
          {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"a b"}]},
          {"role":"assistant","content":"listed"},
          {"role":"user","content":"next"},
          {"role":"assistant","content":[{"type":"text","text":"ok"}]},
          {"role": "user", "content": [{"type":"text","text":"last","cache_control":{"type":"ephemeral"}}, {"type":"image","source":{"type":"url","url":"https://x/y.png"}}]}
        ],
        "tools":[ {"name":"Bash","input_schema":{"b":1,"a":2}} ],"tool_choice":{"type":"auto"},
        "thinking":{"type":"enabled","budget_tokens":2000},"metadata":{"user_id":"u"},"x_vendor":[1, {"z":null}],"max_tokens":4096}"#;

    fn fields(body: &[u8]) -> Vec<(String, String)> {
        let o: OrderedObject<'_> = serde_json::from_slice(body).expect("object");
        o.0.iter()
            .map(|(k, v)| (k.clone(), v.get().to_string()))
            .collect()
    }

    #[test]
    fn rewrite_keeps_every_other_field_byte_for_byte() {
        let r = parse(BODY.as_bytes()).expect("parses");
        // Tail starts with an assistant message: the summary stands alone before it.
        let out = r.scan.rewrite(0, 3, "SUMMARY \"q\"").expect("rewrites");
        let (a, b) = (fields(BODY.as_bytes()), fields(&out));
        assert_eq!(a.len(), b.len());
        for ((ka, va), (kb, vb)) in a.iter().zip(&b) {
            assert_eq!(ka, kb, "order");
            if ka != "messages" {
                assert_eq!(va, vb, "{ka} untouched");
            }
        }
        let m = messages_of(&out);
        assert_eq!(m[0], json!({"role": "user", "content": "SUMMARY \"q\""}));
        let original = messages_of(BODY.as_bytes());
        assert_eq!(&m[1..], &original[3..]);
        // The tail's raw bytes are the client's.
        let text = String::from_utf8(out).expect("utf8");
        assert!(text.contains(r#"{"role": "user", "content": [{"type":"text","text":"last","cache_control":{"type":"ephemeral"}}, {"type":"image","source":{"type":"url","url":"https://x/y.png"}}]}"#));
    }

    #[test]
    fn a_user_tail_start_takes_the_summary_as_its_first_block() {
        let r = parse(BODY.as_bytes()).expect("parses");
        let original = messages_of(BODY.as_bytes());
        // String content: two text blocks.
        let m = messages_of(&r.scan.rewrite(0, 4, "S").expect("rewrites"));
        assert_eq!(
            m[0],
            json!({"role": "user", "content": [{"type": "text", "text": "S"}, {"type": "text", "text": "next"}]})
        );
        assert_eq!(&m[1..], &original[5..]);
        // Block content: the summary block first, the original blocks verbatim after it.
        let out = r.scan.rewrite(0, 6, "S").expect("rewrites");
        let m = messages_of(&out);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0]["content"][0], json!({"type": "text", "text": "S"}));
        let blocks = m[0]["content"].as_array().expect("blocks");
        assert_eq!(
            blocks[1..],
            original[6]["content"].as_array().expect("blocks")[..]
        );
        let text = String::from_utf8(out).expect("utf8");
        assert!(text.contains(r#"{"role":"user","content":[{"type":"text","text":"S"},{"type":"text","text":"last","cache_control":{"type":"ephemeral"}},{"type":"image","source":{"type":"url","url":"https://x/y.png"}}]}"#), "{text}");
        // Roles alternate in every case.
        for b in 1..=6 {
            let Ok(out) = r.scan.rewrite(0, b, "S") else {
                continue;
            };
            let roles: Vec<Value> = messages_of(&out)
                .iter()
                .map(|m| m["role"].clone())
                .collect();
            for (i, role) in roles.iter().enumerate() {
                assert_eq!(role, if i % 2 == 0 { "user" } else { "assistant" }, "b={b}");
            }
        }
    }

    #[test]
    fn a_head_ending_on_the_opening_takes_the_summary_after_its_blocks() {
        let r = parse(BODY.as_bytes()).expect("parses");
        let original = messages_of(BODY.as_bytes());
        // The opening (a string) kept: its text, then the summary, in one user message.
        let out = r.scan.rewrite(1, 3, "S").expect("rewrites");
        let m = messages_of(&out);
        assert_eq!(
            m[0],
            json!({"role": "user", "content": [{"type": "text", "text": "old task"}, {"type": "text", "text": "S"}]})
        );
        assert_eq!(&m[1..], &original[3..]);
        // A user tail start too: the opening, the summary, the tail's first blocks verbatim.
        let out = r.scan.rewrite(1, 6, "S").expect("rewrites");
        let text = String::from_utf8(out.clone()).expect("utf8");
        assert!(text.contains(r#"{"role":"user","content":[{"type":"text","text":"old task"},{"type":"text","text":"S"},{"type":"text","text":"last","cache_control":{"type":"ephemeral"}},{"type":"image","source":{"type":"url","url":"https://x/y.png"}}]}"#), "{text}");
        assert_eq!(messages_of(&out).len(), 1);
        // Block content in the head is copied byte for byte before the summary.
        let body = json!({"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>CLAUDE.md: RULE-PURPLE</system-reminder>"},
                {"type": "text", "text": "fix it", "cache_control": {"type": "ephemeral"}}
            ]},
            {"role": "assistant", "content": "looking"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "done"}
        ]})
        .to_string();
        let r = parse(body.as_bytes()).expect("parses");
        let out = r.scan.rewrite(1, 3, "S").expect("rewrites");
        let text = String::from_utf8(out).expect("utf8");
        assert!(text.contains(r#"[{"text":"<system-reminder>CLAUDE.md: RULE-PURPLE</system-reminder>","type":"text"},{"cache_control":{"type":"ephemeral"},"text":"fix it","type":"text"},{"type":"text","text":"S"}]"#), "{text}");
        // Roles alternate in every case.
        let r = parse(BODY.as_bytes()).expect("parses");
        for b in 1..=6 {
            let Ok(out) = r.scan.rewrite(1, b, "S") else {
                continue;
            };
            let roles: Vec<Value> = messages_of(&out)
                .iter()
                .map(|m| m["role"].clone())
                .collect();
            for (i, role) in roles.iter().enumerate() {
                assert_eq!(role, if i % 2 == 0 { "user" } else { "assistant" }, "b={b}");
            }
        }
    }

    #[test]
    fn a_tail_opening_with_tool_results_or_out_of_range_is_refused() {
        let r = parse(BODY.as_bytes()).expect("parses");
        assert!(matches!(
            r.scan.rewrite(0, 2, "S"),
            Err(DialectError::TailStartsWithToolResult)
        ));
        assert!(matches!(
            r.scan.rewrite(0, 8, "S"),
            Err(DialectError::BadPlan { .. })
        ));
        assert!(matches!(
            r.scan.rewrite(2, 1, "S"),
            Err(DialectError::BadPlan { .. })
        ));
        let all = messages_of(&r.scan.rewrite(0, 7, "S").expect("empty tail"));
        assert_eq!(all, vec![json!({"role": "user", "content": "S"})]);
    }
}
