//! Session memory over real sockets (docs/architecture.md, *Sessions in a stateless proxy*):
//! the proxy remembers what it compacted and splices the same summary into every later request
//! of the conversation, recognises the conversation by content whatever its serialisation,
//! treats an edited history as new, keeps tenants apart, compacts a prefix once however many
//! requests need it at the same time, and names every conversation in `x-compactor-session`.
//!
//! One mock serves both sides, as in production with the zero-config `openai` summarizer: a
//! request whose last user message starts with `<task>` is a summarizer call, answered
//! `SUMMARY-<n>` with a fresh `n` per call; everything else is the agent's request, checked
//! against OpenAI's rules (`support::provider_rules`) and answered with a completion. The admin
//! API, the per-session breaker and store eviction are in `tests/sessions_admin.rs`.

mod support;

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use compactor::compaction::prompt::SUMMARY_INTRO;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use support::provider_rules::{check_chat, rejection_body};
use support::summary_calls::{self, prompt_of, received_since, summary_prompt, Summaries};
use support::{
    eventually, transcript, upstream_toml, Exchange, MockUpstream, Recorded, Reply, TestClient,
    TestProxy, TRANSCRIPTS,
};

/// The mock provider's context window (its own count, 4 characters a token): gpt-4o's.
const WINDOW: usize = 128_000;

const CHAT: &str = "/v1/chat/completions";
const AUTH: &str = "Bearer sk-sessions";
const COMPACTIONS: &str = "compactor_compactions_total";
const LOOKUPS: &str = "compactor_checkpoint_lookups_total";

/// The system message, then the fixture's other messages repeated until there are more than
/// `min` messages. Tool call ids get a per-repetition suffix so every call stays paired with
/// its own result.
fn repeated(messages: &[Value], min: usize) -> Vec<Value> {
    let mut out = vec![messages[0].clone()];
    let mut rep = 0;
    while out.len() <= min {
        for m in &messages[1..] {
            let mut m = m.clone();
            if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
                for call in calls {
                    let id = format!("{}-r{rep}", call["id"].as_str().expect("call id"));
                    call["id"] = json!(id);
                }
            }
            if let Some(id) = m.get("tool_call_id").and_then(Value::as_str) {
                m["tool_call_id"] = json!(format!("{id}-r{rep}"));
            }
            out.push(m);
        }
        rep += 1;
    }
    out
}

/// The agent's requests while producing `messages`: `(i, body)` where the request before
/// assistant message `i` carries `messages[..i]`.
fn steps(messages: &[Value]) -> Vec<(usize, Vec<u8>)> {
    messages
        .iter()
        .enumerate()
        .filter(|(i, m)| *i > 0 && m["role"] == "assistant")
        .map(|(i, _)| (i, request_body(&messages[..i])))
        .collect()
}

fn request_body(messages: &[Value]) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "gpt-4o", "messages": messages})).expect("serialise")
}

/// A completion that also reports `usage`, as providers do.
fn completion(content: &str) -> Value {
    let mut c = summary_calls::completion(content);
    c["usage"] = json!({"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12});
    c
}

/// The mock provider's state.
#[derive(Default)]
struct Provider {
    /// Summarizer calls; call `n` is answered `SUMMARY-<n>`, held while the test says so.
    summarizer: Summaries,
    /// Every request the provider refused, and why.
    rejected: Mutex<Vec<String>>,
}

impl Provider {
    fn install(mock: &MockUpstream) -> Arc<Provider> {
        let provider = Arc::new(Provider::default());
        let p = provider.clone();
        mock.set_handler(move |req: &Recorded| p.answer(req));
        provider
    }

    fn answer(&self, req: &Recorded) -> Reply {
        if req.path() != CHAT {
            return Reply::json(200, &json!({"object": "list", "data": []}));
        }
        let v: Value = match serde_json::from_slice(&req.body) {
            Ok(v) => v,
            Err(e) => {
                self.reject(format!("{} not JSON: {e}", req.path()));
                return Reply::json(400, &json!({"error": {"message": "invalid JSON"}}));
            }
        };
        if let Err(rejection) = check_chat(&v, WINDOW) {
            self.reject(format!("{rejection:?}"));
            return Reply::json(400, &rejection_body(&rejection));
        }
        if summary_prompt(&v).is_none() {
            return Reply::json(200, &completion("Next step."));
        }
        self.summarizer.answer(completion)
    }

    fn reject(&self, why: String) {
        self.rejected.lock().expect("lock").push(why);
    }

    fn summaries(&self) -> usize {
        self.summarizer.count()
    }

    fn rejected(&self) -> Vec<String> {
        self.rejected.lock().expect("lock").clone()
    }
}

/// POSTs a chat request with `Authorization: auth` and any extra headers.
async fn chat(
    client: &TestClient,
    proxy: &TestProxy,
    auth: &str,
    extra: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Exchange {
    let mut headers = vec![
        ("content-type", "application/json"),
        ("authorization", auth),
    ];
    headers.extend_from_slice(extra);
    client
        .exchange("POST", &proxy.url(CHAT), &headers, body.into())
        .await
}

/// The messages of a body, each exactly as its bytes appear in it.
fn raw_messages(body: &[u8]) -> Vec<String> {
    #[derive(serde::Deserialize)]
    struct Wire {
        messages: Vec<Box<RawValue>>,
    }
    let wire: Wire = serde_json::from_slice(body).expect("chat body");
    wire.messages
        .into_iter()
        .map(|m| m.get().to_owned())
        .collect()
}

fn messages_of(body: &[u8]) -> Vec<Value> {
    raw_messages(body)
        .iter()
        .map(|m| serde_json::from_str(m).expect("message JSON"))
        .collect()
}

/// `SUMMARY-<n>` out of a summary message's text (the summary sits between the introduction
/// and the file lists).
fn summary_name(text: &str) -> &str {
    let rest = text
        .strip_prefix(SUMMARY_INTRO)
        .unwrap_or_else(|| panic!("not a summary message: {text:.200}"));
    rest.trim_start().split("\n\n").next().unwrap_or("")
}

/// The start of the `<prior-summary>` block refining `summary` (the engine may follow the
/// summary with the pinned latest user turn inside the block).
fn prior_block(summary: &str) -> String {
    format!("<prior-summary>\n{summary}\n")
}

/// Checks a rewritten request against what the client sent: system prompt first, a summary
/// message, then a non-empty verbatim suffix of the client's messages. Returns the summary
/// message's raw bytes and the summary it carries.
fn check_rewrite(what: &str, sent: &[Value], forwarded: &[u8]) -> (String, String) {
    let raw = raw_messages(forwarded);
    let out = messages_of(forwarded);
    assert!(
        out.len() >= 4,
        "{what}: system, opening, summary and a tail"
    );
    assert_eq!(out[0], sent[0], "{what}: system message kept first");
    assert_eq!(out[1], sent[1], "{what}: the opening kept verbatim");
    assert_eq!(
        out[2]["role"], "user",
        "{what}: the summary is a user message"
    );
    let text = out[2]["content"].as_str().expect("summary text");
    let tail = &out[3..];
    assert!(
        tail.len() < sent.len() - 2,
        "{what}: something was compacted"
    );
    assert_eq!(
        tail,
        &sent[sent.len() - tail.len()..],
        "{what}: the tail is a verbatim suffix of what the client sent"
    );
    (raw[2].clone(), summary_name(text).to_owned())
}

/// Sum of `compactor_compactions_total` over the automatic triggers for one outcome.
async fn automatic_compactions(proxy: &TestProxy, outcome: &str) -> f64 {
    let text = proxy.metrics().await;
    ["messages", "tokens"]
        .iter()
        .map(|t| {
            support::metric_value(&text, COMPACTIONS, &[("trigger", t), ("outcome", outcome)])
                .unwrap_or(0.0)
        })
        .sum()
}

async fn lookups(proxy: &TestProxy, result: &str) -> f64 {
    proxy
        .metric(LOOKUPS, &[("result", result)])
        .await
        .unwrap_or(0.0)
}

async fn admin_session(proxy: &TestProxy, id: &str) -> Value {
    let (status, text) = TestClient::http1()
        .get_text(&proxy.admin_url(&format!("/session/{id}")))
        .await;
    assert_eq!(status, 200, "GET /session/{id}: {text}");
    serde_json::from_str(&text).expect("session JSON")
}

/// Compaction by message count alone: no background summaries, and no cost trigger (the
/// mock's summaries are a few tokens long, which makes compacting pay after every request or
/// two, and these tests follow the count's compactions).
fn proxy_toml(mock: &MockUpstream, max_messages: usize) -> String {
    format!(
        "{}[compaction]\nmax_messages = {max_messages}\nbackground_ratio = 0\ncost_trigger = false\n",
        upstream_toml(&mock.url())
    )
}

/// Where one replayed conversation stands.
#[derive(Default)]
struct Conversation {
    session: Option<String>,
    /// Number of the compaction whose summary is being forwarded (0: none yet).
    num: u32,
    /// That summary (`SUMMARY-<n>`) and its message's bytes.
    summary: String,
    summary_message: String,
}

#[tokio::test]
async fn long_sessions_reuse_one_summary_per_compaction_and_refine_it() {
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let proxy = TestProxy::start(&proxy_toml(&mock, 30)).await;
    let client = TestClient::http1();
    let mut calls = 0usize;
    let mut sessions: Vec<(String, Conversation)> = Vec::new();

    for name in TRANSCRIPTS {
        let messages = repeated(&transcript(name), 100);
        assert!(messages.len() > 100, "{name}: {}", messages.len());
        let mut c = Conversation::default();
        for (i, body) in steps(&messages) {
            let what = format!("{name} request of {i} messages");
            let seen = mock.requests().len();
            let ex = chat(&client, &proxy, AUTH, &[], body.clone()).await;
            assert_eq!(
                ex.status,
                200,
                "{what}: {} (refused: {:?})",
                String::from_utf8_lossy(&ex.body),
                provider.rejected()
            );
            let answer: Value = serde_json::from_slice(&ex.body).expect("completion");
            assert_eq!(answer["choices"][0]["message"]["content"], "Next step.");
            let (summaries, forwarded) = received_since(&mock, seen);
            assert_eq!(forwarded.len(), 1, "{what}: one forwarded request");
            let forwarded = &forwarded[0];
            assert_eq!(forwarded.header("authorization"), Some(AUTH), "{what}");

            let id = ex
                .header("x-compactor-session")
                .expect("x-compactor-session");
            match &c.session {
                None => c.session = Some(id.to_owned()),
                Some(s) => assert_eq!(s, id, "{what}: one derived session id per conversation"),
            }

            if c.num == 0 && summaries.is_empty() {
                assert_eq!(
                    forwarded.body, body,
                    "{what}: untouched before any compaction"
                );
                assert_eq!(ex.header("x-compactor-compacted"), Some("false"), "{what}");
                assert_eq!(ex.compaction_num(), None, "{what}");
                continue;
            }
            assert_eq!(
                ex.header("x-compactor-compacted"),
                Some("true"),
                "{what}: from the first compaction on, every request carries a summary"
            );
            let before: usize = ex
                .header("x-compactor-tokens-before")
                .expect("before")
                .parse()
                .expect("n");
            let after: usize = ex
                .header("x-compactor-tokens-after")
                .expect("after")
                .parse()
                .expect("n");
            assert!(after < before, "{what}: {after} < {before}");
            let num = ex.compaction_num().expect("x-compactor-compaction-num");
            let (message, summary) = check_rewrite(&what, &messages[..i], &forwarded.body);

            if summaries.is_empty() {
                assert_eq!(num, c.num, "{what}: no summarizer call, same compaction");
                assert_eq!(
                    message, c.summary_message,
                    "{what}: the summary message is byte-identical until the next compaction"
                );
                continue;
            }
            assert_eq!(
                summaries.len(),
                1,
                "{what}: one summarizer call per compaction"
            );
            calls += 1;
            let expected = format!("SUMMARY-{calls}");
            assert_eq!(summary, expected, "{what}: the new summary is forwarded");
            assert_eq!(
                num,
                c.num + 1,
                "{what}: x-compactor-compaction-num increments"
            );
            let call = &summaries[0];
            assert_eq!(call.path(), CHAT, "{what}");
            assert_eq!(
                call.header("authorization"),
                Some(AUTH),
                "{what}: caller's key"
            );
            let prompt = prompt_of(call).expect("prompt");
            if c.num == 0 {
                assert!(
                    !prompt.contains("<prior-summary>\n"),
                    "{what}: first compaction"
                );
            } else {
                assert!(
                    prompt.contains(&prior_block(&c.summary)),
                    "{what}: compaction #{num} refines {}: {prompt:.3000}",
                    c.summary
                );
            }
            c.num = num;
            c.summary = summary;
            c.summary_message = message;
        }
        assert!(
            c.num >= 3,
            "{name}: a 100+ message session compacts several times ({})",
            c.num
        );
        sessions.push((name.to_owned(), c));
    }

    assert_eq!(
        provider.rejected(),
        Vec::<String>::new(),
        "no request refused"
    );
    assert_eq!(
        calls,
        provider.summaries(),
        "every summarizer call accounted for"
    );
    assert_eq!(
        automatic_compactions(&proxy, "compacted").await,
        calls as f64,
        "summarizer calls == compactions"
    );
    for outcome in ["failed", "blank", "breaker"] {
        assert_eq!(
            automatic_compactions(&proxy, outcome).await,
            0.0,
            "{outcome}"
        );
    }
    assert!(lookups(&proxy, "hit").await > 0.0);

    // Each conversation is its own session, and the admin API agrees with the replay.
    let mut ids: Vec<&String> = sessions
        .iter()
        .filter_map(|(_, c)| c.session.as_ref())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(
        ids.len(),
        TRANSCRIPTS.len(),
        "distinct session ids: {ids:?}"
    );
    for (name, c) in &sessions {
        let info = admin_session(&proxy, c.session.as_deref().expect("id")).await;
        assert_eq!(info["compactions"], c.num, "{name}: {info}");
        assert_eq!(info["latest"]["compaction_num"], c.num, "{name}: {info}");
        // The stored summary may carry the pinned latest user turn after the summarizer's text.
        let stored = info["latest"]["summary"].as_str().expect("summary");
        let text = stored.split("\n\n<latest-user-message>").next();
        assert_eq!(text, Some(c.summary.as_str()), "{name}: {info}");
    }
    proxy.shutdown().await;
}

/// Writes `v` as pretty-printed JSON with every object's keys in reverse order and every `/`
/// escaped as `\/`: the same value, other bytes.
fn reserialise(v: &Value, indent: usize, out: &mut String) {
    let pad = |out: &mut String, n: usize| out.push_str(&"  ".repeat(n));
    match v {
        Value::Object(map) => {
            out.push_str("{\n");
            let entries: Vec<(&String, &Value)> = map.iter().rev().collect();
            for (i, (k, item)) in entries.iter().enumerate() {
                pad(out, indent + 1);
                out.push_str(&serde_json::to_string(k).expect("key"));
                out.push_str(" :  ");
                reserialise(item, indent + 1, out);
                if i + 1 < entries.len() {
                    out.push(',');
                }
                out.push('\n');
            }
            pad(out, indent);
            out.push('}');
        }
        Value::Array(items) => {
            out.push_str("[\n");
            for (i, item) in items.iter().enumerate() {
                pad(out, indent + 1);
                reserialise(item, indent + 1, out);
                if i + 1 < items.len() {
                    out.push(',');
                }
                out.push('\n');
            }
            pad(out, indent);
            out.push(']');
        }
        Value::String(s) => out.push_str(
            &serde_json::to_string(s)
                .expect("string")
                .replace('/', "\\/"),
        ),
        other => out.push_str(&other.to_string()),
    }
}

/// The request before assistant message `i` of a fixture (more than 20 messages: compaction
/// is due under `max_messages = 20`).
fn due_request(name: &str, i: usize) -> Vec<Value> {
    let messages = transcript(name);
    assert_eq!(messages[i]["role"], "assistant", "{name}[{i}]");
    assert!(i > 20);
    messages[..i].to_vec()
}

#[tokio::test]
async fn another_serialisation_of_the_same_history_hits_the_checkpoint() {
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let proxy = TestProxy::start(&proxy_toml(&mock, 20)).await;
    let client = TestClient::http1();
    let messages = due_request(TRANSCRIPTS[1], 22);
    let body = request_body(&messages);

    let seen = mock.requests().len();
    let first = chat(&client, &proxy, AUTH, &[], body.clone()).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("x-compactor-compacted"), Some("true"));
    assert_eq!(first.compaction_num(), Some(1));
    assert_eq!(provider.summaries(), 1);
    let (_, forwarded) = received_since(&mock, seen);
    let (message, summary) = check_rewrite("original", &messages, &forwarded[0].body);
    assert_eq!(summary, "SUMMARY-1");

    let mut variant = String::new();
    reserialise(
        &json!({"model": "gpt-4o", "messages": messages}),
        0,
        &mut variant,
    );
    assert_ne!(variant.as_bytes(), body.as_slice());
    assert_eq!(
        serde_json::from_str::<Value>(&variant).expect("still JSON"),
        serde_json::from_slice::<Value>(&body).expect("JSON"),
        "same value"
    );
    let (hits, misses) = (lookups(&proxy, "hit").await, lookups(&proxy, "miss").await);
    let seen = mock.requests().len();
    let again = chat(&client, &proxy, AUTH, &[], variant.clone()).await;
    assert_eq!(again.status, 200);
    assert_eq!(provider.summaries(), 1, "no new summarizer call");
    assert_eq!(again.header("x-compactor-compacted"), Some("true"));
    assert_eq!(again.compaction_num(), Some(1));
    assert_eq!(
        again.header("x-compactor-session"),
        first.header("x-compactor-session"),
        "the derived session id ignores serialisation"
    );
    assert_eq!(lookups(&proxy, "hit").await, hits + 1.0, "a hit is counted");
    assert_eq!(lookups(&proxy, "miss").await, misses);
    let (summaries, forwarded) = received_since(&mock, seen);
    assert!(summaries.is_empty());
    let (again_message, _) = check_rewrite("variant", &messages, &forwarded[0].body);
    assert_eq!(again_message, message, "the same summary message bytes");
    assert_eq!(
        messages_of(&forwarded[0].body),
        messages_of(&received_since(&mock, 0).1[0].body),
        "the same conversation is forwarded"
    );
    assert_eq!(provider.rejected(), Vec::<String>::new());
    proxy.shutdown().await;
}

#[tokio::test]
async fn an_edited_history_misses_and_compacts_fresh() {
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let proxy = TestProxy::start(&proxy_toml(&mock, 20)).await;
    let client = TestClient::http1();
    let messages = due_request(TRANSCRIPTS[2], 22);

    let first = chat(&client, &proxy, AUTH, &[], request_body(&messages)).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.compaction_num(), Some(1));
    assert_eq!(provider.summaries(), 1);
    let id = first
        .header("x-compactor-session")
        .expect("session")
        .to_owned();
    let covered = admin_session(&proxy, &id).await["latest"]["covered"]
        .as_u64()
        .expect("covered") as usize;

    // Edit a message inside the compacted prefix, but not the first two (which name the
    // session): same session, different history.
    let edited_at = 3;
    assert!(
        edited_at < covered,
        "the edit lies in the covered prefix ({covered})"
    );
    assert_eq!(messages[edited_at]["role"], "user");
    let mut edited = messages.clone();
    let original = edited[edited_at]["content"]
        .as_str()
        .expect("text")
        .to_owned();
    edited[edited_at]["content"] = json!(format!("EDITED-4471 {original}"));

    let (hits, misses) = (lookups(&proxy, "hit").await, lookups(&proxy, "miss").await);
    let seen = mock.requests().len();
    let ex = chat(&client, &proxy, AUTH, &[], request_body(&edited)).await;
    assert_eq!(ex.status, 200);
    assert_eq!(ex.header("x-compactor-session"), Some(id.as_str()));
    assert_eq!(
        lookups(&proxy, "miss").await,
        misses + 1.0,
        "a miss is counted"
    );
    assert_eq!(lookups(&proxy, "hit").await, hits);
    let (summaries, forwarded) = received_since(&mock, seen);
    assert_eq!(summaries.len(), 1, "compacted fresh");
    let prompt = prompt_of(&summaries[0]).expect("prompt");
    assert!(
        !prompt.contains("<prior-summary>\n"),
        "no prior summary: {prompt:.2000}"
    );
    assert!(
        prompt.contains("EDITED-4471"),
        "the edited history is summarised"
    );
    assert_eq!(ex.header("x-compactor-compacted"), Some("true"));
    assert_eq!(
        ex.compaction_num(),
        Some(1),
        "a new conversation's first compaction"
    );
    let (_, summary) = check_rewrite("edited", &edited, &forwarded[0].body);
    assert_eq!(summary, "SUMMARY-2", "the old summary is not spliced in");
    assert!(!String::from_utf8_lossy(&forwarded[0].body).contains("SUMMARY-1"));
    assert_eq!(provider.rejected(), Vec::<String>::new());
    proxy.shutdown().await;
}

#[tokio::test]
async fn tenants_with_identical_conversations_never_share_a_checkpoint() {
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let proxy = TestProxy::start(&proxy_toml(&mock, 20)).await;
    let client = TestClient::http1();
    let messages = due_request(TRANSCRIPTS[2], 22);
    let body = request_body(&messages);
    let (alice, bob) = ("Bearer sk-tenant-alice", "Bearer sk-tenant-bob");

    let a = chat(&client, &proxy, alice, &[], body.clone()).await;
    assert_eq!((a.status, a.compaction_num()), (200, Some(1)));
    assert_eq!(provider.summaries(), 1);

    let misses = lookups(&proxy, "miss").await;
    let seen = mock.requests().len();
    let b = chat(&client, &proxy, bob, &[], body.clone()).await;
    assert_eq!(b.status, 200);
    assert_eq!(lookups(&proxy, "miss").await, misses + 1.0, "bob misses");
    let (summaries, forwarded) = received_since(&mock, seen);
    assert_eq!(
        summaries.len(),
        1,
        "bob's request causes its own summarizer call"
    );
    assert_eq!(
        summaries[0].header("authorization"),
        Some(bob),
        "with bob's own credentials"
    );
    assert_eq!(forwarded[0].header("authorization"), Some(bob));
    assert_eq!(b.header("x-compactor-compacted"), Some("true"));
    assert_eq!(b.compaction_num(), Some(1));
    let (_, summary) = check_rewrite("bob", &messages, &forwarded[0].body);
    assert_eq!(summary, "SUMMARY-2", "bob never gets alice's summary");
    assert_ne!(
        a.header("x-compactor-session"),
        b.header("x-compactor-session"),
        "derived session ids include the tenant"
    );

    // Each tenant keeps its own checkpoint.
    for (auth, expected) in [(alice, "SUMMARY-1"), (bob, "SUMMARY-2")] {
        let seen = mock.requests().len();
        let ex = chat(&client, &proxy, auth, &[], body.clone()).await;
        assert_eq!(ex.header("x-compactor-compacted"), Some("true"));
        let (summaries, forwarded) = received_since(&mock, seen);
        assert!(summaries.is_empty(), "{auth}: reused");
        let (_, summary) = check_rewrite(auth, &messages, &forwarded[0].body);
        assert_eq!(summary, expected, "{auth}");
    }
    assert_eq!(provider.summaries(), 2);
    assert_eq!(provider.rejected(), Vec::<String>::new());
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_identical_requests_share_one_compaction() {
    const N: usize = 20;
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    provider.summarizer.hold();
    let proxy = Arc::new(TestProxy::start(&proxy_toml(&mock, 20)).await);
    let client = Arc::new(TestClient::http1());
    let messages = due_request(TRANSCRIPTS[2], 22);
    let body = Bytes::from(request_body(&messages));

    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let (client, proxy, body) = (client.clone(), proxy.clone(), body.clone());
            tokio::spawn(async move { chat(&client, &proxy, AUTH, &[], body).await })
        })
        .collect();

    // Release the summary only once all requests are inside the proxy and every one of them
    // has looked for a checkpoint (and missed: none exists until the summary is back).
    let (p, pr) = (&*proxy, &*provider);
    eventually(
        "all requests waiting on the one compaction",
        || async move {
            let in_flight = p
                .metric("compactor_in_flight_requests", &[])
                .await
                .unwrap_or(0.0);
            let missed = lookups(p, "miss").await;
            (pr.summarizer.held() >= 1 && in_flight >= N as f64 && missed >= N as f64).then_some(())
        },
    )
    .await;
    assert_eq!(
        provider.summaries(),
        1,
        "one summarizer call while all wait"
    );
    provider.summarizer.release().await;

    let mut exchanges = Vec::new();
    for task in tasks {
        exchanges.push(task.await.expect("request task"));
    }
    for (k, ex) in exchanges.iter().enumerate() {
        assert_eq!(
            ex.status,
            200,
            "request {k}: {}",
            String::from_utf8_lossy(&ex.body)
        );
        assert_eq!(
            ex.header("x-compactor-compacted"),
            Some("true"),
            "request {k}"
        );
        assert_eq!(ex.compaction_num(), Some(1), "request {k}");
    }
    assert_eq!(provider.summaries(), 1, "exactly one summarizer call");
    let (summaries, forwarded) = received_since(&mock, 0);
    assert_eq!(summaries.len(), 1);
    assert_eq!(forwarded.len(), N);
    for (k, f) in forwarded.iter().enumerate() {
        let (_, summary) = check_rewrite(&format!("forwarded {k}"), &messages, &f.body);
        assert_eq!(summary, "SUMMARY-1");
        assert_eq!(
            f.body, forwarded[0].body,
            "forwarded {k}: the same bytes for everyone"
        );
    }
    assert_eq!(automatic_compactions(&proxy, "compacted").await, 1.0);
    assert_eq!(automatic_compactions(&proxy, "failed").await, 0.0);
    assert_eq!(provider.rejected(), Vec::<String>::new());
}

#[tokio::test]
async fn every_chat_response_names_its_session() {
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let proxy = TestProxy::start(&upstream_toml(&mock.url())).await;
    let client = TestClient::http1();
    let system = json!({"role": "system", "content": "You are a coding agent."});
    let task = |t: &str| json!({"role": "user", "content": t});
    let reply = |t: &str| json!({"role": "assistant", "content": t});
    let a1 = vec![system.clone(), task("fix the parser")];
    let a2 = vec![
        system.clone(),
        task("fix the parser"),
        reply("Looking at parser.rs."),
        task("and add a test"),
    ];
    let b1 = vec![system.clone(), task("write the docs")];

    let id = |ex: &Exchange| -> String {
        assert_eq!(ex.status, 200, "{}", String::from_utf8_lossy(&ex.body));
        ex.header("x-compactor-session")
            .expect("x-compactor-session on every chat response")
            .to_owned()
    };
    let a = id(&chat(&client, &proxy, AUTH, &[], request_body(&a1)).await);
    assert_eq!(a.len(), 16, "a derived id is 16 hex digits: {a}");
    assert!(a.bytes().all(|b| b.is_ascii_hexdigit()), "{a}");
    assert_eq!(
        id(&chat(&client, &proxy, AUTH, &[], request_body(&a2)).await),
        a,
        "stable across the requests of one conversation"
    );
    let mut pretty = String::new();
    reserialise(&json!({"model": "gpt-4o", "messages": a2}), 0, &mut pretty);
    assert_eq!(
        id(&chat(&client, &proxy, AUTH, &[], pretty).await),
        a,
        "and across serialisations"
    );
    let b = id(&chat(&client, &proxy, AUTH, &[], request_body(&b1)).await);
    assert_ne!(b, a, "another conversation, another id");
    let other_tenant = id(&chat(&client, &proxy, "Bearer sk-other", &[], request_body(&a1)).await);
    assert_ne!(other_tenant, a, "another tenant, another id");

    // The client's header wins, kept as is when safe, hashed (stably) when not.
    let header = [("x-session-id", "agent-7.run:2")];
    let named = id(&chat(&client, &proxy, AUTH, &header, request_body(&a2)).await);
    assert_eq!(named, "agent-7.run:2");
    let unsafe_header = [("x-session-id", "my session/with spaces")];
    let hashed = id(&chat(&client, &proxy, AUTH, &unsafe_header, request_body(&a1)).await);
    assert_eq!(hashed.len(), 16, "{hashed}");
    assert_eq!(
        id(&chat(&client, &proxy, AUTH, &unsafe_header, request_body(&b1)).await),
        hashed
    );

    // Streamed answers and upstream errors carry it too.
    let mut stream = a2.clone();
    stream.push(reply("Done."));
    stream.push(task("stream it"));
    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "stream": true, "messages": stream}))
        .expect("body");
    mock.push(Reply::sse(&[
        r#"{"choices":[{"delta":{"content":"ok"}}]}"#,
        "[DONE]",
    ]));
    let ex = chat(&client, &proxy, AUTH, &[], body).await;
    assert_eq!(ex.header("content-type"), Some("text/event-stream"));
    assert_eq!(id(&ex), a);
    mock.push(Reply::status(429));
    let ex = chat(&client, &proxy, AUTH, &[], request_body(&a2)).await;
    assert_eq!(ex.status, 429);
    assert_eq!(ex.header("x-compactor-session"), Some(a.as_str()));
    assert_eq!(ex.header("x-compactor-compacted"), Some("false"));

    // Not a chat call: no session.
    let response = client.get(&proxy.url("/v1/models")).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("x-compactor-session").is_none());

    assert_eq!(provider.summaries(), 0, "nothing here needed a compaction");
    proxy.shutdown().await;
}

#[tokio::test]
async fn the_session_header_name_is_configurable() {
    let mock = MockUpstream::start().await;
    Provider::install(&mock);
    let proxy = TestProxy::start(&format!(
        "{}[session]\nheader = \"x-conversation\"\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let client = TestClient::http1();
    let body = request_body(&[json!({"role": "user", "content": "hi"})]);
    let ex = chat(
        &client,
        &proxy,
        AUTH,
        &[("x-conversation", "conv-1")],
        body.clone(),
    )
    .await;
    assert_eq!(ex.header("x-compactor-session"), Some("conv-1"));
    let ex = chat(&client, &proxy, AUTH, &[("x-session-id", "ignored")], body).await;
    let derived = ex.header("x-compactor-session").expect("session");
    assert_ne!(
        derived, "ignored",
        "only the configured header names a session"
    );
    assert_eq!(derived.len(), 16);
    proxy.shutdown().await;
}
