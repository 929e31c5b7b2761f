//! Telling compactor's summarizer calls apart from the agent's own requests at a mock OpenAI
//! provider (the zero-config `openai` summarizer asks the same upstream): a summarizer call's
//! last user message is the compaction prompt, which starts with `<task>`. Also the
//! `chat.completion` answer the mocks give both.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use bytes::Bytes;
use serde_json::{json, Value};

use super::mock::{MockUpstream, Recorded, Reply, StreamSender};

/// The compaction prompt of a request body, when it is a summarizer call: the standalone
/// prompt (the last user message of a Chat Completions or Messages body), or the turn asking
/// for the summary after the conversation itself (its last user message or item, whose last
/// text part is the prompt), in any of the three wire formats.
pub fn summary_prompt(body: &Value) -> Option<&str> {
    let items = body["messages"]
        .as_array()
        .or_else(|| body["input"].as_array())?;
    let last = items.iter().rev().find(|m| m["role"] == "user")?;
    let text = match &last["content"] {
        Value::String(text) => text.as_str(),
        Value::Array(parts) => parts.last()?["text"].as_str()?,
        _ => return None,
    };
    Some(text).filter(|t| t.starts_with("<task>"))
}

/// Whether a summarizer call asks inside the conversation (its prompt is the turn after the
/// conversation, not a standalone prompt holding one).
pub fn asked_inside(prompt: &str) -> bool {
    !prompt.contains("<conversation>")
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

/// A mock provider's summarizer answers: call `n` is answered `SUMMARY-<n>` (so a test can
/// tell which summary a request forwarded), and while held, answers wait until released (so
/// compactions overlap).
#[derive(Default)]
pub struct Summaries {
    count: AtomicUsize,
    hold: AtomicBool,
    held: Mutex<Vec<(StreamSender, Bytes)>>,
}

impl Summaries {
    /// Answers the next summarizer call with `completion("SUMMARY-<n>")`: at once, or, while
    /// held, with its head now and its body when released.
    pub fn answer(&self, completion: impl Fn(&str) -> Value) -> Reply {
        let n = self.count.fetch_add(1, Ordering::SeqCst) + 1;
        let answer = Bytes::from(completion(&format!("SUMMARY-{n}")).to_string());
        if !self.hold.load(Ordering::SeqCst) {
            return Reply::bytes(200, "application/json", answer);
        }
        let (reply, tx) = Reply::stream_channel(
            200,
            vec![("content-type".into(), "application/json".into())],
        );
        self.held.lock().expect("lock").push((tx, answer));
        reply
    }

    /// Holds every answer from now on.
    pub fn hold(&self) {
        self.hold.store(true, Ordering::SeqCst);
    }

    /// Summarizer calls so far.
    pub fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// Answers held now.
    pub fn held(&self) -> usize {
        self.held.lock().expect("lock").len()
    }

    /// Sends every held answer and ends its body.
    pub async fn release(&self) {
        let held = std::mem::take(&mut *self.held.lock().expect("lock"));
        for (tx, answer) in held {
            tx.send(answer).await.expect("summarizer still waiting");
        }
    }
}
