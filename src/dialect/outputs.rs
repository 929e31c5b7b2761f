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

use std::ops::Range;

use serde::de::IgnoredAny;
use serde_json::Value;

use super::split::{decode, field, object_fields, present, read_array, value_len, Field};
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

/// How far back from an output [`Scan::call_name`] looks for the call it answers.
const CALL_SEARCH_MESSAGES: usize = 64;

/// Part `type`s that carry an image, in any dialect's tool output.
const IMAGE_TYPES: &[&str] = &["image", "image_url", "input_image", "computer_screenshot"];

impl<'a> Scan<'a> {
    /// The tool outputs message `index` holds, in order (Anthropic: one per `tool_result`
    /// block; otherwise at most one).
    pub fn outputs(&self, index: usize) -> Result<Vec<WireOutput<'a>>, DialectError> {
        let raw = *self.messages.get(index).ok_or(DialectError::BadMessage {
            index,
            reason: "no such message",
        })?;
        match self.dialect {
            DialectKind::ChatCompletions => chat_output(raw, index),
            DialectKind::Messages => anthropic_outputs(raw, index),
            DialectKind::Responses if self.input_is_string => Ok(Vec::new()),
            DialectKind::Responses => responses_output(raw, index),
        }
    }

    /// The name of the tool call `call_id` that an output in message `before` answers: the
    /// nearest earlier message (at most [`CALL_SEARCH_MESSAGES`] back) making a call with that
    /// id.
    pub fn call_name(&self, call_id: &str, before: usize) -> Option<String> {
        let end = before.min(self.messages.len());
        (end.saturating_sub(CALL_SEARCH_MESSAGES)..end)
            .rev()
            .filter(|&j| self.messages[j].contains(call_id))
            .find_map(|j| {
                let message = self.message(j).ok()?;
                let call = message
                    .tool_calls()
                    .filter(|c| c.id.as_deref() == Some(call_id))
                    .last()?;
                Some(call.name.clone())
            })
    }

    /// The first message a rewrite replacing `[head..boundary]` copies verbatim: `boundary`,
    /// or the one after it when the summary is merged into it (Anthropic, a tail opening
    /// with a user message).
    pub fn verbatim_from(&self, boundary: usize) -> Result<usize, DialectError> {
        if self.dialect != DialectKind::Messages || boundary >= self.messages.len() {
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
fn fields_of(raw: &str) -> Result<Vec<Field<'_>>, DialectError> {
    // No field is read specially: the conversation name matches nothing a caller reads.
    object_fields(raw, "\u{0}outputs", value_len)
}

/// A value a placeholder string may replace: a string or an array of parts.
fn replaceable(value: Option<&str>) -> Option<&str> {
    value.filter(|v| v.starts_with('"') || v.starts_with('['))
}

/// Chat Completions: a `tool` (or legacy `function`) message is one output, its `content`.
fn chat_output(raw: &str, index: usize) -> Result<Vec<WireOutput<'_>>, DialectError> {
    if !raw.contains("\"tool\"") && !raw.contains("\"function\"") {
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

/// Anthropic Messages: each `tool_result` block of a message is one output, its `content`.
fn anthropic_outputs(raw: &str, index: usize) -> Result<Vec<WireOutput<'_>>, DialectError> {
    if !raw.contains("tool_result") {
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
        if !block.starts_with('{') || !block.contains("tool_result") {
            continue;
        }
        let fields = fields_of(block)?;
        let kind: Option<Value> = decode(&fields, "type")?;
        if kind.as_ref().and_then(Value::as_str) != Some("tool_result") {
            continue;
        }
        out.push(WireOutput {
            message: index,
            call_id: decode::<Value>(&fields, "tool_use_id")?.and_then(string),
            name: None,
            value: replaceable(present(&fields, "content")?),
        });
    }
    Ok(out)
}

/// OpenAI Responses: a `*_call_output` item with a `call_id` is one output; the `output` of
/// `function_call_output` and `custom_tool_call_output` items may be replaced.
fn responses_output(raw: &str, index: usize) -> Result<Vec<WireOutput<'_>>, DialectError> {
    if !raw.contains("_call_output") {
        return Ok(Vec::new());
    }
    let fields = fields_of(raw)?;
    let kind: Option<Value> = decode(&fields, "type")?;
    let Some(kind) = kind.as_ref().and_then(Value::as_str) else {
        return Ok(Vec::new());
    };
    let call_id = decode::<Value>(&fields, "call_id")?.and_then(string);
    if !kind.ends_with("_call_output") || call_id.is_none() {
        return Ok(Vec::new());
    }
    let value = match kind {
        "function_call_output" | "custom_tool_call_output" => {
            replaceable(field(&fields, "output")?)
        }
        _ => None,
    };
    Ok(vec![WireOutput {
        message: index,
        call_id,
        name: None,
        value,
    }])
}

fn string(v: Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s),
        _ => None,
    }
}
