//! OpenAI Responses (`POST …/v1/responses`): scan, neutral messages and rewrite.
//!
//! - [`scan`] (every request): a request carrying `previous_response_id` or `conversation`, or
//!   an `item_reference` item, keeps (part of) its history on OpenAI's side, so it is
//!   [`DialectError::ServerState`] and passes through. Otherwise one pass splits the `input`
//!   items into raw slices of the body and counts them (a string `input` is one user
//!   message) and estimates what the model reads: message text, function names and arguments,
//!   tool outputs, reasoning summaries, images at a fixed cost, and the string leaves of any
//!   other item; ids, statuses, annotations and `encrypted_content` are not read
//!   as text. `instructions` and `tools` are counted as fixed tokens.
//! - `message` (only when a compaction is due or a stored summary is spliced in): one
//!   neutral message per input item:
//!   `message` items by role (`system`/`developer` lead the conversation and are never
//!   compacted), `function_call` and `custom_tool_call` (and any other `*_call` item with a
//!   `call_id`: `local_shell_call`, `computer_call`, `shell_call`, `apply_patch_call`) →
//!   assistant tool calls, `*_call_output` items with a `call_id` → tool results answering
//!   them, `mcp_approval_request` / `mcp_approval_response` → a tool call and its result
//!   (paired by the request's `id`), `reasoning` → assistant reasoning (its summary and
//!   content texts), anything else → opaque assistant items (a `compaction` item, the
//!   provider's sealed summary, is one: it ends the head, see `Transcript::new`).
//! - `rewrite`: every field but `input` byte for byte (`instructions`,
//!   `tools`, `reasoning`, `store`, `include`, unknown fields); `input` becomes the leading
//!   system/developer items verbatim, one user `message` item holding the summary, then the
//!   preserved tail verbatim.
//!
//! [`DialectError::ServerState`]: super::DialectError::ServerState

use serde::de::{DeserializeSeed, Deserializer};
use serde::{Deserialize, Serialize};

use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::answer::{RefusalWording, Usage, UsageFields};
use super::json::NodeSeed;
use super::json::{as_tokens, fast_node, leaf_weight, node_counts, Rules, StrWeight};
use super::outputs;
use super::outputs::{fields_of, holds, replaceable, string, MarksFound, WireOutput, MARKERS};
use super::scan_memo::{read_conversation, Remembering};
use super::split::{decode, field, object_fields, present, value_len};
use super::{DialectError, DialectKind, Scan, ScanFields};
use crate::estimate::{Counts, LazyEstimator};
use crate::transcript::{Message, Part, Role, ToolCall};

/// How Responses input is counted.
pub(crate) static RULES: Rules = Rules {
    skip: &[
        "id",
        "call_id",
        "status",
        "encrypted_content",
        "role",
        "annotations",
        "logprobs",
        "detail",
        "file_id",
        "cache_control",
    ],
    nested: &["content", "output", "summary"],
    raw: &[],
    image_types: &["input_image", "image", "image_url", "computer_screenshot"],
    image_keys: &[],
};

// ---------------------------------------------------------------------------------------------
// Hot path.

/// Reads a request once: its input items as raw slices of `body`, each counted (see
/// [`super::Scan`]). A request whose history lives on the provider is
/// [`DialectError::ServerState`].
pub fn scan<'a>(
    body: &'a str,
    estimator: &LazyEstimator,
    memo: Option<&Remembering<'_>>,
) -> Result<Scan<'a>, DialectError> {
    let mut read_items = None;
    let fields = object_fields(body, "input", |rest| {
        if !rest.starts_with('[') {
            return value_len(rest);
        }
        // Items read by hand when plain (`super::json::fast_node`), by serde otherwise.
        let fast = |item| {
            let mut found = MarksFound::new(DialectKind::Responses);
            let (counts, len) = fast_node(item, &RULES, 0, &mut |p| found.see(p))?;
            Some((counts, len, Some(found.marks)))
        };
        let (read, len) =
            read_conversation::<ItemCounts>(DialectKind::Responses, rest, fast, memo)?;
        read_items = read;
        Ok(len)
    })?;
    let previous: Option<Value> = decode(&fields, "previous_response_id")?;
    let conversation: Option<Value> = decode(&fields, "conversation")?;
    if server_state(previous.as_ref(), conversation.as_ref()) {
        return Err(DialectError::ServerState);
    }
    let input = present(&fields, "input")?.ok_or(DialectError::NoConversation("input"))?;
    if let Some((items, _, marks)) = &read_items {
        if holds_item_reference(items, marks) {
            return Err(DialectError::ServerState);
        }
    }
    let (items, tokens, marks, input_is_string) = if let Some((items, counts, marks)) = read_items {
        let tokens = counts.into_iter().map(|c| estimator.counts(c)).collect();
        (items, tokens, marks, false)
    } else {
        // A string `input` is one user message (anything else is not a Responses request).
        let text: String = serde_json::from_str(input)?;
        (vec![input], vec![estimator.text(&text)], vec![0], true)
    };
    let instructions = decode::<StrWeight>(&fields, "instructions")?.map_or(0, |s| s.0);
    let tools = present(&fields, "tools")?.map_or(0, |t| estimator.text(t));
    let max_output: Option<Value> = decode(&fields, "max_output_tokens")?;
    let fields = ScanFields {
        model: decode(&fields, "model")?,
        requested_output: as_tokens(max_output.as_ref()),
        fixed_tokens: estimator.weight(instructions).saturating_add(tools),
        input_is_string,
    };
    Ok(Scan::new(
        DialectKind::Responses,
        body.as_bytes(),
        items,
        tokens,
        marks,
        fields,
    ))
}

/// What the model reads of one input item, counted as a node.
struct ItemCounts(Counts);

impl From<ItemCounts> for Counts {
    fn from(item: ItemCounts) -> Counts {
        item.0
    }
}

impl<'de> Deserialize<'de> for ItemCounts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        DeserializeSeed::deserialize(NodeSeed(&RULES), d).map(ItemCounts)
    }
}

/// Whether an input item is an `item_reference`: an item OpenAI stored, sent by id only (the
/// AI SDK sends every earlier answer so when `store` is on). Its content is on OpenAI's side,
/// so a summary could not hold it, and a call it stands for could not be paired with its
/// output: such a request keeps (part of) its history on the provider and passes through.
/// Only the items marked as possibly one are read.
fn holds_item_reference(items: &[&str], marks: &[u32]) -> bool {
    #[derive(Deserialize)]
    struct Kind<'a> {
        #[serde(rename = "type", borrow)]
        kind: Option<std::borrow::Cow<'a, str>>,
    }
    for (item, &mark) in items.iter().zip(marks) {
        if outputs::may_be_item_reference(mark) {
            // Not an object: not a reference (reading the item says what else it is).
            let Ok(item) = serde_json::from_str::<Kind<'_>>(item) else {
                continue;
            };
            if item.kind.as_deref() == Some("item_reference") {
                return true;
            }
        }
    }
    false
}

/// Whether the conversation is held by OpenAI: a non-null `previous_response_id` or
/// `conversation` (an id string or `{"id": ...}`).
fn server_state(previous: Option<&Value>, conversation: Option<&Value>) -> bool {
    let set = |v: Option<&Value>| v.is_some_and(|v| !v.is_null());
    set(previous) || set(conversation)
}

/// A string `input` as its one neutral message.
pub(super) fn string_input(raw: &str) -> Result<Message, DialectError> {
    let text: String =
        serde_json::from_str(raw).map_err(|_| DialectError::NoConversation("input"))?;
    Ok(Message::new(Role::User, vec![Part::Text(text)]))
}

fn text_of(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Null => None,
        other => Some(other.to_string()),
    }
}

/// One input item as a neutral message.
/// One input item in neutral form.
pub(super) fn message(raw: &str, index: usize) -> Result<Message, DialectError> {
    let bad = |reason| DialectError::BadMessage { index, reason };
    let v: Value = serde_json::from_str(raw)?;
    let obj = v.as_object().ok_or(bad("not an object"))?;
    let str_field = |k: &str| obj.get(k).and_then(Value::as_str);
    let kind = match str_field("type") {
        Some(k) => k,
        None if obj.contains_key("role") => "message",
        None => return Err(bad("no type")),
    };
    let call_id = str_field("call_id").map(str::to_string);
    let opaque = || -> Result<Vec<Part>, DialectError> {
        let counts = node_counts(raw, &RULES)?;
        let mut parts = vec![Part::Opaque {
            kind: kind.to_string(),
            weight: counts.text,
        }];
        parts.extend(std::iter::repeat_n(Part::Image, counts.images));
        Ok(parts)
    };
    let message = match kind {
        "message" => {
            let role = match str_field("role") {
                Some("user") => Role::User,
                Some("assistant") => Role::Assistant,
                Some("system") | Some("developer") => Role::System,
                _ => return Err(bad("unknown role")),
            };
            Message::new(role, content_parts(obj.get("content"))?)
        }
        "function_call" => Message::new(
            Role::Assistant,
            vec![Part::ToolCall(ToolCall {
                id: call_id,
                name: str_field("name").unwrap_or_default().to_string(),
                arguments: text_of(obj.get("arguments")).unwrap_or_default(),
            })],
        ),
        // A hosted MCP tool asking the client's approval, and the client's answer: a call and
        // its result, paired by the request's `id`, so a tail never keeps the answer alone.
        "mcp_approval_request" => Message::new(
            Role::Assistant,
            vec![Part::ToolCall(ToolCall {
                id: str_field("id").map(str::to_string),
                name: str_field("name").unwrap_or("mcp").to_string(),
                arguments: text_of(obj.get("arguments")).unwrap_or_default(),
            })],
        ),
        "mcp_approval_response" => {
            let approve = obj.get("approve").and_then(Value::as_bool);
            let verdict = if approve == Some(true) {
                "approved"
            } else {
                "denied"
            };
            let mut m = Message::new(Role::Tool, vec![Part::Text(verdict.to_string())]);
            m.tool_call_id = str_field("approval_request_id").map(str::to_string);
            m
        }
        "reasoning" => {
            let mut parts: Vec<Part> = ["summary", "content"]
                .iter()
                .filter_map(|k| obj.get(*k).and_then(Value::as_array))
                .flatten()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .map(|t| Part::Reasoning(t.to_string()))
                .collect();
            if parts.is_empty() {
                parts.push(Part::Opaque {
                    kind: "reasoning".into(),
                    weight: 0,
                });
            }
            Message::new(Role::Assistant, parts)
        }
        k if k.ends_with("_call_output") && call_id.is_some() => {
            let mut m = Message::new(Role::Tool, content_parts(obj.get("output"))?);
            m.tool_call_id = call_id;
            m
        }
        k if k.ends_with("_call") && call_id.is_some() => {
            let name = str_field("name")
                .map(str::to_string)
                .unwrap_or_else(|| k.trim_end_matches("_call").to_string());
            let arguments = ["arguments", "input", "action", "operation"]
                .iter()
                .find_map(|key| text_of(obj.get(*key)))
                .unwrap_or_default();
            Message::new(
                Role::Assistant,
                vec![Part::ToolCall(ToolCall {
                    id: call_id,
                    name,
                    arguments,
                })],
            )
        }
        _ => Message::new(Role::Assistant, opaque()?),
    };
    Ok(message)
}

/// A message's `content` or a tool's `output`: a string, one part, or parts.
fn content_parts(content: Option<&Value>) -> Result<Vec<Part>, DialectError> {
    Ok(match content {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![Part::Text(s.clone())],
        Some(Value::Array(items)) => items.iter().map(part_from_value).collect(),
        Some(other) => vec![part_from_value(other)],
    })
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
    let kind = obj.get("type").and_then(Value::as_str).unwrap_or("unknown");
    if RULES.image_types.contains(&kind) {
        return Part::Image;
    }
    let text = |k: &str| obj.get(k).and_then(Value::as_str).map(str::to_string);
    match kind {
        "input_text" | "output_text" | "text" | "summary_text" | "reasoning_text" => {
            if let Some(t) = text("text") {
                return Part::Text(t);
            }
        }
        "refusal" => {
            if let Some(t) = text("refusal") {
                return Part::Text(t);
            }
        }
        _ => {}
    }
    // Counted off the parsed part: these rules read no raw JSON text.
    let weight = serde::de::DeserializeSeed::deserialize(super::json::NodeSeed(&RULES), part)
        .map_or(0, |c| c.text);
    Part::Opaque {
        kind: kind.to_string(),
        weight,
    }
}

// ---------------------------------------------------------------------------------------------
// Rewrite.

#[derive(Serialize)]
struct SummaryItem<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    content: [InputText<'a>; 1],
}

#[derive(Serialize)]
struct InputText<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

/// `input[head..boundary]` replaced by one user message item holding `summary_message`. A
/// string `input` becomes an array: the summary item, and the string as a user message item
/// before it or after it as the plan keeps it (or not at all when compacted).
pub(super) fn rewrite(
    scan: &Scan<'_>,
    head: usize,
    boundary: usize,
    summary_message: &str,
) -> Result<Vec<u8>, DialectError> {
    let summary = SummaryItem {
        kind: "message",
        role: "user",
        content: [InputText {
            kind: "input_text",
            text: summary_message,
        }],
    };
    if !scan.input_is_string {
        return scan.splice(head, boundary, false, summary_message.len() + 64, |out| {
            serde_json::to_writer(out, &summary)
        });
    }
    // The whole `input` value is replaced: the splice covers its one item, the string, which
    // is written back as a user message item where the plan keeps it (before the summary when
    // it is the head, after it when it is the tail).
    let kept_head = &scan.messages[..head];
    let tail = &scan.messages[boundary..];
    let extra = summary_message.len() + scan.body().len() + 96;
    scan.splice(0, scan.len(), false, extra, |out| {
        let string_item = |out: &mut Vec<u8>, item: &str| {
            out.extend_from_slice(br#"{"type":"message","role":"user","content":"#);
            out.extend_from_slice(item.as_bytes());
            out.push(b'}');
        };
        out.push(b'[');
        for item in kept_head {
            string_item(out, item);
            out.push(b',');
        }
        serde_json::to_writer(&mut *out, &summary)?;
        for item in tail {
            out.push(b',');
            string_item(out, item);
        }
        out.push(b']');
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Tool outputs (for masking; see `outputs`).

/// OpenAI Responses: a `*_call_output` item with a `call_id` is one output; the `output` of
/// `function_call_output` and `custom_tool_call_output` items may be replaced.
pub(super) fn outputs(raw: &str, index: usize) -> Result<Vec<WireOutput<'_>>, DialectError> {
    if !holds(raw, &MARKERS.call_output) {
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

// ---------------------------------------------------------------------------------------------
// Recognising a body.

/// Whether a request body is OpenAI Responses: an `input` array or string.
pub(crate) fn looks_like(request: &Map<String, Value>) -> bool {
    matches!(
        request.get("input"),
        Some(Value::Array(_) | Value::String(_))
    )
}

// ---------------------------------------------------------------------------------------------
// The summary asked inside the conversation.

/// Turns `body` (a request as the provider received it) into one asking the same model for
/// the summary: `turn` appended as a user message item, no streaming, `max_output_tokens`
/// set, tools kept (part of the cached prefix) but not callable, no structured output format,
/// not stored, and everything else as sent (`instructions`, `reasoning`, `include`,
/// `prompt_cache_key`, which routes the call to the conversation's cache). The output tokens
/// asked.
pub(crate) fn ask_for_summary(
    params: &mut Map<String, Value>,
    input: &mut Vec<Box<RawValue>>,
    turn: &str,
    max_output: u32,
) -> Result<usize, DialectError> {
    input.push(serde_json::value::to_raw_value(&serde_json::json!({
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": turn}],
    }))?);
    if let Some(text) = params.get_mut("text").and_then(Value::as_object_mut) {
        text.remove("format");
    }
    params.remove("background");
    params.insert("stream".into(), Value::Bool(false));
    params.insert("store".into(), Value::Bool(false));
    params.insert("max_output_tokens".into(), max_output.into());
    if params
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty())
    {
        params.insert("tool_choice".into(), "none".into());
    }
    Ok(max_output as usize)
}

// ---------------------------------------------------------------------------------------------
// Answers.

/// The Responses API's refusal for length, as a status or a `response.failed` event: `Your
/// input exceeds the context window of this model …` (code `context_length_exceeded`).
pub(crate) static REFUSAL: RefusalWording = RefusalWording {
    phrases: &["exceeds the context window", "context_length_exceeded"],
    window_after: &[],
    window_between: None,
    requested_after: &[],
    fields: None,
};

/// The Responses API's `usage`: `input_tokens` is the whole input, cached ones
/// (`input_tokens_details.cached_tokens`) included; no cache writes.
pub(crate) fn usage(f: &UsageFields) -> Option<Usage> {
    (f.input_tokens.is_some() || f.output_tokens.is_some()).then(|| Usage {
        input: f.input_tokens.unwrap_or(0),
        output: f.output_tokens.unwrap_or(0),
        cache_read: f.cached_tokens.unwrap_or(0),
        cache_write: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dialect::Parsed;

    fn parse(body: &[u8]) -> Result<Parsed<'_>, DialectError> {
        DialectKind::Responses.parse(body)
    }

    fn scan<'a>(body: &'a [u8], est: &LazyEstimator) -> Result<Scan<'a>, DialectError> {
        DialectKind::Responses.scan(body, est)
    }
    use crate::estimate::IMAGE_TOKENS;
    use serde_json::json;

    fn est() -> LazyEstimator {
        LazyEstimator::default()
    }

    fn input_of(body: &[u8]) -> Vec<Value> {
        let v: Value = serde_json::from_slice(body).expect("JSON");
        v["input"].as_array().cloned().expect("input array")
    }

    fn items() -> Value {
        json!([
            {"type": "message", "role": "developer", "content": "rules"},
            {"role": "user", "content": [
                {"type": "input_text", "text": "abcd"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "high"}
            ]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "abcd"}],
             "encrypted_content": "E".repeat(300)},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
             "arguments": "{\"command\":[\"cat\",\"a.rs\"]}", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "fn a() {}"},
            {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch",
             "input": "*** Begin Patch\n*** Add File: b.rs\n+x\n*** End Patch"},
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": "ok"},
            {"type": "local_shell_call", "id": "lsh_1", "call_id": "call_3", "status": "completed",
             "action": {"type": "exec", "command": ["bash", "-lc", "rm c.rs"]}},
            {"type": "local_shell_call_output", "call_id": "call_3", "output": ""},
            {"type": "web_search_call", "id": "ws_1", "status": "completed",
             "action": {"type": "search", "query": "rust"}},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "done", "annotations": [{"url": "u".repeat(50)}]}]},
            {"role": "user", "content": "next?"}
        ])
    }

    #[test]
    fn peek_counts_items_and_agrees_with_parse() {
        let body = json!({
            "model": "gpt-5", "instructions": "abcd", "max_output_tokens": 500,
            "tools": [{"type": "function", "name": "shell"}],
            "store": false, "include": ["reasoning.encrypted_content"],
            "input": items()
        })
        .to_string();
        let p = scan(body.as_bytes(), &est()).expect("peeks");
        assert_eq!(p.model.as_deref(), Some("gpt-5"));
        assert_eq!(p.requested_output, Some(500));
        assert_eq!(p.len(), 12);
        let tools = r#"[{"name":"shell","type":"function"}]"#;
        assert_eq!(p.fixed_tokens, 1 + est().text(tools));
        let r = parse(body.as_bytes()).expect("parses");
        assert_eq!(r.scan.tokens, p.tokens);
        let per: Vec<usize> = r.transcript.messages.iter().map(|m| m.tokens).collect();
        assert_eq!(
            per,
            vec![
                est().text("rules"),
                est().text("abcd") + IMAGE_TOKENS, // text + image
                est().text("abcd"),                // reasoning summary only
                est().text(r#"shell{"command":["cat","a.rs"]}"#), // name + arguments
                est().text("fn a() {}"),           // output
                est().text("apply_patch*** Begin Patch\n*** Add File: b.rs\n+x\n*** End Patch"),
                est().text("ok"),
                est().text("execbash-lcrm c.rs"), // action leaves
                0,                                // empty output
                est().text("searchrust"),         // action leaves
                est().text("done"),               // annotations not read
                est().text("next?"),
            ]
        );
    }

    #[test]
    fn server_held_conversations_pass_through() {
        for body in [
            json!({"model": "gpt-5", "previous_response_id": "resp_1", "input": "more"}),
            json!({"model": "gpt-5", "conversation": "conv_1", "input": [{"role": "user", "content": "x"}]}),
            json!({"model": "gpt-5", "conversation": {"id": "conv_1"}, "input": "x"}),
            // The AI SDK with `store` on: earlier answers sent as references to stored items.
            json!({"model": "gpt-5", "store": true, "input": [
                {"role": "user", "content": "x"},
                {"type": "item_reference", "id": "rs_1"},
                {"type": "item_reference", "id": "fc_1"},
                {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
                {"role": "user", "content": "y"}
            ]}),
        ] {
            let b = body.to_string();
            assert!(matches!(
                scan(b.as_bytes(), &est()),
                Err(DialectError::ServerState)
            ));
            assert!(matches!(
                parse(b.as_bytes()),
                Err(DialectError::ServerState)
            ));
        }
        let null = json!({"previous_response_id": null, "conversation": null, "input": "x"});
        assert!(scan(null.to_string().as_bytes(), &est()).is_ok());
        // Only an item of that type is a reference: text naming it, or a string item, is not.
        let named = json!({"input": [
            {"role": "user", "content": "item_reference"},
            {"role": "user", "content": [{"type": "input_text", "text": "an \"item_reference\""}]},
            "item_reference"
        ]});
        assert_eq!(
            scan(named.to_string().as_bytes(), &est())
                .map(|s| s.len())
                .ok(),
            Some(3)
        );
        assert!(matches!(
            scan(br#"{"model":"gpt-5"}"#, &est()),
            Err(DialectError::NoConversation("input"))
        ));
        assert!(scan(br#"{"input": 5}"#, &est()).is_err());
        assert!(scan(b"[]", &est()).is_err());
    }

    #[test]
    fn parse_maps_items_to_messages() {
        let body = json!({"model": "gpt-5", "input": items()}).to_string();
        let r = parse(body.as_bytes()).expect("parses");
        let t = &r.transcript;
        let m = &t.messages;
        assert_eq!(t.head_len(), 1, "the developer message leads");
        let roles: Vec<Role> = m.iter().map(|m| m.role).collect();
        use Role::*;
        assert_eq!(
            roles,
            vec![
                System, User, Assistant, Assistant, Tool, Assistant, Tool, Assistant, Tool,
                Assistant, Assistant, User
            ]
        );
        assert!(m[2].is_reasoning_only());
        assert_eq!(m[2].parts, vec![Part::Reasoning("abcd".into())]);
        assert_eq!(
            t.pairs(),
            vec![
                None,
                None,
                None,
                None,
                Some(3),
                None,
                Some(5),
                None,
                Some(7),
                None,
                None,
                None
            ]
        );
        assert_eq!(m[4].tool_name.as_deref(), Some("shell"), "resolved");
        assert!(
            matches!(&m[5].parts[0], Part::ToolCall(c) if c.name == "apply_patch"
            && c.arguments.starts_with("*** Begin Patch"))
        );
        assert!(
            matches!(&m[7].parts[0], Part::ToolCall(c) if c.name == "local_shell"
            && c.arguments.contains("rm c.rs"))
        );
        assert!(matches!(&m[9].parts[0], Part::Opaque { kind, .. } if kind == "web_search_call"));
        assert_eq!(m[1].parts[1], Part::Image);
        assert!(matches!(
            parse(br#"{"input":[{"type":"message","role":"narrator","content":"x"}]}"#),
            Err(DialectError::BadMessage { index: 0, .. })
        ));
    }

    #[test]
    fn a_string_input_is_one_user_message() {
        let body = br#"{"model":"gpt-5","input":"hello there","instructions":"be brief"}"#;
        let p = scan(body, &est()).expect("peeks");
        assert_eq!((p.len(), p.tokens), (1, 3 + 2));
        let r = parse(body).expect("parses");
        assert_eq!(r.transcript.messages[0].role, Role::User);
        assert_eq!(r.scan.messages.len(), 1);
        // Nothing before it to compact; written back, it becomes a message item.
        let out = input_of(&r.scan.rewrite(0, 0, "S").expect("rewrites"));
        assert_eq!(
            out[1],
            json!({"type": "message", "role": "user", "content": "hello there"})
        );
    }

    /// Found by fuzzing (`pipeline::fuzz`): a plan keeping the string as the head
    /// (`head = boundary = 1`) wrote the summary alone and dropped the string. The pipeline
    /// never plans that (a user message is no head), but a rewrite must keep what its plan
    /// keeps.
    #[test]
    fn a_string_input_kept_as_the_head_stays_before_the_summary() {
        let body = br#"{"input":"hello","model":"m"}"#;
        let r = parse(body).expect("parses");
        let user = json!({"type": "message", "role": "user", "content": "hello"});
        let summary = json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "S"}]});
        let out = input_of(&r.scan.rewrite(1, 1, "S").expect("rewrites"));
        assert_eq!(out, [user.clone(), summary.clone()]);
        let out = input_of(&r.scan.rewrite(0, 1, "S").expect("rewrites"));
        assert_eq!(out, [summary]);
    }

    #[test]
    fn an_mcp_approval_is_a_call_and_its_answer() {
        let body = json!({"model": "gpt-5", "input": [
            {"role": "user", "content": "ask the docs"},
            {"type": "mcp_approval_request", "id": "mcpr_1", "server_label": "docs", "name": "ask", "arguments": "{}"},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"},
            {"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": false}
        ]})
        .to_string();
        let t = parse(body.as_bytes()).expect("parses").transcript;
        assert_eq!(t.pairs(), vec![None, None, None, Some(1)]);
        assert_eq!(t.messages[3].role, Role::Tool);
        assert_eq!(t.messages[3].parts, [Part::Text("denied".into())]);
    }

    #[test]
    fn a_provider_compaction_item_and_what_precedes_it_are_the_head() {
        // Codex after a remote compaction: the user messages it kept, the provider's sealed
        // summary, then the conversation since.
        let compaction =
            json!({"type": "compaction", "id": "cmp_1", "encrypted_content": "Z".repeat(400)});
        let input = json!([
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context>cwd</environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix the parser"}]},
            compaction,
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "now the \"compaction\" tests"}]},
            {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            // A text that is exactly the kind is marked, read, and is not a summary.
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "compaction"}]}
        ]);
        let body = json!({"model": "gpt-5-codex", "input": input}).to_string();
        let r = parse(body.as_bytes()).expect("parses");
        assert_eq!(r.transcript.head_len(), 3);
        assert_eq!(r.scan.head_len(0).expect("head"), 3);
        assert!(r.transcript.messages[2].parts[0].is_provider_summary());

        // Without the sealed summary, nothing but leading system messages is the head.
        let mut plain = input.as_array().cloned().expect("items");
        plain.remove(2);
        let body = json!({"model": "gpt-5-codex", "input": plain}).to_string();
        let r = parse(body.as_bytes()).expect("parses");
        assert_eq!(r.transcript.head_len(), 0);
        assert_eq!(r.scan.head_len(0).expect("head"), 0);
    }

    #[test]
    fn rewrite_keeps_instructions_and_unknown_fields_and_the_tail() {
        let body = format!(
            r#"{{"model":"gpt-5","instructions" : "be \"brief\"","input":{},"tools":[ {{"type":"function","name":"shell"}} ],"reasoning":{{"effort":"high"}},"store":false,"x_vendor":{{"a":[1, 2]}}}}"#,
            items()
        );
        let r = parse(body.as_bytes()).expect("parses");
        let out = r.scan.rewrite(1, 10, "SUMMARY").expect("rewrites");
        let text = String::from_utf8(out.clone()).expect("utf8");
        assert!(text.starts_with(r#"{"model":"gpt-5","instructions" : "be \"brief\"","input":["#));
        assert!(text.ends_with(r#""tools":[ {"type":"function","name":"shell"} ],"reasoning":{"effort":"high"},"store":false,"x_vendor":{"a":[1, 2]}}"#));
        let items_out = input_of(&out);
        let items_in = input_of(body.as_bytes());
        assert_eq!(items_out[0], items_in[0], "developer message kept");
        assert_eq!(
            items_out[1],
            json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "SUMMARY"}]})
        );
        assert_eq!(&items_out[2..], &items_in[10..]);
        assert!(matches!(
            r.scan.rewrite(0, 13, "S"),
            Err(DialectError::BadPlan { .. })
        ));
    }
}
