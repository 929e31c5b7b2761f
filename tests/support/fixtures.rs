//! The real agent transcripts under `tests/fixtures/transcripts/` (SWE-agent, MIT): their
//! names and readers. A missing or malformed fixture panics naming the file, so a test never
//! passes on an empty conversation.

use std::path::PathBuf;

use serde_json::Value;

/// Every transcript, smallest first.
pub const TRANSCRIPTS: [&str; 4] = [
    "swe-agent-function-calling-simple.json",
    "swe-agent-marshmallow-function-calling.json",
    "swe-agent-ctf-katy.json",
    "swe-agent-ctf-web.json",
];

/// The path of transcript `name`.
pub fn transcript_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/transcripts")
        .join(name)
}

/// The Chat Completions `messages` of transcript `name`.
pub fn transcript(name: &str) -> Vec<Value> {
    let path = transcript_path(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("read fixture {}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("fixture {} is not JSON: {e}", path.display()));
    match v.get("messages").and_then(Value::as_array) {
        Some(messages) if !messages.is_empty() => messages.clone(),
        _ => panic!("fixture {} has no messages", path.display()),
    }
}
