//! Telling compactor's summarizer calls apart from the agent's own requests at a mock OpenAI
//! provider (the zero-config `openai` summarizer asks the same upstream): a summarizer call's
//! last user message is the compaction prompt, which starts with `<task>`. Also the
//! `chat.completion` answer the mocks give both.

use serde_json::{json, Value};

use super::mock::{MockUpstream, Recorded};

/// The compaction prompt of a Chat Completions body, when it is a summarizer call.
pub fn summary_prompt(body: &Value) -> Option<&str> {
    body["messages"]
        .as_array()?
        .iter()
        .rev()
        .find(|m| m["role"] == "user")?["content"]
        .as_str()
        .filter(|c| c.starts_with("<task>"))
}

/// The compaction prompt of a recorded request, when it is a summarizer call.
pub fn prompt_of(r: &Recorded) -> Option<String> {
    let v: Value = serde_json::from_slice(&r.body).ok()?;
    summary_prompt(&v).map(str::to_owned)
}

/// Whether a recorded request is a summarizer call.
pub fn is_summary_request(r: &Recorded) -> bool {
    prompt_of(r).is_some()
}

/// Every request the mock received that is not a summarizer call (the agent's own), in order.
pub fn agent_requests(mock: &MockUpstream) -> Vec<Recorded> {
    mock.requests()
        .into_iter()
        .filter(|r| !is_summary_request(r))
        .collect()
}

/// What the mock received after its first `seen` requests: (summarizer calls, the rest).
pub fn received_since(mock: &MockUpstream, seen: usize) -> (Vec<Recorded>, Vec<Recorded>) {
    mock.requests()[seen..]
        .iter()
        .cloned()
        .partition(is_summary_request)
}

/// A `chat.completion` answering `content` (no `usage`).
pub fn completion(content: &str) -> Value {
    json!({
        "id": "chatcmpl-mock",
        "object": "chat.completion",
        "created": 0,
        "model": "gpt-4o",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "finish_reason": "stop"
        }]
    })
}
