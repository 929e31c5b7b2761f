//! Reading recordings: dialect detection from a body's shape, and a transcript cut into the
//! requests an agent sends while producing it (see the parent module).

use std::path::{Path, PathBuf};

use bytes::Bytes;
use serde_json::{Map, Value};

use super::{ReplayError, DEFAULT_ANTHROPIC_MODEL, DEFAULT_GEMINI_MODEL, DEFAULT_OPENAI_MODEL};
use crate::dialect::DialectKind;

/// What a recording file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One conversation, replayed step by step.
    Transcript,
    /// Complete requests, one per line.
    Requests,
}

impl Format {
    /// `transcript` or `requests`.
    pub fn label(self) -> &'static str {
        match self {
            Format::Transcript => "transcript",
            Format::Requests => "requests",
        }
    }
}

/// One request of a replay.
#[derive(Debug, Clone)]
pub struct Step {
    /// Its wire format.
    pub dialect: DialectKind,
    /// Messages (Responses: input items) it carries.
    pub messages: usize,
    /// Its `model` field.
    pub model: Option<String>,
    /// Output tokens it reserves (`max_completion_tokens`, `max_tokens`, `max_output_tokens`).
    pub requested_output: Option<usize>,
    /// The request body.
    pub body: Bytes,
}

/// A recording cut into the requests to replay.
#[derive(Debug, Clone)]
pub struct Recording {
    /// Where it was read from.
    pub path: PathBuf,
    /// Transcript or requests.
    pub format: Format,
    /// The requests, in order.
    pub steps: Vec<Step>,
}

/// The dialect of a request body, from its shape: a `messages` array is Anthropic Messages
/// when the body has a top-level `system` or a message holds a `tool_use` or `tool_result`
/// block, Chat Completions otherwise; a body with `input` (and no `messages`) is Responses.
pub fn detect(request: &Map<String, Value>) -> Option<DialectKind> {
    DialectKind::detect(request)
}

/// Whether an item of the history was produced by the model: an assistant message, and for
/// Responses also `reasoning` and `*_call` items (`function_call`, ...; not their outputs).
fn is_model_output(dialect: DialectKind, item: &Value) -> bool {
    let role = item.get("role").and_then(Value::as_str);
    if role == Some("assistant") || (dialect == DialectKind::Gemini && role == Some("model")) {
        return true;
    }
    dialect == DialectKind::Responses
        && item
            .get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| t == "reasoning" || t.ends_with("_call"))
}

/// How many items of `history` each request of a replay carries: one request before each
/// assistant turn (Chat Completions and Messages: each assistant message, one response each;
/// Responses: each run of model output items, one response), plus one with the whole history
/// when it does not end with an assistant turn.
pub fn step_ends(dialect: DialectKind, history: &[Value]) -> Vec<usize> {
    let output = |i: usize| is_model_output(dialect, &history[i]);
    let mut ends: Vec<usize> = (1..history.len())
        .filter(|&i| output(i) && (dialect != DialectKind::Responses || !output(i - 1)))
        .collect();
    if !history.is_empty() && !output(history.len() - 1) {
        ends.push(history.len());
    }
    ends
}

/// Reads a recording: a JSONL file of requests, or a JSON transcript cut into steps.
pub fn load(path: &Path) -> Result<Recording, ReplayError> {
    let bytes = std::fs::read(path).map_err(|error| ReplayError::Read {
        path: path.to_path_buf(),
        error,
    })?;
    let jsonl = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl") || e.eq_ignore_ascii_case("ndjson"));
    let (format, steps) = if jsonl {
        (Format::Requests, requests(path, &bytes)?)
    } else {
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(value) => (Format::Transcript, transcript(path, value)?),
            Err(_) if looks_like_jsonl(&bytes) => (Format::Requests, requests(path, &bytes)?),
            Err(error) => {
                return Err(ReplayError::Json {
                    path: path.to_path_buf(),
                    error,
                })
            }
        }
    };
    Ok(Recording {
        path: path.to_path_buf(),
        format,
        steps,
    })
}

fn lines(bytes: &[u8]) -> impl Iterator<Item = (usize, &[u8])> {
    bytes
        .split(|b| *b == b'\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim_ascii()))
        .filter(|(_, l)| !l.is_empty())
}

/// More than one non-empty line, the first a JSON object on its own.
fn looks_like_jsonl(bytes: &[u8]) -> bool {
    let mut lines = lines(bytes);
    let first = lines
        .next()
        .is_some_and(|(_, l)| matches!(serde_json::from_slice(l), Ok(Value::Object(_))));
    first && lines.next().is_some()
}

fn shape(path: &Path, reason: impl Into<String>) -> ReplayError {
    ReplayError::Shape {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The model and reserved output a request names.
fn model_and_output(request: &Map<String, Value>) -> (Option<String>, Option<usize>) {
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .map(String::from);
    let gemini = request
        .get("generationConfig")
        .and_then(|c| c.get("maxOutputTokens"));
    let output = ["max_completion_tokens", "max_tokens", "max_output_tokens"]
        .iter()
        .find_map(|k| request.get(*k))
        .or(gemini)
        .and_then(Value::as_u64)
        .and_then(|n| usize::try_from(n).ok());
    (model, output)
}

/// Messages (or Responses input items) a request carries.
fn item_count(request: &Map<String, Value>) -> usize {
    match (request.get("messages"), request.get("input")) {
        (Some(Value::Array(m)), _) => m.len(),
        (_, Some(Value::Array(items))) => items.len(),
        (_, Some(Value::String(_))) => 1,
        _ => request
            .get("contents")
            .and_then(Value::as_array)
            .map_or(0, Vec::len),
    }
}

fn step(dialect: DialectKind, request: &Map<String, Value>, body: Bytes) -> Step {
    let (model, requested_output) = model_and_output(request);
    Step {
        dialect,
        messages: item_count(request),
        model,
        requested_output,
        body,
    }
}

/// One complete request per non-empty line.
fn requests(path: &Path, bytes: &[u8]) -> Result<Vec<Step>, ReplayError> {
    let mut steps = Vec::new();
    for (line, text) in lines(bytes) {
        let value: Value = serde_json::from_slice(text).map_err(|error| ReplayError::JsonLine {
            path: path.to_path_buf(),
            line,
            error,
        })?;
        let Value::Object(request) = value else {
            return Err(shape(path, format!("line {line}: not a JSON object")));
        };
        let dialect = detect(&request).ok_or_else(|| {
            shape(
                path,
                format!("line {line}: a request needs a `messages` or an `input` array"),
            )
        })?;
        steps.push(step(dialect, &request, Bytes::copy_from_slice(text)));
    }
    if steps.is_empty() {
        return Err(shape(path, "no requests (the file is empty)"));
    }
    Ok(steps)
}

/// The request of `top`'s fields with the conversation under `key` written last, as agents
/// send it: the system prompt or instructions come before the conversation, as the provider
/// renders (and caches) the prompt. (A `Map` writes its keys sorted, which would put
/// `instructions` and `system` after `input` and `messages`, and the replay's modelled prompt
/// cache would then miss them on every request.)
fn conversation_last(top: &Map<String, Value>, key: &str, conversation: &Value) -> String {
    let mut body = Value::Object(top.clone()).to_string();
    body.pop(); // the closing brace
    if !top.is_empty() {
        body.push(',');
    }
    body.push_str(&Value::String(key.to_string()).to_string());
    body.push(':');
    body.push_str(&conversation.to_string());
    body.push('}');
    body
}

/// A conversation cut into the requests an agent sends while producing it.
fn transcript(path: &Path, value: Value) -> Result<Vec<Step>, ReplayError> {
    let mut top = match value {
        Value::Object(top) => top,
        Value::Array(messages) => {
            Map::from_iter([("messages".to_string(), Value::Array(messages))])
        }
        _ => {
            return Err(shape(
                path,
                "expected a JSON object or an array of messages",
            ))
        }
    };
    let dialect = detect(&top).ok_or_else(|| {
        shape(
            path,
            "expected a `messages` array (Chat Completions, Anthropic Messages), an `input` \
             (Responses), a `contents` array (Gemini), or one request per line (JSONL)",
        )
    })?;
    if !top.contains_key("model") {
        let model = match dialect {
            DialectKind::Messages => DEFAULT_ANTHROPIC_MODEL,
            DialectKind::ChatCompletions | DialectKind::Responses => DEFAULT_OPENAI_MODEL,
            DialectKind::Gemini => DEFAULT_GEMINI_MODEL,
        };
        top.insert("model".into(), Value::String(model.into()));
    }
    let key = dialect.conversation_field();
    let history = match top.remove(key) {
        Some(Value::Array(history)) => history,
        // A Responses `input` string: the whole conversation is one request.
        Some(other) => {
            top.insert(key.into(), other);
            let body = Bytes::from(Value::Object(top.clone()).to_string());
            return Ok(vec![step(dialect, &top, body)]);
        }
        None => Vec::new(),
    };
    let ends = step_ends(dialect, &history);
    if ends.is_empty() {
        return Err(shape(
            path,
            format!("no request to replay: `{key}` is empty"),
        ));
    }
    Ok(ends
        .into_iter()
        .map(|end| {
            let conversation = Value::Array(history[..end].to_vec());
            let body = Bytes::from(conversation_last(&top, key, &conversation));
            let mut request = top.clone();
            request.insert(key.into(), conversation);
            let (model, requested_output) = model_and_output(&request);
            Step {
                dialect,
                messages: end,
                model,
                requested_output,
                body,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            other => panic!("not an object: {other}"),
        }
    }

    #[test]
    fn dialects_are_told_apart_by_shape() {
        let chat = json!({"model": "gpt-4o", "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "ls", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "x"}]});
        assert_eq!(detect(&object(chat)), Some(DialectKind::ChatCompletions));

        let with_system =
            json!({"system": "be brief", "messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(detect(&object(with_system)), Some(DialectKind::Messages));

        let tool_blocks = json!({"messages": [
            {"role": "user", "content": "list"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "ls", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "a"}]}]});
        assert_eq!(detect(&object(tool_blocks)), Some(DialectKind::Messages));

        let responses = json!({"model": "gpt-4o", "input": [{"role": "user", "content": "hi"}]});
        assert_eq!(detect(&object(responses)), Some(DialectKind::Responses));
        let responses_text = json!({"input": "hi"});
        assert_eq!(
            detect(&object(responses_text)),
            Some(DialectKind::Responses)
        );

        assert_eq!(detect(&object(json!({"prompt": "hi"}))), None);
        assert_eq!(detect(&object(json!({"messages": "hi"}))), None);
    }

    #[test]
    fn requests_end_before_each_assistant_turn() {
        let roles = ["system", "user", "assistant", "tool", "assistant", "user"];
        let history: Vec<Value> = roles.iter().map(|r| json!({"role": r})).collect();
        assert_eq!(
            step_ends(DialectKind::ChatCompletions, &history),
            vec![2, 4, 6]
        );
        // Ending with an assistant turn: no request after it.
        assert_eq!(
            step_ends(DialectKind::ChatCompletions, &history[..5]),
            vec![2, 4]
        );
        // A leading assistant message is not preceded by a request.
        let leading = [json!({"role": "assistant"}), json!({"role": "user"})];
        assert_eq!(step_ends(DialectKind::Messages, &leading), vec![2]);

        // Responses: one response is a run of output items.
        let items = [
            json!({"role": "user", "content": "fix it"}),
            json!({"type": "reasoning", "summary": []}),
            json!({"type": "function_call", "call_id": "a", "name": "ls", "arguments": "{}"}),
            json!({"type": "function_call_output", "call_id": "a", "output": "x"}),
            json!({"type": "message", "role": "assistant", "content": []}),
        ];
        assert_eq!(step_ends(DialectKind::Responses, &items), vec![1, 4]);
    }

    fn temp_file(name: &str, contents: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(name);
        std::fs::write(&path, contents).expect("write");
        (dir, path)
    }

    fn body(step: &Step) -> Map<String, Value> {
        object(serde_json::from_slice(&step.body).expect("step body is JSON"))
    }

    #[test]
    fn a_transcript_becomes_growing_requests_with_its_other_fields() {
        let transcript = json!({"source": "test", "temperature": 0, "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"}]});
        let (_dir, path) = temp_file("t.json", &transcript.to_string());
        let rec = load(&path).expect("loads");
        assert_eq!(rec.format, Format::Transcript);
        assert_eq!(
            rec.steps.iter().map(|s| s.messages).collect::<Vec<_>>(),
            vec![2, 4]
        );
        for step in &rec.steps {
            let b = body(step);
            assert_eq!(step.dialect, DialectKind::ChatCompletions);
            assert_eq!(b["model"], DEFAULT_OPENAI_MODEL, "default model added");
            assert_eq!(b["temperature"], 0);
            let messages = b["messages"].as_array().expect("messages");
            assert_eq!(messages.len(), step.messages);
            assert_eq!(messages.last().expect("last")["role"], "user");
        }

        // The file's model wins; an Anthropic transcript keeps its `system`.
        let anthropic = json!({"model": "claude-opus-4-1", "system": "s", "max_tokens": 900,
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}]});
        let (_dir, path) = temp_file("a.json", &anthropic.to_string());
        let rec = load(&path).expect("loads");
        assert_eq!(rec.steps.len(), 2);
        assert!(rec.steps.iter().all(|s| s.dialect == DialectKind::Messages));
        assert_eq!(rec.steps[1].model.as_deref(), Some("claude-opus-4-1"));
        assert_eq!(rec.steps[1].requested_output, Some(900));
        assert_eq!(body(&rec.steps[0])["system"], "s");
        // The conversation comes last, after the system prompt, so each request starts with
        // the bytes the one before started with, as a provider's prompt cache reads them.
        for step in &rec.steps {
            let text = std::str::from_utf8(&step.body).expect("utf-8");
            assert!(
                text.find("\"system\"") < text.find("\"messages\""),
                "{text}"
            );
            assert!(text.ends_with("]}"), "{text}");
        }
        let (first, second) = (&rec.steps[0].body, &rec.steps[1].body);
        assert!(second.starts_with(&first[..first.len() - 2]), "{second:?}");
    }

    #[test]
    fn jsonl_lines_are_complete_requests_detected_one_by_one() {
        let lines = [
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "a"}]}),
            json!({"model": "claude-sonnet-4-5", "system": "s", "messages": [{"role": "user", "content": "a"}]}),
            json!({"model": "gpt-4o", "input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}),
        ];
        let text: String = lines.iter().map(|l| format!("{l}\n\n")).collect();
        // Detected from the content even without the extension.
        for name in ["r.jsonl", "r.json"] {
            let (_dir, path) = temp_file(name, &text);
            let rec = load(&path).expect("loads");
            assert_eq!(rec.format, Format::Requests);
            let dialects: Vec<_> = rec.steps.iter().map(|s| s.dialect).collect();
            assert_eq!(
                dialects,
                [
                    DialectKind::ChatCompletions,
                    DialectKind::Messages,
                    DialectKind::Responses
                ]
            );
            assert_eq!(rec.steps[2].messages, 2);
            assert_eq!(&rec.steps[0].body[..], lines[0].to_string().as_bytes());
        }

        let (_dir, path) = temp_file("bad.jsonl", "{\"messages\": []}\n{not json\n");
        let err = load(&path).expect_err("line 2 is not JSON").to_string();
        assert!(err.contains("line 2"), "{err}");
    }

    #[test]
    fn unreadable_recordings_are_named_errors() {
        let err = load(Path::new("/nonexistent/replay.json")).expect_err("missing");
        assert!(matches!(err, ReplayError::Read { .. }));
        assert!(
            err.to_string().contains("/nonexistent/replay.json"),
            "{err}"
        );

        let (_dir, path) = temp_file("x.json", "{\"prompt\": \"hi\"}");
        let err = load(&path).expect_err("no messages").to_string();
        assert!(err.contains("`messages`"), "{err}");

        let (_dir, path) = temp_file("e.json", "{\"messages\": []}");
        assert!(matches!(load(&path), Err(ReplayError::Shape { .. })));

        let (_dir, path) = temp_file("n.json", "{\"messages\": [");
        assert!(matches!(load(&path), Err(ReplayError::Json { .. })));
    }
}
