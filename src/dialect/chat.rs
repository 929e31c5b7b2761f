//! OpenAI Chat Completions (`POST …/chat/completions`): scan, neutral messages and rewrite.
//!
//! - [`scan`] runs on every request: one pass that splits `messages` into raw slices of the
//!   body and counts what the model reads of each (text, tool calls and arguments, reasoning,
//!   refusals, tool outputs, images) plus the tool definitions, without building a `Value` or
//!   copying a string. The no-compaction path ends here and the proxy forwards the original
//!   bytes.
//! - `message` builds one neutral message, only when a compaction is due or a stored summary
//!   is spliced in (`system`/`developer`, `user`, `assistant` with `tool_calls`, legacy
//!   `function_call`, `tool` and legacy `function` results, `reasoning_content`/`reasoning`,
//!   content strings or part arrays of `text`, `image_url`, `refusal` and opaque parts).
//! - `rewrite` replaces the compacted messages by one `user` message holding the summary and
//!   copies every other byte of the body as received.

use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::answer::{RefusalWording, Usage, UsageFields};
use super::json::{
    as_tokens, fast_object, fast_skip, fast_text, leaf_weight, skip_scalars, OneOf, Piece,
    StrWeightVisitor, TextWeight,
};
use super::outputs::{fields_of, holds, replaceable, string, MarksFound, WireOutput, MARKERS};
use super::scan_memo::{read_conversation, Remembering};
use super::split::{decode, field, object_fields, present, value};
use super::{DialectError, DialectKind, Scan, ScanFields};
use crate::estimate::{
    json_literal_weight, json_string_weight, text_weight, Counts, LazyEstimator,
};
use crate::transcript::{Message, Part, Role, ToolCall};

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
            read_conversation::<MessageStats>(DialectKind::ChatCompletions, rest, fast, memo)?;
        conversation = read;
        Ok(len)
    })?;
    field(&fields, "messages")?;
    let (messages, stats, marks) = conversation.ok_or(DialectError::NoConversation("messages"))?;
    let tokens = stats.into_iter().map(|s| estimator.counts(s)).collect();
    let max_completion: Option<Value> = decode(&fields, "max_completion_tokens")?;
    let max_tokens: Option<Value> = decode(&fields, "max_tokens")?;
    let mut fixed_tokens = 0usize;
    for name in ["tools", "functions"] {
        if let Some(raw) = present(&fields, name)? {
            fixed_tokens = fixed_tokens.saturating_add(estimator.text(raw));
        }
    }
    let fields = ScanFields {
        model: decode(&fields, "model")?,
        requested_output: as_tokens(max_completion.as_ref())
            .or_else(|| as_tokens(max_tokens.as_ref())),
        fixed_tokens,
        input_is_string: false,
    };
    Ok(Scan::new(
        DialectKind::ChatCompletions,
        body.as_bytes(),
        messages,
        tokens,
        marks,
        fields,
    ))
}

/// One wire message in neutral form.
pub(super) fn message(raw: &str, index: usize) -> Result<Message, DialectError> {
    let v: Value = serde_json::from_str(raw)?;
    message_from_value(&v, index)
}

#[derive(Serialize)]
struct SummaryWire<'a> {
    role: &'static str,
    content: &'a str,
}

/// `messages[head..boundary]` replaced by one `user` message holding `summary_message`.
pub(super) fn rewrite(
    scan: &Scan<'_>,
    head: usize,
    boundary: usize,
    summary_message: &str,
) -> Result<Vec<u8>, DialectError> {
    scan.splice(head, boundary, false, summary_message.len(), |out| {
        serde_json::to_writer(
            out,
            &SummaryWire {
                role: "user",
                content: summary_message,
            },
        )
    })
}

// ---------------------------------------------------------------------------------------------
// Transcript building (compaction path).

fn message_from_value(v: &Value, index: usize) -> Result<Message, DialectError> {
    let bad = |reason| DialectError::BadMessage { index, reason };
    let obj = v.as_object().ok_or(bad("not an object"))?;
    let role = match obj.get("role").and_then(Value::as_str) {
        Some("system") | Some("developer") => Role::System,
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some("tool") | Some("function") => Role::Tool,
        Some(_) => return Err(bad("unknown role")),
        None => return Err(bad("no role")),
    };
    let mut parts = Vec::new();
    for key in ["reasoning_content", "reasoning"] {
        match obj.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => parts.push(Part::Reasoning(s.clone())),
            Some(other) => parts.push(Part::Opaque {
                kind: key.into(),
                weight: leaf_weight(other),
            }),
        }
    }
    match obj.get("content") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => parts.push(Part::Text(s.clone())),
        Some(Value::Array(items)) => parts.extend(items.iter().map(part_from_value)),
        Some(other) => parts.push(Part::Opaque {
            kind: "content".into(),
            weight: leaf_weight(other),
        }),
    }
    match obj.get("refusal") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => parts.push(Part::Text(s.clone())),
        Some(other) => parts.push(Part::Opaque {
            kind: "refusal".into(),
            weight: leaf_weight(other),
        }),
    }
    if let Some(calls) = obj.get("tool_calls").and_then(Value::as_array) {
        for call in calls {
            let id = call.get("id").and_then(Value::as_str).map(str::to_string);
            let (name, arguments) = if let Some(f) = call.get("function") {
                (f.get("name"), f.get("arguments"))
            } else if let Some(c) = call.get("custom") {
                (c.get("name"), c.get("input"))
            } else {
                (None, None)
            };
            parts.push(Part::ToolCall(ToolCall {
                id,
                name: name.and_then(Value::as_str).unwrap_or("").to_string(),
                arguments: arguments.map(json_text).unwrap_or_default(),
            }));
        }
    }
    if let Some(f) = obj.get("function_call").filter(|f| f.is_object()) {
        parts.push(Part::ToolCall(ToolCall {
            id: None,
            name: f
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            arguments: f.get("arguments").map(json_text).unwrap_or_default(),
        }));
    }
    let mut message = Message::new(role, parts);
    if role == Role::Tool {
        message.tool_call_id = obj
            .get("tool_call_id")
            .and_then(Value::as_str)
            .map(str::to_string);
        message.tool_name = obj.get("name").and_then(Value::as_str).map(str::to_string);
    }
    Ok(message)
}

fn json_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Part `type`s that carry an image.
const IMAGE_TYPES: &[&str] = &["image_url", "image", "input_image"];

fn is_image_type(kind: &str) -> bool {
    IMAGE_TYPES.contains(&kind)
}

fn part_from_value(part: &Value) -> Part {
    let Some(obj) = part.as_object() else {
        return match part {
            Value::String(s) => Part::Text(s.clone()),
            other => Part::Opaque {
                kind: "unknown".into(),
                weight: leaf_weight(other),
            },
        };
    };
    let kind = obj.get("type").and_then(Value::as_str);
    let text = |key: &str| obj.get(key).and_then(Value::as_str).map(str::to_string);
    match kind {
        Some(k) if is_image_type(k) => Part::Image,
        None if obj.contains_key("image_url") => Part::Image,
        Some("text") | None if text("text").is_some() => {
            Part::Text(text("text").unwrap_or_default())
        }
        Some("refusal") if text("refusal").is_some() => {
            Part::Text(text("refusal").unwrap_or_default())
        }
        _ => Part::Opaque {
            kind: kind.unwrap_or("unknown").to_string(),
            weight: obj
                .iter()
                .filter(|(k, _)| !matches!(k.as_str(), "type" | "cache_control" | "image_url"))
                .map(|(_, v)| leaf_weight(v))
                .sum(),
        },
    }
}

// ---------------------------------------------------------------------------------------------
// Tool outputs (for masking; see `outputs`).

/// Chat Completions: a `tool` (or legacy `function`) message is one output, its `content`.
pub(super) fn outputs(raw: &str, index: usize) -> Result<Vec<WireOutput<'_>>, DialectError> {
    if !holds(raw, &MARKERS.tool) && !holds(raw, &MARKERS.function) {
        return Ok(Vec::new());
    }
    let fields = fields_of(raw)?;
    let role: Option<String> = decode(&fields, "role")?;
    if !matches!(role.as_deref(), Some("tool" | "function")) {
        return Ok(Vec::new());
    }
    Ok(vec![WireOutput {
        message: index,
        call_id: decode::<Value>(&fields, "tool_call_id")?.and_then(string),
        name: decode::<Value>(&fields, "name")?.and_then(string),
        value: replaceable(present(&fields, "content")?),
    }])
}

// ---------------------------------------------------------------------------------------------
// Recognising a body.

/// Whether a request body is Chat Completions: a `messages` array that is not Anthropic's
/// (no top-level `system`, no `tool_use` or `tool_result` block).
pub(crate) fn looks_like(request: &Map<String, Value>) -> bool {
    matches!(request.get("messages"), Some(Value::Array(_)))
        && !super::messages::looks_like(request)
}

// ---------------------------------------------------------------------------------------------
// The summary asked inside the conversation.

/// Turns `body` (a request as the provider received it) into one asking the same model for
/// the summary: `turn` appended as a user message, no streaming, `max_output` tokens under the
/// budget name the agent used (`max_tokens` unless it sent `max_completion_tokens`), tools
/// kept (they are part of the cached prefix) but not callable, and nothing asked that is not
/// one plain text answer. The output tokens asked.
pub(crate) fn ask_for_summary(
    params: &mut Map<String, Value>,
    messages: &mut Vec<Box<RawValue>>,
    turn: &str,
    max_output: u32,
) -> Result<usize, DialectError> {
    messages.push(serde_json::value::to_raw_value(
        &serde_json::json!({"role": "user", "content": turn}),
    )?);
    for key in [
        "stream_options",
        "n",
        "response_format",
        "logprobs",
        "top_logprobs",
        "audio",
        "modalities",
        "prediction",
    ] {
        params.remove(key);
    }
    params.insert("stream".into(), Value::Bool(false));
    let budget = if params.contains_key("max_completion_tokens") {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    params.remove("max_tokens");
    params.insert(budget.into(), max_output.into());
    if params
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty())
    {
        params.insert("tool_choice".into(), "none".into());
    }
    if params.contains_key("functions") {
        params.insert("function_call".into(), "none".into());
    }
    Ok(max_output as usize)
}

// ---------------------------------------------------------------------------------------------
// Order-preserving top level.

/// The top-level fields of a JSON object in order, values raw (for tests that compare
/// requests field by field).
#[cfg(test)]
pub(crate) fn top_level_fields(
    body: &[u8],
) -> Result<Vec<(String, &serde_json::value::RawValue)>, DialectError> {
    let super::json::OrderedObject(fields) = serde_json::from_slice(body)?;
    Ok(fields)
}

// ---------------------------------------------------------------------------------------------
// Zero-copy counting (hot path). Every visitor weighs strings as serde_json hands them over
// (borrowed, or from its scratch buffer when unescaping) and allocates nothing.

/// What the model reads of one message.
struct MessageStats(Counts);

impl From<MessageStats> for Counts {
    fn from(stats: MessageStats) -> Counts {
        stats.0
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum MessageField {
    Content,
    ToolCalls,
    FunctionCall,
    ReasoningContent,
    Reasoning,
    Refusal,
    #[serde(other)]
    Other,
}

impl<'de> Deserialize<'de> for MessageStats {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MessageStats;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a message object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut counts = Counts::default();
                while let Some(field) = map.next_key::<MessageField>()? {
                    match field {
                        MessageField::Content => counts.add(map.next_value::<ContentCounts>()?.0),
                        MessageField::ToolCalls => {
                            counts.text += map.next_value::<ToolCallsWeight>()?.0
                        }
                        MessageField::FunctionCall
                        | MessageField::ReasoningContent
                        | MessageField::Reasoning
                        | MessageField::Refusal => counts.text += map.next_value::<TextWeight>()?.0,
                        MessageField::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(MessageStats(counts))
            }
        }
        d.deserialize_map(V)
    }
}

/// [`MessageStats`] of the message at the start of `text` and the bytes it takes, read by hand
/// when its shape is the common one, so a string `content` (tool output, the bulk of a chat
/// body) is found and weighed in one pass ([`json_literal_weight`]) rather than skipped by
/// serde and then weighed. Other values are read by serde one by one, as [`MessageStats`]
/// reads them. `None` (serde reads the whole message, and answers any error) for anything
/// else: a key with an escape, `tool_calls` (serde bounds how deep the calls nest counting
/// from the message, which a value read on its own would not), a `content` literal with a
/// `\u` escape, anything malformed. Its output marks are found member by member on the way
/// ([`MarksFound`]), the text of a `content` literal not read again.
fn fast_message(text: &str) -> Option<(MessageStats, usize, u32)> {
    let mut counts = Counts::default();
    let mut found = MarksFound::new(DialectKind::ChatCompletions);
    let len = fast_object(text, |key, rest| {
        let len = match key {
            "content" if rest.starts_with('"') => {
                let (len, text) = json_literal_weight(rest.as_bytes())?;
                counts.add(Counts { text, images: 0 });
                len
            }
            "content" => {
                let (content, len) = value::<ContentCounts>(rest)?;
                counts.add(content.0);
                len
            }
            "tool_calls" => return None,
            "function_call" | "reasoning_content" | "reasoning" | "refusal" => {
                let (weight, len) = fast_text(rest)?;
                counts.text += weight;
                len
            }
            _ => fast_skip(rest)?,
        };
        found.see(Piece::Key(key));
        found.see(Piece::Value(rest.get(..len)?));
        Some(len)
    })?;
    Some((MessageStats(counts), len, found.marks))
}

/// `tool_calls`: the string leaves of each call's `function` (name, arguments) or `custom`
/// (name, input) object; ids and types are not read by the model as text.
struct ToolCallsWeight(usize);

impl<'de> Deserialize<'de> for ToolCallsWeight {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = usize;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of tool calls")
            }
            fn visit_unit<E: de::Error>(self) -> Result<usize, E> {
                Ok(0)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
                let mut n = 0usize;
                while let Some(ToolCallWeight(c)) = seq.next_element()? {
                    n = n.saturating_add(c);
                }
                Ok(n)
            }
        }
        d.deserialize_any(V).map(ToolCallsWeight)
    }
}

struct ToolCallWeight(usize);

impl<'de> Deserialize<'de> for ToolCallWeight {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = usize;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a tool call object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
                let mut n = 0usize;
                while let Some(key) = map.next_key::<CallField>()? {
                    match key {
                        CallField::Function | CallField::Custom => {
                            n = n.saturating_add(map.next_value::<CallWeight>()?.0)
                        }
                        CallField::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(n)
            }
        }
        d.deserialize_map(V).map(ToolCallWeight)
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum CallField {
    Function,
    Custom,
    #[serde(other)]
    Other,
}

/// A call's `function` (or `custom`) object: the weight of its values (`name`, and
/// `arguments`, a JSON string full of escaped quotes, weighed in place: [`TextWeight`]).
struct CallWeight(usize);

impl<'de> Deserialize<'de> for CallWeight {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = usize;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a function object")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<usize, E> {
                Ok(text_weight(v))
            }
            skip_scalars!(usize, 0);
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<usize, A::Error> {
                StrWeightVisitor.visit_seq(seq)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
                let mut n = 0usize;
                while map.next_key::<IgnoredAny>()?.is_some() {
                    n = n.saturating_add(map.next_value::<TextWeight>()?.0);
                }
                Ok(n)
            }
        }
        d.deserialize_any(V).map(CallWeight)
    }
}

/// `content`: a string (weighed in place, as [`TextWeight`] does), null, or an array of
/// parts.
struct ContentCounts(Counts);

impl<'de> Deserialize<'de> for ContentCounts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw: &'de RawValue = Deserialize::deserialize(d)?;
        let raw = raw.get();
        if let Some(text) = json_string_weight(raw) {
            return Ok(ContentCounts(Counts { text, images: 0 }));
        }
        content_counts(&mut serde_json::Deserializer::from_str(raw))
            .map(ContentCounts)
            .map_err(de::Error::custom)
    }
}

/// [`ContentCounts`] of content read as serde hands it over (an array of parts, or a string
/// with `\u` escapes, decoded).
fn content_counts<'de, D: Deserializer<'de>>(d: D) -> Result<Counts, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Counts;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("message content")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Counts, E> {
            Ok(Counts {
                text: text_weight(v),
                images: 0,
            })
        }
        skip_scalars!(Counts, Counts::default());
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Counts, A::Error> {
            let mut counts = Counts::default();
            while let Some(PartCounts(c)) = seq.next_element()? {
                counts.add(c);
            }
            Ok(counts)
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Counts, A::Error> {
            let weight = StrWeightVisitor.visit_map(map)?;
            Ok(Counts::text(weight))
        }
    }
    d.deserialize_any(V)
}

/// One content part: an image costs a fixed amount; anything else, the weight of its
/// string fields other than `type` and `cache_control`.
struct PartCounts(Counts);

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum PartField {
    Type,
    ImageUrl,
    CacheControl,
    #[serde(other)]
    Other,
}

impl<'de> Deserialize<'de> for PartCounts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Counts;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a content part")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Counts, E> {
                Ok(Counts {
                    text: text_weight(v),
                    images: 0,
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Counts, A::Error> {
                let mut typed: Option<bool> = None;
                let mut has_image_url = false;
                let mut weight = 0usize;
                while let Some(key) = map.next_key::<PartField>()? {
                    match key {
                        PartField::Type => typed = Some(map.next_value_seed(OneOf(IMAGE_TYPES))?),
                        PartField::ImageUrl => {
                            has_image_url = true;
                            map.next_value::<IgnoredAny>()?;
                        }
                        PartField::CacheControl => {
                            map.next_value::<IgnoredAny>()?;
                        }
                        PartField::Other => {
                            weight = weight.saturating_add(map.next_value::<TextWeight>()?.0)
                        }
                    }
                }
                let image = typed.unwrap_or(has_image_url);
                Ok(if image {
                    Counts { text: 0, images: 1 }
                } else {
                    Counts::text(weight)
                })
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Counts, A::Error> {
                let weight = StrWeightVisitor.visit_seq(seq)?;
                Ok(Counts::text(weight))
            }
            skip_scalars!(Counts, Counts::default());
        }
        d.deserialize_any(V).map(PartCounts)
    }
}

// ---------------------------------------------------------------------------------------------
// Answers.

/// OpenAI's refusal for length, and the wordings of the servers that speak its API (vLLM,
/// llama.cpp, Ollama, OpenRouter); see src/overflow.rs.
pub(crate) static REFUSAL: RefusalWording = RefusalWording {
    phrases: &[
        "context_length_exceeded",
        "maximum context length",
        "exceeds the available context size",
        "exceed_context_size_error",
        "input length exceeds the context length",
    ],
    window_after: &["maximum context length is", "available context size ("],
    window_between: None,
    requested_after: &[
        "you requested about",
        "you requested",
        "your request has",
        "resulted in",
        "request (",
    ],
    fields: Some(("n_ctx", "n_prompt_tokens")),
};

/// Chat Completions' `usage`: `prompt_tokens` includes the cached ones
/// (`prompt_tokens_details.cached_tokens`); no cache writes.
pub(crate) fn usage(f: &UsageFields) -> Option<Usage> {
    (f.prompt_tokens.is_some() || f.completion_tokens.is_some()).then(|| Usage {
        input: f.prompt_tokens.unwrap_or(0),
        output: f.completion_tokens.unwrap_or(0),
        cache_read: f.cached_tokens.unwrap_or(0),
        cache_write: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dialect::Parsed;

    fn parse(body: &[u8]) -> Result<Parsed<'_>, DialectError> {
        DialectKind::ChatCompletions.parse(body)
    }

    fn scan<'a>(body: &'a [u8], est: &LazyEstimator) -> Result<Scan<'a>, DialectError> {
        DialectKind::ChatCompletions.scan(body, est)
    }
    use crate::estimate::IMAGE_TOKENS;
    use serde_json::json;

    fn est() -> LazyEstimator {
        LazyEstimator::default()
    }

    #[test]
    fn peek_counts_everything_the_model_reads() {
        let body = json!({
            "model": "gpt-4o",
            "max_tokens": 100,
            "max_completion_tokens": 200,
            "metadata": {"ignored": "x".repeat(1000)},
            "tools": [{"type": "function", "function": {"name": "bash"}}],
            "messages": [
                {"role": "system", "content": "abcd"},
                {"role": "user", "content": [
                    {"type": "text", "text": "abcdefgh", "cache_control": {"type": "ephemeral"}},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "high"}}
                ]},
                {"role": "assistant", "content": null, "reasoning_content": "abcd",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "bash", "arguments": "{\"c\":\"ls\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "日本語日"},
                {"role": "assistant", "content": "", "refusal": "no!"}
            ]
        })
        .to_string();
        let p = scan(body.as_bytes(), &est()).expect("peeks");
        assert_eq!(p.model.as_deref(), Some("gpt-4o"));
        assert_eq!(p.requested_output, Some(200), "max_completion_tokens wins");
        assert_eq!(p.len(), 5);
        let tools = r#"[{"type":"function","function":{"name":"bash"}}]"#;
        assert_eq!(p.fixed_tokens, est().text(tools));
        let expected = p.fixed_tokens
            + est().text("abcd")
            + est().text("abcdefgh") + IMAGE_TOKENS
            + est().text(r#"abcdbash{"c":"ls"}"#) // reasoning, tool name and arguments
            + est().text("日本語日")
            + est().text("no!"); // "" + "no!"
                                 // By class: 4 letters; 8 letters; 11 letters and 7 symbols (5.21 tokens); 4 CJK
                                 // characters (2.88); 2 letters and a symbol.
        assert_eq!(expected - p.fixed_tokens, 1 + 2 + IMAGE_TOKENS + 6 + 3 + 1);
        assert_eq!(p.tokens, expected);
    }

    /// The hand-read common shape counts what serde counts and takes the same bytes; what it
    /// leaves to serde, it leaves whole.
    #[test]
    fn the_fast_path_reads_messages_as_serde_does() {
        let output = "fn main() { println!(\"{}\", x); } // é 日\n\tpath\\to\n".repeat(60);
        let tool = json!({"role": "tool", "tool_call_id": "c1", "content": output}).to_string();
        let user = json!({"role": "user", "content": "é".repeat(300)}).to_string();
        for message in [
            tool.as_str(),
            user.as_str(),
            r#"{"role":"tool","content":"line\n\"q\" / \/ \\ end"}"#,
            r#"{ "role" : "user" ,"content" : [ {"type":"text","text":"hi"},{"type":"image_url","image_url":{}} ] }"#,
            r#"{"role":"assistant","content":null,"reasoning_content":"why","refusal":"no",
                "function_call":{"name":"f","arguments":"{\"a\":1}"},"x":[1,{"a":true}],"n":-1.5e3}"#,
            r#"{"role":"assistant","reasoning":{"summary":"abcd"},"content":"\u00e9t\u00e9"}"#,
            r#"{"content":"a","content":"b"}"#,
            "{}",
        ] {
            let expected: MessageStats = serde_json::from_str(message).expect("serde reads it");
            for after in ["", ",{\"role\":\"user\"}]"] {
                let text = format!("{message}{after}");
                match fast_message(&text) {
                    Some((stats, len, marks)) => {
                        assert_eq!(stats.0, expected.0, "{message}");
                        assert_eq!(len, message.len(), "{message}");
                        assert_eq!(marks, all_marks(message), "{message}");
                    }
                    // A `\u` in `content`: left to serde, which decodes it.
                    None => assert!(message.contains("\\u00e9"), "{message}"),
                }
            }
        }
        for left in [
            r#"{"role":"assistant","tool_calls":[]}"#,
            r#"{"con\u0074ent":"x"}"#,
            "{\"content\":\"a\u{1}b\"}",
            r#"{"content":"a\qb"}"#,
            r#"{"content":"a""#,
            r#"{"content":tru}"#,
            r#"{"content":"a",}"#,
            r#"{"content":"a" "role":"user"}"#,
            r#"["content"]"#,
        ] {
            assert!(fast_message(left).is_none(), "{left}");
        }
    }

    /// The marks a substring search of the whole message finds.
    fn all_marks(message: &str) -> u32 {
        crate::dialect::outputs::marks(DialectKind::ChatCompletions, message)
    }

    proptest::proptest! {
        /// Breaks if the marks the fast reader finds member by member differ from those a
        /// search of the whole message finds.
        #[test]
        fn marks_found_member_by_member_are_the_whole_message_s(
            members in proptest::collection::vec(
                (
                    "role|content|name|user|tool|x",
                    proptest::collection::vec(
                        "user|tool|function|compaction|\"|\\\\|\n|[a-z ]{0,4}",
                        0..6,
                    ),
                    0..3u8,
                ),
                0..5,
            ),
        ) {
            let mut object = serde_json::Map::new();
            for (key, pieces, shape) in members {
                let text = pieces.concat();
                let value = match shape {
                    0 => json!(text),
                    1 => json!([{"type": "text", "text": text}]),
                    _ => json!({"nested": text, "role": "user"}),
                };
                object.insert(key, value);
            }
            let message = serde_json::Value::Object(object).to_string();
            if let Some((_, len, marks)) = fast_message(&message) {
                proptest::prop_assert_eq!(len, message.len());
                proptest::prop_assert_eq!(marks, all_marks(&message), "{}", message);
            }
        }
    }

    #[test]
    fn peek_falls_back_to_max_tokens_and_ignores_nonsense() {
        let p = scan(br#"{"messages":[],"max_tokens":50}"#, &est()).expect("peeks");
        assert_eq!(p.requested_output, Some(50));
        let p = scan(
            br#"{"messages":[],"max_tokens":-5,"max_completion_tokens":null}"#,
            &est(),
        )
        .expect("peeks");
        assert_eq!(p.requested_output, None);
        assert_eq!(p.tokens, 0);
    }

    #[test]
    fn peek_rejects_what_is_not_a_chat_request() {
        assert!(matches!(
            scan(b"{}", &est()),
            Err(DialectError::NoConversation("messages"))
        ));
        assert!(scan(b"nope", &est()).is_err());
        assert!(scan(br#"{"messages": 5}"#, &est()).is_err());
        assert!(scan(br#"{"messages": [], "messages": []}"#, &est()).is_err());
        assert!(scan(br#"{"messages": ["hi"]}"#, &est()).is_err());
    }

    #[test]
    fn odd_but_valid_shapes_are_counted_not_rejected() {
        let body = json!({"messages": [
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "abcd", "format": "wav"}}]},
            {"role": "assistant", "content": "x", "reasoning": {"summary": "abcd"},
             "tool_calls": [{"id": "c", "type": "custom", "custom": {"name": "ed", "input": "ab"}}]},
            {"role": "user", "content": [{"image_url": {"url": "data:..."}}, "loose text"]},
            {"role": "assistant", "function_call": {"name": "get", "arguments": {"a": "bc"}}},
            {"role": "function", "name": "get", "content": "sunny"}
        ]})
        .to_string();
        let p = scan(body.as_bytes(), &est()).expect("peeks");
        let r = parse(body.as_bytes()).expect("parses");
        assert_eq!(p.tokens, r.scan.tokens, "peek and parse agree");
        let m = &r.transcript.messages;
        let weight = text_weight("abcdwav");
        assert!(
            matches!(&m[0].parts[0], Part::Opaque { kind, weight: w } if kind == "input_audio" && *w == weight)
        );
        let weight = text_weight("abcd");
        assert!(
            matches!(&m[1].parts[0], Part::Opaque { kind, weight: w } if kind == "reasoning" && *w == weight)
        );
        assert!(
            matches!(&m[1].parts[2], Part::ToolCall(c) if c.name == "ed" && c.arguments == "ab")
        );
        assert_eq!(
            m[2].parts,
            vec![Part::Image, Part::Text("loose text".into())]
        );
        assert!(
            matches!(&m[3].parts[0], Part::ToolCall(c) if c.id.is_none() && c.arguments == r#"{"a":"bc"}"#)
        );
        assert_eq!(m[4].role, Role::Tool);
        assert_eq!(m[4].tool_name.as_deref(), Some("get"));
        assert_eq!(r.transcript.pairs()[4], Some(3));
    }

    #[test]
    fn parse_builds_the_transcript() {
        let body = json!({"model": "m", "messages": [
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "ok", "reasoning_content": "hmm",
             "tool_calls": [{"id": "a", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "data"}]}
        ]})
        .to_string();
        let r = parse(body.as_bytes()).expect("parses");
        let m = &r.transcript.messages;
        assert_eq!(r.scan.model.as_deref(), Some("m"));
        assert_eq!(m.len(), 4);
        assert_eq!(m[0].role, Role::System);
        assert_eq!(r.transcript.head_len(), 1);
        assert_eq!(
            m[2].parts,
            vec![
                Part::Reasoning("hmm".into()),
                Part::Text("ok".into()),
                Part::ToolCall(ToolCall {
                    id: Some("a".into()),
                    name: "read".into(),
                    arguments: "{}".into()
                })
            ]
        );
        assert_eq!(m[3].tool_call_id.as_deref(), Some("a"));
        assert_eq!(
            m[3].tool_name.as_deref(),
            Some("read"),
            "resolved from the call"
        );
        assert_eq!(m[3].text(), "data");
        let p = scan(body.as_bytes(), &est()).expect("peeks");
        assert_eq!(p.tokens, r.scan.tokens);
    }

    #[test]
    fn parse_rejects_unknown_roles_and_duplicate_messages() {
        let body = br#"{"messages":[{"role":"narrator","content":"x"}]}"#;
        assert!(matches!(
            parse(body),
            Err(DialectError::BadMessage { index: 0, .. })
        ));
        assert!(matches!(
            parse(br#"{"messages":[{"content":"x"}]}"#),
            Err(DialectError::BadMessage { .. })
        ));
        assert!(parse(br#"{"messages":[],"messages":[]}"#).is_err());
        assert!(matches!(
            parse(br#"{"model":"x"}"#),
            Err(DialectError::NoConversation("messages"))
        ));
    }

    #[test]
    fn rewrite_keeps_everything_it_does_not_interpret() {
        // Odd spacing inside values, vendor fields, escaped key, message-level extras.
        let body = r#"{"stream" : true,"model":"gpt-4o","messages":[
            {"role":"system","content":"sys","name":"x-sys"},
            {"role":"user","content":"old"},
            {"role":"assistant","content":"old reply","refusal":null},
            {"role": "user",  "content": [{"type":"text","text":"new","cache_control":{"type":"ephemeral"}}], "x_vendor": [1, 2]}
        ],"tools":[ {"type":"function","function":{"name":"t","parameters":{"b":1,"a":2}}} ],
        "response_format":{"type":"json_object"},"weird\"key":{"z":1,"a":[ ]},"stream_options":{"include_usage":true}}"#;
        let r = parse(body.as_bytes()).expect("parses");
        let out = r
            .scan
            .rewrite(1, 3, "SUMMARY \"quoted\"")
            .expect("rewrites");
        let out = String::from_utf8(out).expect("utf8");
        assert_eq!(
            out,
            body.replace(
                r#"{"role":"user","content":"old"},
            {"role":"assistant","content":"old reply","refusal":null},
            "#,
                r#"{"role":"user","content":"SUMMARY \"quoted\""},"#
            ),
            "every byte but the replaced messages', whitespace included"
        );
        let v: Value = serde_json::from_str(&out).expect("valid JSON");
        assert_eq!(v["messages"].as_array().map(Vec::len), Some(3));
    }

    #[test]
    fn rewrite_rejects_plans_out_of_range() {
        let r = parse(br#"{"messages":[{"role":"user","content":"a"}]}"#).expect("parses");
        assert!(matches!(
            r.scan.rewrite(0, 2, "s"),
            Err(DialectError::BadPlan { .. })
        ));
        assert!(matches!(
            r.scan.rewrite(1, 0, "s"),
            Err(DialectError::BadPlan { .. })
        ));
        assert!(r.scan.rewrite(0, 1, "s").is_ok());
    }
}
