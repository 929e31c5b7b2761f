//! Google Gemini (`POST …/models/{model}:generateContent` and `:streamGenerateContent`): the
//! path, scan, neutral messages, rewrite, tool outputs and the summary asked inside the
//! conversation.
//!
//! - The path names the model (`/v1beta/models/gemini-2.5-flash:streamGenerateContent`, or
//!   Vertex AI's `/v1/projects/p/locations/l/publishers/google/models/m:generateContent`);
//!   `split_path` keeps everything before the `:` as the request's API prefix, so the
//!   model travels with the caller (`model_of_prefix`) and the body has none.
//! - [`scan`] (every request): one pass over `contents`, each entry `{"role": "user" |
//!   "model", "parts": [...]}` (a missing role is the user's, as the API reads it). What the
//!   model reads is counted: text (thoughts included), `functionCall` names and `args` (as
//!   JSON text), `functionResponse` names and the string leaves of `response`, inline and file
//!   data at an image's fixed cost; ids and `thoughtSignature`s are not text. The top-level
//!   `systemInstruction` and `tools` are fixed tokens, `generationConfig.maxOutputTokens` the
//!   output reserved. Both spellings the REST API accepts (`systemInstruction` and
//!   `system_instruction`, ...) are read. A request naming `cachedContent` has part of its
//!   conversation on the provider: it passes through (counted as `server_state`).
//! - `message` (only when a compaction is due): `text` → text (`"thought": true` →
//!   reasoning), `functionCall` → a tool call, `functionResponse` → a tool result named after
//!   its function, inline or file data → an image, anything else opaque. A user entry of
//!   function responses is one message answering every call of the model entry before it.
//! - `rewrite`: every field but `contents` byte for byte; `contents` becomes the kept head,
//!   one user entry holding the summary, then the preserved tail verbatim. Gemini reads
//!   alternating turns and wants every function call answered in the next one, so the summary
//!   joins a user neighbour as a text part (after the parts of a head ending on a user entry,
//!   before those of a tail starting with one), and a tail starting with function responses
//!   is refused (they answer the entry before them, which the boundary rules never cut away).
//!   Parts are copied whole, so every `thoughtSignature` stays with its part.

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::answer::{RefusalWording, Usage, UsageFields};
use super::json::{
    as_tokens, fast_role_content, leaf_weight, node_counts, ContentSeed, OneOf, OrderedObject,
    Rules,
};
use super::outputs::{self, fields_of, holds, MarksFound, WireOutput, MARKERS};
use super::scan_memo::{read_conversation, Remembering};
use super::split::{decode, field, object_fields, present, read_array};
use super::{DialectError, DialectKind, Scan, ScanFields};
use crate::estimate::{Counts, LazyEstimator};
use crate::transcript::{Message, Part, Role, ToolCall, ToolResult};

/// How Gemini content is counted: parts nested under `parts`, function calls and responses
/// read as nodes (so `args` counts as the JSON sent), data parts as images.
pub(crate) static RULES: Rules = Rules {
    skip: &[
        "id",
        "role",
        "thought",
        "thoughtSignature",
        "thought_signature",
        "mimeType",
        "mime_type",
        "videoMetadata",
        "video_metadata",
        "willContinue",
        "will_continue",
        "scheduling",
    ],
    nested: &[
        "parts",
        "functionCall",
        "function_call",
        "functionResponse",
        "function_response",
    ],
    raw: &["args"],
    image_types: &[],
    image_keys: &["inlineData", "inline_data", "fileData", "file_data"],
};

const ROLES: &[&str] = &["user", "model"];

/// The verbs of a chat call, after the model.
const VERBS: [&str; 2] = ["generateContent", "streamGenerateContent"];

/// The collections a model is named in (`models/gemini-2.5-pro`, `tunedModels/my-model`).
const MODEL_COLLECTIONS: [&str; 2] = ["models", "tunedModels"];

/// The API prefix of a Gemini chat path: everything before `:generateContent` or
/// `:streamGenerateContent`, which ends in `models/{model}`. `None` for any other path
/// (`:countTokens`, `:embedContent`, a model's metadata).
pub(super) fn split_path(path: &str) -> Option<&str> {
    let (prefix, verb) = path.rsplit_once(':')?;
    if !VERBS.contains(&verb) {
        return None;
    }
    let (parent, model) = prefix.rsplit_once('/')?;
    let collection = parent.rsplit('/').next()?;
    (!model.is_empty() && MODEL_COLLECTIONS.contains(&collection)).then_some(prefix)
}

/// The model a Gemini API prefix ([`split_path`]) names: its last segment.
pub(super) fn model_of_prefix(prefix: &str) -> Option<&str> {
    prefix
        .rsplit_once('/')
        .map(|(_, model)| model)
        .filter(|m| !m.is_empty())
}

// ---------------------------------------------------------------------------------------------
// Hot path.

/// Reads a request once: its `contents` as raw slices of `body`, each counted (see
/// [`super::Scan`]). The model is not in the body; the pipeline takes it from the path
/// ([`Scan::with_model_from_prefix`]).
pub fn scan<'a>(
    body: &'a str,
    estimator: &LazyEstimator,
    memo: Option<&Remembering<'_>>,
) -> Result<Scan<'a>, DialectError> {
    let mut conversation = None;
    let fields = object_fields(body, "contents", |rest| {
        let fast = |m| fast_entry(m).map(|(stats, len, marks)| (stats.0, len, Some(marks)));
        let (read, len) = read_conversation::<EntryStats>(DialectKind::Gemini, rest, fast, memo)?;
        conversation = read;
        Ok(len)
    })?;
    field(&fields, "contents")?;
    let (contents, stats, marks) = conversation.ok_or(DialectError::NoConversation("contents"))?;
    if either(&fields, "cachedContent", "cached_content")?.is_some() {
        return Err(DialectError::ServerState);
    }
    let tokens = stats.into_iter().map(|s| estimator.counts(s)).collect();
    let system = match either(&fields, "systemInstruction", "system_instruction")? {
        Some(raw) => {
            let mut de = serde_json::Deserializer::from_str(raw);
            let counts = de::DeserializeSeed::deserialize(ContentSeed(&RULES), &mut de)?;
            de.end()?;
            counts
        }
        None => Counts::default(),
    };
    let tools = present(&fields, "tools")?.map_or(0, |t| estimator.text(t));
    let config: Option<Value> = match either(&fields, "generationConfig", "generation_config")? {
        Some(raw) => Some(serde_json::from_str(raw)?),
        None => None,
    };
    let max_output = config.as_ref().and_then(|c| {
        c.get("maxOutputTokens")
            .or_else(|| c.get("max_output_tokens"))
    });
    let fields = ScanFields {
        model: None,
        requested_output: as_tokens(max_output),
        fixed_tokens: estimator.counts(system).saturating_add(tools),
        input_is_string: false,
    };
    Ok(Scan::new(
        DialectKind::Gemini,
        body.as_bytes(),
        contents,
        tokens,
        marks,
        fields,
    ))
}

/// The field present under either of its two spellings (camelCase or snake_case).
fn either<'a>(
    fields: &[super::split::Field<'a>],
    camel: &str,
    snake: &str,
) -> Result<Option<&'a str>, DialectError> {
    Ok(present(fields, camel)?.or(present(fields, snake)?))
}

/// What the model reads of one entry; its role, when it has one, must be `user` or `model`.
struct EntryStats(Counts);

impl From<EntryStats> for Counts {
    fn from(stats: EntryStats) -> Counts {
        stats.0
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum EntryField {
    Role,
    Parts,
    #[serde(other)]
    Other,
}

impl<'de> Deserialize<'de> for EntryStats {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EntryStats;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a content object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut counts = Counts::default();
                let mut role_ok = true;
                while let Some(field) = map.next_key::<EntryField>()? {
                    match field {
                        EntryField::Role => role_ok = map.next_value_seed(OneOf(ROLES))?,
                        EntryField::Parts => counts.add(map.next_value_seed(ContentSeed(&RULES))?),
                        EntryField::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                if !role_ok {
                    return Err(de::Error::custom("role must be `user` or `model`"));
                }
                Ok(EntryStats(counts))
            }
        }
        d.deserialize_map(V)
    }
}

/// [`EntryStats`] of the entry at the start of `text` read by hand, and the bytes it takes;
/// `None` leaves it to serde.
fn fast_entry(text: &str) -> Option<(EntryStats, usize, u32)> {
    let mut found = MarksFound::new(DialectKind::Gemini);
    // The role is optional (a missing one is the user's).
    let shape = ("parts", ROLES, false);
    let (counts, len) = fast_role_content(text, shape, &RULES, &mut |p| found.see(p))?;
    Some((EntryStats(counts), len, found.marks))
}

// ---------------------------------------------------------------------------------------------
// Full parse.

#[derive(Deserialize)]
struct WireEntry<'a> {
    #[serde(default)]
    role: Option<String>,
    #[serde(borrow, default)]
    parts: Option<Vec<&'a RawValue>>,
}

/// One part; both spellings of each key.
#[derive(Deserialize)]
struct WirePart<'a> {
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    thought: Option<Value>,
    #[serde(borrow, default, alias = "function_call")]
    #[serde(rename = "functionCall")]
    function_call: Option<&'a RawValue>,
    #[serde(borrow, default, alias = "function_response")]
    #[serde(rename = "functionResponse")]
    function_response: Option<&'a RawValue>,
    #[serde(borrow, default, alias = "inline_data")]
    #[serde(rename = "inlineData")]
    inline_data: Option<&'a RawValue>,
    #[serde(borrow, default, alias = "file_data")]
    #[serde(rename = "fileData")]
    file_data: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct WireCall<'a> {
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    name: Option<Value>,
    #[serde(borrow, default)]
    args: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct WireResponse<'a> {
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    name: Option<Value>,
    #[serde(borrow, default)]
    response: Option<&'a RawValue>,
}

/// One entry in neutral form.
pub(super) fn message(raw: &str, index: usize) -> Result<Message, DialectError> {
    let bad = |reason| DialectError::BadMessage { index, reason };
    let wire: WireEntry<'_> = serde_json::from_str(raw).map_err(|_| bad("not a content object"))?;
    let role = match wire.role.as_deref() {
        None | Some("user") => Role::User,
        Some("model") => Role::Assistant,
        Some(_) => return Err(bad("role must be `user` or `model`")),
    };
    let mut parts = Vec::new();
    for part in wire.parts.unwrap_or_default() {
        part_of(part, &mut parts)?;
    }
    Ok(Message::new(role, parts))
}

/// One part in neutral form.
fn part_of(raw: &RawValue, parts: &mut Vec<Part>) -> Result<(), DialectError> {
    let Ok(part) = serde_json::from_str::<WirePart<'_>>(raw.get()) else {
        let value: Value = serde_json::from_str(raw.get())?;
        parts.push(Part::Opaque {
            kind: "unknown".into(),
            weight: leaf_weight(&value),
        });
        return Ok(());
    };
    if let Some(Value::String(text)) = part.text {
        parts.push(if part.thought == Some(Value::Bool(true)) {
            Part::Reasoning(text)
        } else {
            Part::Text(text)
        });
    } else if let Some(call) = part.function_call {
        let call: WireCall<'_> = serde_json::from_str(call.get())?;
        parts.push(Part::ToolCall(ToolCall {
            id: call.id.and_then(outputs::string),
            name: call.name.and_then(outputs::string).unwrap_or_default(),
            arguments: call
                .args
                .map_or_else(|| "{}".into(), |a| a.get().to_string()),
        }));
    } else if let Some(raw_response) = part.function_response {
        let response: WireResponse<'_> = serde_json::from_str(raw_response.get())?;
        let (text, is_error) = match response.response {
            Some(r) => response_text(r)?,
            None => (String::new(), false),
        };
        // What the scan counts beyond the output's text (the function's name, other fields
        // of the response) stays counted, as an opaque part.
        let counted = node_counts(raw_response.get(), &RULES)?.text;
        let rest = counted.saturating_sub(crate::estimate::text_weight(&text));
        let mut content = vec![Part::Text(text)];
        if rest > 0 {
            content.push(Part::Opaque {
                kind: "function_response".into(),
                weight: rest,
            });
        }
        parts.push(Part::ToolResult(ToolResult {
            call_id: response.id.and_then(outputs::string),
            name: response.name.and_then(outputs::string),
            content,
            is_error,
        }));
    } else if part.inline_data.is_some() || part.file_data.is_some() {
        parts.push(Part::Image);
    } else {
        let counts = node_counts(raw.get(), &RULES)?;
        parts.push(Part::Opaque {
            kind: "part".into(),
            weight: counts.text,
        });
    }
    Ok(())
}

/// The keys under which a function's `response` object carries its output as a string
/// (Gemini CLI writes `output`, or `error` for a failure), in the order they are looked for.
const OUTPUT_KEYS: [&str; 4] = ["output", "error", "content", "result"];

/// What a function response says: its output string when it has one
/// ([`OUTPUT_KEYS`]), else the response's JSON text; and whether it reports an error (an
/// `error` key).
fn response_text(raw: &RawValue) -> Result<(String, bool), DialectError> {
    let value: Value = serde_json::from_str(raw.get())?;
    let Value::Object(map) = &value else {
        return Ok((raw.get().to_string(), false));
    };
    let is_error = map.contains_key("error");
    let text = OUTPUT_KEYS
        .iter()
        .find_map(|k| map.get(*k).and_then(Value::as_str))
        .map_or_else(|| raw.get().to_string(), str::to_string);
    Ok((text, is_error))
}

// ---------------------------------------------------------------------------------------------
// Rewrite.

/// The entries `[head..boundary]` replaced by one user entry holding `summary_message`, joined
/// to its user neighbours as a text part (see the module's doc).
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
        let summary = serde_json::json!({"text": summary_message});
        let (base, leading, trailing) = match (before, after) {
            (None, None) => {
                return serde_json::to_writer(
                    out,
                    &serde_json::json!({"role": "user", "parts": [summary]}),
                )
            }
            (Some(before), after) => (
                before,
                parts_of(before)?,
                after.map(parts_of).transpose()?.unwrap_or_default(),
            ),
            (None, Some(after)) => (after, Vec::new(), parts_of(after)?),
        };
        let fields: OrderedObject<'_> = serde_json::from_str(base)?;
        let Some(at) = fields.position("parts") else {
            return Err(serde::ser::Error::custom("user entry without parts"));
        };
        fields.write_replacing(out, at, |out| {
            out.push(b'[');
            for part in &leading {
                out.extend_from_slice(part.get().as_bytes());
                out.push(b',');
            }
            serde_json::to_writer(&mut *out, &summary)?;
            for part in &trailing {
                out.push(b',');
                out.extend_from_slice(part.get().as_bytes());
            }
            out.push(b']');
            Ok(())
        })
    })
}

/// The parts of an entry, each as sent.
fn parts_of(raw: &str) -> Result<Vec<&RawValue>, serde_json::Error> {
    let entry: WireEntry<'_> = serde_json::from_str(raw)?;
    Ok(entry.parts.unwrap_or_default())
}

// ---------------------------------------------------------------------------------------------
// Tool outputs (for masking; see `outputs`).

/// Gemini: each `functionResponse` part of an entry is one output; the value a placeholder
/// may replace is the string its `response` carries under an output key ([`OUTPUT_KEYS`]:
/// Gemini CLI's `{"output": "..."}`), since `response` itself must stay an object.
pub(super) fn outputs(raw: &str, index: usize) -> Result<Vec<WireOutput<'_>>, DialectError> {
    if !holds(raw, &MARKERS.function_response) && !holds(raw, &MARKERS.function_response_snake) {
        return Ok(Vec::new());
    }
    let fields = fields_of(raw)?;
    let Some(parts) = present(&fields, "parts")? else {
        return Ok(Vec::new());
    };
    if !parts.starts_with('[') {
        return Ok(Vec::new());
    }
    let (parts, _) = read_array::<IgnoredAny>(parts)?;
    let mut out = Vec::new();
    for part in parts.map(|(p, _)| p).unwrap_or_default() {
        if !part.starts_with('{') {
            continue;
        }
        let fields = fields_of(part)?;
        let Some(response) = either(&fields, "functionResponse", "function_response")? else {
            continue;
        };
        if !response.starts_with('{') {
            continue;
        }
        let fields = fields_of(response)?;
        let value = match present(&fields, "response")? {
            Some(r) if r.starts_with('{') => {
                let inner = fields_of(r)?;
                let mut found = None;
                for key in OUTPUT_KEYS {
                    if let Some(v) = present(&inner, key)?.filter(|v| v.starts_with('"')) {
                        found = Some(v);
                        break;
                    }
                }
                found
            }
            _ => None,
        };
        out.push(WireOutput {
            message: index,
            call_id: decode::<Value>(&fields, "id")?.and_then(outputs::string),
            name: decode::<Value>(&fields, "name")?.and_then(outputs::string),
            value,
        });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Recognising a body.

/// Whether a request body is Gemini's: a `contents` array.
pub(crate) fn looks_like(request: &Map<String, Value>) -> bool {
    matches!(request.get("contents"), Some(Value::Array(_)))
}

// ---------------------------------------------------------------------------------------------
// The summary asked inside the conversation.

/// Keys of `generationConfig` that ask for something other than one plain text answer.
const NOT_TEXT: [&str; 8] = [
    "responseMimeType",
    "responseSchema",
    "responseJsonSchema",
    "candidateCount",
    "responseModalities",
    "responseLogprobs",
    "logprobs",
    "stopSequences",
];

/// Turns `body` (a request as the provider received it) into one asking the same model for
/// the summary: `turn` as a text part after the last user entry's parts (a new user entry
/// after a model one), `max_output` tokens beyond any thinking budget, tools kept (part of
/// the prefix Gemini caches) but not callable (`functionCallingConfig.mode` `NONE`), and
/// nothing asked that is not one text answer. Whether it streams is the path's business, not
/// the body's: the backend posts it to `:generateContent`. The output tokens asked.
pub(crate) fn ask_for_summary(
    params: &mut Map<String, Value>,
    contents: &mut Vec<Box<RawValue>>,
    turn: &str,
    max_output: u32,
) -> Result<usize, DialectError> {
    let part = serde_json::json!({"text": turn});
    let last = match contents.last() {
        Some(raw) => serde_json::from_str::<Value>(raw.get())?,
        None => Value::Null,
    };
    let last_is_user =
        last.is_object() && last.get("role").map_or(Some("user"), Value::as_str) == Some("user");
    if last_is_user {
        let mut last = last;
        let Some(Value::Array(parts)) = last.get_mut("parts") else {
            return Err(DialectError::BadMessage {
                index: contents.len() - 1,
                reason: "user entry without parts",
            });
        };
        parts.push(part);
        contents.pop();
        contents.push(serde_json::value::to_raw_value(&last)?);
    } else {
        contents.push(serde_json::value::to_raw_value(
            &serde_json::json!({"role": "user", "parts": [part]}),
        )?);
    }
    let snake = params.contains_key("generation_config");
    let key = if snake {
        "generation_config"
    } else {
        "generationConfig"
    };
    let mut config = match params.remove(key) {
        Some(Value::Object(config)) => config,
        _ => Map::new(),
    };
    for k in NOT_TEXT {
        config.remove(k);
    }
    let thinking = config
        .get("thinkingConfig")
        .and_then(|t| t.get("thinkingBudget"))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let asked = thinking.saturating_add(u64::from(max_output));
    config.remove("max_output_tokens");
    config.insert("maxOutputTokens".into(), asked.into());
    params.insert(key.into(), Value::Object(config));
    let has_tools = params
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    if has_tools {
        params.remove("tool_config");
        params.insert(
            "toolConfig".into(),
            serde_json::json!({"functionCallingConfig": {"mode": "NONE"}}),
        );
    }
    Ok(usize::try_from(asked).unwrap_or(usize::MAX))
}

// ---------------------------------------------------------------------------------------------
// Answers.

/// Gemini's refusal for length: `The input token count (M) exceeds the maximum number of
/// tokens allowed (N).` (status `INVALID_ARGUMENT`).
pub(crate) static REFUSAL: RefusalWording = RefusalWording {
    phrases: &["exceeds the maximum number of tokens allowed"],
    window_after: &["maximum number of tokens allowed ("],
    window_between: None,
    requested_after: &["input token count ("],
    fields: None,
};

/// Gemini's `usageMetadata`: the prompt count includes cached tokens
/// (`cachedContentTokenCount`); thoughts are billed as output; no cache writes.
pub(crate) fn usage(f: &UsageFields) -> Option<Usage> {
    (f.prompt_token_count.is_some() || f.candidates_token_count.is_some()).then(|| Usage {
        input: f.prompt_token_count.unwrap_or(0),
        output: f
            .candidates_token_count
            .unwrap_or(0)
            .saturating_add(f.thoughts_token_count.unwrap_or(0)),
        cache_read: f.cached_content_token_count.unwrap_or(0),
        cache_write: 0,
    })
}
