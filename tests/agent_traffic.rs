//! Real agent traffic over real sockets (issue "Real agent traffic: never lose what the user
//! typed, never drop or skip a request"). Fixtures are written here in the shapes Claude Code
//! and Codex put on the wire, at realistic sizes, and replayed step by step through the proxy
//! against one mock provider that enforces each API's request rules (`support::*_rules`).
//!
//! 1. **The user's own words survive.**
//!    - Claude Code (Anthropic Messages), a long session that compacts about ten times: every
//!      person-turn is several text blocks, injected context first (`<system-reminder>` with a
//!      3–6 KB CLAUDE.md, a `/clear` command echo, `<local-command-stdout>`), the typed words
//!      last; system as blocks, thinking with signatures, `tool_use`/`tool_result` loops.
//!      With the `extractive` backend every forwarded request still holds every person-turn's
//!      typed words (verbatim in a kept message or inside the summary), the latest ones
//!      verbatim (kept, or pinned in `<latest-user-message>`), and is valid for Anthropic.
//!      With the `auto` backend the `<task>` prompt the provider receives puts the typed words
//!      first in each `<user>` block, before the injected context.
//!    - Codex (OpenAI Responses): `<environment_context>` and `<user_instructions>` as their own
//!      user messages, then the typed request; encrypted `reasoning` items, `shell`
//!      `function_call`s and their outputs, `store: false`. Same survival guarantee, and every
//!      forwarded reasoning item is one the client sent, unaltered, still right before the item
//!      it produced.
//! 2. **No request is dropped.** After the tenant has a checkpoint, empty message lists on all
//!    three routes, and one-message requests, reach the provider byte-identical and get its
//!    answer; nothing is counted as a panic.
//! 3. **A needed compaction is never skipped.** A request holding exactly the prefix an earlier
//!    checkpoint covers (more than `max_messages` messages) is compacted, or counted as failed.
//! 4. **System and developer messages are never lost.** A mid-conversation `system` message
//!    (Chat Completions) and `developer` message (Responses), swept over every valid position
//!    of the early conversation so that compaction boundaries land on it and right after it,
//!    are in every forwarded request through all later compactions, verbatim or inside the
//!    summary.

mod support;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use compactor::compaction::engine::{LATEST_USER_CLOSE, LATEST_USER_OPEN};
use compactor::compaction::prompt::SUMMARY_INTRO;
use serde_json::{json, Value};

use support::anthropic_rules::{check_messages, top_level_fields};
use support::provider_rules::{check_chat, Rejection};
use support::responses_rules::check_responses;
use support::summary_calls::{asked_inside, completion, prompt_of, received_since};
use support::{
    metric_value, pseudo_random_bytes, upstream_toml, Exchange, MockUpstream, Recorded, Reply,
    TestClient, TestProxy,
};

const CHAT: &str = "/v1/chat/completions";
const MESSAGES: &str = "/v1/messages";
const RESPONSES: &str = "/v1/responses";
const COMPACTIONS: &str = "compactor_compactions_total";

/// Claude Code's model, given a small window here so its sessions outgrow it many times. The
/// summarizer's output budget stays the production one (4,096 tokens for the `extractive`
/// backend, under the cap of a quarter of the window), so summaries nest and grow as they
/// would with a 200k window.
const CLAUDE_MODEL: &str = "claude-sonnet-4-5-20250929";
const CLAUDE_WINDOW: usize = 40_000;
/// Codex's model, likewise.
const CODEX_MODEL: &str = "gpt-5-codex";
const CODEX_WINDOW: usize = 12_000;
/// The window the mock enforces for any other model (the chat tests).
const CHAT_WINDOW: usize = 128_000;

// ---------------------------------------------------------------------------------------------
// The mock provider
// ---------------------------------------------------------------------------------------------

/// One mock provider for the three APIs: summarizer calls (a last user message starting with
/// `<task>`) are answered `SUMMARY-<n>`; agent requests are checked against their API's rules
/// and the model's window, then answered (streamed when they asked for a stream).
#[derive(Default)]
struct Provider {
    summaries: AtomicUsize,
    refused: Mutex<Vec<String>>,
    /// Refuse summaries asked inside the conversation (a provider that does not take that
    /// shape), so the standalone prompt follows.
    refuse_inside: AtomicBool,
    /// Summaries asked inside the conversation and refused.
    refused_inside: AtomicUsize,
}

impl Provider {
    fn install(mock: &MockUpstream) -> Arc<Provider> {
        let provider = Arc::new(Provider::default());
        let p = provider.clone();
        mock.set_handler(move |req: &Recorded| p.answer(req));
        provider
    }

    fn answer(&self, req: &Recorded) -> Reply {
        let v: Value = match serde_json::from_slice(&req.body) {
            Ok(v) => v,
            Err(e) => return self.refuse(format!("{}: not JSON: {e}", req.path())),
        };
        if let Some(prompt) = prompt_of(req) {
            if asked_inside(&prompt) && self.refuse_inside.load(Ordering::SeqCst) {
                self.refused_inside.fetch_add(1, Ordering::SeqCst);
                return Reply::json(
                    400,
                    &json!({"type": "error", "error": {"type": "invalid_request_error",
                        "message": "this endpoint takes no summary inside a conversation"}}),
                );
            }
            let n = self.summaries.fetch_add(1, Ordering::SeqCst) + 1;
            let text = format!("SUMMARY-{n}");
            return match req.path() {
                MESSAGES => Reply::json(200, &anthropic_message(&text)),
                RESPONSES => Reply::json(200, &responses_answer(&text)),
                _ => Reply::json(200, &completion(&text)),
            };
        }
        let window = match v["model"].as_str() {
            Some(CLAUDE_MODEL) => CLAUDE_WINDOW,
            Some(CODEX_MODEL) => CODEX_WINDOW,
            _ => CHAT_WINDOW,
        };
        let verdict = match req.path() {
            CHAT => check_chat(&v, window),
            MESSAGES => check_messages(&v, window),
            RESPONSES => check_responses(&v, window),
            other => Err(Rejection::Invalid(format!("unexpected path {other}"))),
        };
        if let Err(rejection) = verdict {
            return self.refuse(format!("{}: {rejection:?}", req.path()));
        }
        let stream = v["stream"] == true;
        match (req.path(), stream) {
            (MESSAGES, true) => anthropic_stream("Next step."),
            (MESSAGES, false) => Reply::json(200, &anthropic_message("Next step.")),
            (RESPONSES, true) => responses_stream("Next step."),
            (RESPONSES, false) => Reply::json(200, &responses_answer("Next step.")),
            _ => Reply::json(200, &completion("Next step.")),
        }
    }

    fn refuse(&self, why: String) -> Reply {
        self.refused.lock().expect("lock").push(why.clone());
        Reply::json(
            400,
            &json!({"type": "error", "error": {"type": "invalid_request_error", "message": why}}),
        )
    }

    fn summaries(&self) -> usize {
        self.summaries.load(Ordering::SeqCst)
    }

    fn refused(&self) -> Vec<String> {
        self.refused.lock().expect("lock").clone()
    }
}

fn anthropic_message(text: &str) -> Value {
    json!({
        "id": "msg_01MockAnswer", "type": "message", "role": "assistant", "model": CLAUDE_MODEL,
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn", "stop_sequence": null,
        "usage": {"input_tokens": 12, "output_tokens": 4}
    })
}

fn responses_answer(text: &str) -> Value {
    json!({
        "id": "resp_mock", "object": "response", "status": "completed", "model": CODEX_MODEL,
        "output": [{"type": "message", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    })
}

/// A `text/event-stream` reply of named events.
fn named_events(events: &[(&str, Value)]) -> Reply {
    Reply::Chunks {
        status: 200,
        headers: vec![
            ("content-type".into(), "text/event-stream".into()),
            ("cache-control".into(), "no-cache".into()),
        ],
        chunks: events
            .iter()
            .map(|(name, data)| Bytes::from(format!("event: {name}\ndata: {data}\n\n")))
            .collect(),
    }
}

fn anthropic_stream(text: &str) -> Reply {
    named_events(&[
        (
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_01MockAnswer", "type": "message",
                "role": "assistant", "model": CLAUDE_MODEL, "content": [], "stop_reason": null,
                "usage": {"input_tokens": 12, "output_tokens": 1}}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 4}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ])
}

fn responses_stream(text: &str) -> Reply {
    named_events(&[
        (
            "response.created",
            json!({"type": "response.created", "sequence_number": 0,
                   "response": {"id": "resp_mock", "status": "in_progress"}}),
        ),
        (
            "response.output_text.delta",
            json!({"type": "response.output_text.delta", "sequence_number": 1,
                   "output_index": 0, "content_index": 0, "delta": text}),
        ),
        (
            "response.completed",
            json!({"type": "response.completed", "sequence_number": 2, "response": responses_answer(text)}),
        ),
    ])
}

// ---------------------------------------------------------------------------------------------
// The proxy and the client
// ---------------------------------------------------------------------------------------------

/// The proxy in front of `mock`: `compaction` lines under `[compaction]` (calibration off: the
/// mock's `usage` figures are not real), the given summarizer backend, and the agents' models
/// with their small windows.
fn proxy_toml(mock: &MockUpstream, compaction: &str, backend: &str) -> String {
    format!(
        "{}[compaction]\ncalibration = false\nbackground_ratio = 0\n{compaction}\
         [summarizer]\nbackend = \"{backend}\"\n\
         [models.\"{CLAUDE_MODEL}\"]\ncontext_window = {CLAUDE_WINDOW}\n\
         [models.\"{CODEX_MODEL}\"]\ncontext_window = {CODEX_WINDOW}\n",
        upstream_toml(&mock.url())
    )
}

/// Request headers: Anthropic's (`x-api-key`) on the Messages route, a bearer token elsewhere.
fn headers_for(path: &str, key: &str) -> Vec<(String, String)> {
    let mut h = vec![("content-type".to_owned(), "application/json".to_owned())];
    if path == MESSAGES {
        h.push(("x-api-key".into(), key.into()));
        h.push(("anthropic-version".into(), "2023-06-01".into()));
        h.push((
            "anthropic-beta".into(),
            "interleaved-thinking-2025-05-14".into(),
        ));
    } else {
        h.push(("authorization".into(), format!("Bearer {key}")));
    }
    h
}

/// One request through the proxy, and what the provider received because of it.
struct Sent {
    ex: Exchange,
    /// Summarizer calls it caused.
    summaries: Vec<Recorded>,
    /// The agent request the provider received.
    forwarded: Recorded,
}

impl Sent {
    fn forwarded_json(&self) -> Value {
        serde_json::from_slice(&self.forwarded.body).expect("forwarded body is JSON")
    }

    fn compacted(&self) -> bool {
        self.ex.header("x-compactor-compacted") == Some("true")
    }

    /// Old outputs masked (`mask`, `hybrid`) and no summary: the estimate went down.
    fn masked(&self) -> bool {
        !self.compacted()
            && self.ex.header("x-compactor-tokens-before")
                != self.ex.header("x-compactor-tokens-after")
    }
}

async fn send(
    client: &TestClient,
    proxy: &TestProxy,
    mock: &MockUpstream,
    path: &str,
    key: &str,
    body: &[u8],
) -> Sent {
    let seen = mock.requests().len();
    let headers = headers_for(path, key);
    let headers: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let ex = client
        .exchange(
            "POST",
            &proxy.url(path),
            &headers,
            Bytes::copy_from_slice(body),
        )
        .await;
    let (summaries, mut forwarded) = received_since(mock, seen);
    assert_eq!(
        forwarded.len(),
        1,
        "{path}: exactly one agent request reaches the provider (status {}, {})",
        ex.status,
        String::from_utf8_lossy(&ex.body)
    );
    Sent {
        ex,
        summaries,
        forwarded: forwarded.remove(0),
    }
}

async fn metric(proxy: &TestProxy, labels: &[(&str, &str)]) -> f64 {
    proxy.metric(COMPACTIONS, labels).await.unwrap_or(0.0)
}

/// `compactor_compactions_total{outcome}` summed over the automatic triggers.
async fn automatic(proxy: &TestProxy, outcome: &str) -> f64 {
    let text = proxy.metrics().await;
    ["messages", "tokens"]
        .iter()
        .map(|t| metric_value(&text, COMPACTIONS, &[("trigger", t), ("outcome", outcome)]))
        .map(|v| v.unwrap_or(0.0))
        .sum()
}

/// `latest.covered` of a session, from the admin API.
async fn covered(proxy: &TestProxy, session: &str) -> usize {
    let (status, text) = TestClient::http1()
        .get_text(&proxy.admin_url(&format!("/session/{session}")))
        .await;
    assert_eq!(status, 200, "GET /session/{session}: {text}");
    let info: Value = serde_json::from_str(&text).expect("session JSON");
    info["latest"]["covered"]
        .as_u64()
        .unwrap_or_else(|| panic!("no checkpoint in {info}")) as usize
}

// ---------------------------------------------------------------------------------------------
// Reading forwarded conversations
// ---------------------------------------------------------------------------------------------

/// The texts a forwarded conversation carries, the summary set apart.
#[derive(Debug, Default)]
struct View {
    /// The summary text (a text starting with [`SUMMARY_INTRO`]), if any.
    summary: Option<String>,
    /// Every other text of a message, with the message's role: string contents and the
    /// `text` of content blocks (`text`, `input_text`, `output_text`), tool results and
    /// reasoning left out.
    kept: Vec<(String, String)>,
}

impl View {
    /// Of a `messages` (or Responses `input`) array.
    fn of(items: &Value) -> View {
        let mut view = View::default();
        for item in items.as_array().expect("a message array") {
            let texts: Vec<&str> = match &item["content"] {
                Value::String(s) => vec![s.as_str()],
                Value::Array(blocks) => blocks
                    .iter()
                    .filter(|b| b["type"] != "tool_result")
                    .filter_map(|b| b["text"].as_str())
                    .collect(),
                _ => Vec::new(),
            };
            let role = item["role"].as_str().unwrap_or("");
            for t in texts {
                if t.starts_with(SUMMARY_INTRO) {
                    assert!(
                        view.summary.is_none(),
                        "two summaries in one request: {items}"
                    );
                    view.summary = Some(t.to_owned());
                } else {
                    view.kept.push((role.to_owned(), t.to_owned()));
                }
            }
        }
        view
    }

    /// Whether a kept message of `role` has a text (a whole string content or content block)
    /// that is exactly `text`.
    fn kept_verbatim(&self, role: &str, text: &str) -> bool {
        self.kept.iter().any(|(r, t)| r == role && t == text)
    }

    fn summary_contains(&self, words: &str) -> bool {
        self.summary.as_deref().is_some_and(|s| s.contains(words))
    }

    fn summary_text(&self) -> &str {
        self.summary.as_deref().unwrap_or("(no summary)")
    }
}

/// What went missing from forwarded requests, collected over a whole replay so that a failure
/// names every request affected, with the first one's summary in full.
#[derive(Default)]
struct Losses {
    lines: Vec<String>,
    first_summary: Option<String>,
}

impl Losses {
    fn record(&mut self, line: String, view: &View) {
        if self.first_summary.is_none() {
            self.first_summary = Some(view.summary_text().to_owned());
        }
        self.lines.push(line);
    }

    fn assert_none(&self, replay: &str) {
        assert!(
            self.lines.is_empty(),
            "{replay}: {} losses:\n{}\n--- summary forwarded with the first ---\n{}",
            self.lines.len(),
            self.lines.join("\n"),
            self.first_summary.as_deref().unwrap_or("")
        );
    }
}

/// Checks that every person-turn's typed words in `typed` (oldest first) are in the forwarded
/// conversation, verbatim as a text of a kept user message or inside the summary, and the
/// latest verbatim in a kept user message or pinned in the summary's
/// `<latest-user-message>`.
fn check_typed_words(what: &str, view: &View, typed: &[&str], losses: &mut Losses) {
    for words in typed {
        if !(view.kept_verbatim("user", words) || view.summary_contains(words)) {
            losses.record(
                format!(
                    "{what}: the person's words {words:?} are in neither a kept message nor the summary"
                ),
                view,
            );
        }
    }
    let latest = typed.last().expect("at least one person-turn");
    let pinned = format!("{LATEST_USER_OPEN}\n{latest}\n{LATEST_USER_CLOSE}");
    if !(view.kept_verbatim("user", latest) || view.summary_contains(&pinned)) {
        losses.record(
            format!("{what}: the latest person-turn {latest:?} is neither kept verbatim nor pinned as {pinned:?}"),
            view,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Fixture material
// ---------------------------------------------------------------------------------------------

const B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

/// A deterministic string of `len` characters of `alphabet`.
fn token(len: usize, seed: u64, alphabet: &[u8]) -> String {
    pseudo_random_bytes(len, seed)
        .iter()
        .map(|b| alphabet[*b as usize % alphabet.len()] as char)
        .collect()
}

/// Lines of the project's Rust sources, for file reads and edits.
const RUST_LINES: [&str; 36] = [
    "use std::sync::Arc;",
    "use std::time::Instant;",
    "use axum::{extract::State, http::StatusCode, middleware::Next, response::Response};",
    "use tracing::{info, warn};",
    "",
    "/// Logs one API request with its method, path, status and latency.",
    "pub async fn log_request(State(sink): State<Arc<LogSink>>, req: Request, next: Next) -> Response {",
    "    let started = Instant::now();",
    "    let method = req.method().clone();",
    "    let path = req.uri().path().to_owned();",
    "    let response = next.run(req).await;",
    "    sink.record(&method, &path, response.status(), started.elapsed());",
    "    response",
    "}",
    "#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]",
    "pub struct TextBoxStyle {",
    "    pub outline_width: f32,",
    "    pub outline_color: Rgba,",
    "    pub fill: Option<Rgba>,",
    "    pub padding: Insets,",
    "impl TextBoxStyle {",
    "    pub fn outline_rect(&self, bounds: Rect) -> Rect {",
    "        bounds.inset(-self.outline_width / 2.0)",
    "    }",
    "#[tokio::test]",
    "async fn logs_every_request_once() {",
    "    let (sink, mut rx) = LogSink::channel(16);",
    "    assert_eq!(rx.recv().await.expect(\"one record\").status, 200);",
    "    let app = Router::new().route(\"/boards/{id}\", get(board)).layer(from_fn_with_state(sink.clone(), log_request));",
    "        .map_err(|e| ApiError::Storage(e.to_string()))?;",
    "    for frame in board.frames.iter().filter(|f| f.visible) {",
    "        canvas.draw_text_box(&frame.text, &frame.style)?;",
    "    let width = (bounds.width() * scale).ceil() as u32;",
    "    let height = (bounds.height() * scale).ceil() as u32;",
    "            warn!(board = %id, error = %e, \"export failed\");",
    "    Ok(Json(BoardSummary::from(&board)))",
];

/// `lines` lines of source, as Claude Code's Read tool numbers them.
fn numbered_source(lines: usize, seed: usize) -> String {
    (0..lines)
        .map(|i| {
            let line = RUST_LINES[(seed * 7 + i * 13) % RUST_LINES.len()];
            format!("{:>6}\u{2192}{line}", i + 1)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `cargo test` output of `tests` tests, `failed` of them failing.
fn cargo_test_output(tests: usize, failed: usize, seed: usize) -> String {
    let mut out = String::from(
        "   Compiling inkwell-api v0.4.2 (/home/dev/inkwell/crates/api)\n    Finished `test` \
         profile [unoptimized + debuginfo] target(s) in 7.91s\n     Running unittests \
         src/lib.rs (target/debug/deps/inkwell_api-3f2a9c1d0b7e5a64)\n\n",
    );
    out.push_str(&format!("running {tests} tests\n"));
    let areas = ["logging", "export", "text_box", "boards", "auth", "render"];
    for i in 0..tests {
        let area = areas[(seed + i) % areas.len()];
        let verdict = if i < failed { "FAILED" } else { "ok" };
        out.push_str(&format!(
            "test {area}::tests::case_{seed}_{i}_keeps_its_invariants ... {verdict}\n"
        ));
    }
    if failed > 0 {
        out.push_str(&format!(
            "\nfailures:\n\n---- logging::tests::case_{seed}_0_keeps_its_invariants stdout ----\n\
             thread 'logging::tests::case_{seed}_0_keeps_its_invariants' panicked at \
             crates/api/src/logging.rs:88:9:\nassertion `left == right` failed\n  left: 2\n right: 1\n"
        ));
    }
    out.push_str(&format!(
        "\ntest result: {}. {} passed; {failed} failed; 0 ignored; 0 measured; 0 filtered out; \
         finished in 0.42s\n",
        if failed > 0 { "FAILED" } else { "ok" },
        tests - failed
    ));
    out
}

/// A CLAUDE.md of about `bytes` bytes.
fn claude_md(bytes: usize, seed: usize) -> String {
    let mut md = String::from(
        "# inkwell\n\nA collaborative whiteboard: a Rust API server (crates/api, axum 0.8, \
         tokio, sqlx on Postgres) and a TypeScript canvas front end (web/, React 18, Vite).\n\n\
         ## Commands\n- `cargo test --workspace` runs the server tests (needs `docker compose up db`).\n\
         - `pnpm --dir web test` runs the front-end tests; `pnpm --dir web lint` must be clean.\n\
         - `just export-fixtures` regenerates the PNG/SVG golden files in tests/golden/.\n\n\
         ## Conventions\n",
    );
    let rules = [
        "Errors are `thiserror` enums per module; never `unwrap()` outside tests.",
        "Every HTTP handler is instrumented with `#[tracing::instrument(skip_all)]`.",
        "Logging goes through `LogSink`; do not call `println!` or `eprintln!`.",
        "Public functions get a doc comment that says what they return, not how.",
        "Text boxes are measured in board units; convert to pixels only in the renderer.",
        "Migrations live in crates/api/migrations and are never edited once merged.",
        "Front-end components are function components with hooks; no class components.",
        "Keep PRs under 400 changed lines; split refactors from behaviour changes.",
        "Golden files change only together with a note in CHANGELOG.md under Unreleased.",
        "Run `cargo clippy --all-targets -- -D warnings` before every commit.",
    ];
    let mut i = 0;
    while md.len() < bytes {
        md.push_str(&format!(
            "- {} (see docs/conventions.md §{}.{})\n",
            rules[(seed + i) % rules.len()],
            seed + 1,
            i + 1
        ));
        i += 1;
    }
    md
}

/// The `<system-reminder>` Claude Code puts before the typed words, with CLAUDE.md inside.
fn claude_md_reminder(bytes: usize, seed: usize) -> String {
    format!(
        "<system-reminder>\nAs you answer the user's questions, you can use the following \
         context:\n# claudeMd\nCodebase and user instructions are shown below. Be sure to adhere \
         to these instructions. IMPORTANT: These instructions OVERRIDE any default behavior and \
         you MUST follow them exactly as written.\n\nContents of /home/dev/inkwell/CLAUDE.md \
         (project instructions, checked into the codebase):\n\n{}\n\n      IMPORTANT: this \
         context may or may not be relevant to your tasks. You should not respond to this \
         context unless it is highly relevant to your task.\n</system-reminder>\n",
        claude_md(bytes, seed)
    )
}

// ---------------------------------------------------------------------------------------------
// Claude Code sessions (Anthropic Messages)
// ---------------------------------------------------------------------------------------------

/// One conversation as an agent builds it.
#[derive(Default)]
struct Session {
    /// Messages (or Responses input items), in order.
    items: Vec<Value>,
    /// (index in `items`, typed words) of every person-turn.
    typed: Vec<(usize, &'static str)>,
    /// The agent's requests: it sends `items[..k]` for each `k` here.
    steps: Vec<usize>,
}

impl Session {
    /// The typed words of the person-turns among `items[..k]`, oldest first.
    fn typed_before(&self, k: usize) -> Vec<&'static str> {
        self.typed
            .iter()
            .filter(|(i, _)| *i < k)
            .map(|(_, w)| *w)
            .collect()
    }
}

/// One person-turn of a Claude Code session.
struct ClaudeTurn {
    /// What the person typed.
    words: &'static str,
    /// The turn follows `/clear`: its message echoes the command and its (empty) output.
    after_clear: bool,
    /// Size of the CLAUDE.md in this turn's reminder.
    claude_md_bytes: usize,
    /// Tool round trips before the final answer.
    rounds: usize,
}

const CLAUDE_TURNS: [ClaudeTurn; 9] = [
    ClaudeTurn {
        words: "test api logging",
        after_clear: true,
        claude_md_bytes: 5_800,
        rounds: 8,
    },
    ClaudeTurn {
        words: "Does it also properly handle the outline of the text box?",
        after_clear: false,
        claude_md_bytes: 3_200,
        rounds: 9,
    },
    ClaudeTurn {
        words: "the PNG export crops the last column of pixels, can you find out why",
        after_clear: false,
        claude_md_bytes: 4_100,
        rounds: 7,
    },
    ClaudeTurn {
        words: "add a regression test for that and make sure it runs in CI",
        after_clear: false,
        claude_md_bytes: 4_900,
        rounds: 8,
    },
    ClaudeTurn {
        words: "rename TextBoxStyle to TextStyle everywhere, docs included",
        after_clear: false,
        claude_md_bytes: 3_600,
        rounds: 9,
    },
    ClaudeTurn {
        words: "run the whole test suite again and tell me what still fails",
        after_clear: false,
        claude_md_bytes: 5_200,
        rounds: 7,
    },
    ClaudeTurn {
        words: "fix the two failing render tests",
        after_clear: false,
        claude_md_bytes: 4_400,
        rounds: 8,
    },
    ClaudeTurn {
        words: "update the README section about exports",
        after_clear: false,
        claude_md_bytes: 3_900,
        rounds: 8,
    },
    ClaudeTurn {
        words: "commit all of this with a good message",
        after_clear: false,
        claude_md_bytes: 5_000,
        rounds: 9,
    },
];

fn text_block(text: &str) -> Value {
    json!({"type": "text", "text": text})
}

fn thinking_block(text: String, seed: u64) -> Value {
    json!({"type": "thinking", "thinking": text, "signature": format!("Eu8B{}", token(340, seed, B64))})
}

/// One tool call of a Claude Code round: (name, input, result content).
fn claude_tool(turn: usize, round: usize, n: usize) -> (&'static str, Value, Value) {
    let files = [
        "crates/api/src/logging.rs",
        "crates/api/src/text_box.rs",
        "crates/api/src/export/png.rs",
        "crates/api/tests/export.rs",
        "crates/api/src/style.rs",
        ".github/workflows/ci.yml",
    ];
    let file = format!(
        "/home/dev/inkwell/{}",
        files[(turn + round + n) % files.len()]
    );
    let seed = turn * 31 + round * 7 + n;
    match (turn + round + n) % 5 {
        0 | 3 => (
            "Read",
            json!({"file_path": file}),
            json!(numbered_source(40 + (seed % 5) * 12, seed)),
        ),
        1 => (
            "Bash",
            json!({"command": "cargo test -p inkwell-api 2>&1 | tail -60",
                   "description": "Run the API crate's tests"}),
            json!(cargo_test_output(18 + seed % 9, seed % 3, seed)),
        ),
        2 => (
            "Grep",
            json!({"pattern": "outline_width|log_request", "path": "/home/dev/inkwell/crates",
                   "output_mode": "content", "-n": true}),
            json!((0..30)
                .map(|i| format!(
                    "{file}:{}:{}",
                    10 + i * 3,
                    RUST_LINES[(seed + i) % RUST_LINES.len()]
                ))
                .collect::<Vec<_>>()
                .join("\n")),
        ),
        _ => (
            "Edit",
            json!({"file_path": file, "old_string": RUST_LINES[seed % RUST_LINES.len()],
                   "new_string": format!("{} // checked", RUST_LINES[seed % RUST_LINES.len()])}),
            // Claude Code sends some results as blocks.
            json!([{"type": "text", "text": format!(
                "The file {file} has been updated. Here's the result of running `cat -n` on a \
                 snippet of the edited file:\n{}",
                numbered_source(24, seed)
            )}]),
        ),
    }
}

/// A long Claude Code session: nine person-turns, each a request followed by a tool loop.
fn claude_code_session() -> Session {
    let mut s = Session::default();
    let mut next_id = 0u64;
    for (t, turn) in CLAUDE_TURNS.iter().enumerate() {
        // The person-turn: injected context first, the typed words last.
        let mut blocks = vec![text_block(&claude_md_reminder(turn.claude_md_bytes, t))];
        if turn.after_clear {
            blocks.push(text_block(
                "<command-name>/clear</command-name>\n            <command-message>clear</command-message>\n            <command-args></command-args>",
            ));
            blocks.push(text_block("<local-command-stdout></local-command-stdout>"));
        }
        if t == 3 {
            blocks.push(text_block(
                "<system-reminder>\nThe TodoWrite tool hasn't been used recently. If you're \
                 working on tasks that would benefit from tracking progress, consider using the \
                 TodoWrite tool to track progress. Make sure that you NEVER mention this reminder \
                 to the user\n</system-reminder>",
            ));
        }
        blocks.push(text_block(turn.words));
        s.typed.push((s.items.len(), turn.words));
        s.items.push(json!({"role": "user", "content": blocks}));

        for round in 0..turn.rounds {
            s.steps.push(s.items.len());
            // The second round reads two files in parallel.
            let calls = if round == 1 { 2 } else { 1 };
            let mut assistant = vec![thinking_block(
                format!(
                    "Request {t}, step {round}: I have what the previous tool returned; next I \
                     need to look at the code path involved before changing anything, and keep \
                     the CLAUDE.md conventions in mind."
                ),
                (t * 100 + round) as u64,
            )];
            if round == 0 {
                assistant.push(text_block(
                    "I'll start by looking at the relevant code and running the tests.",
                ));
            }
            let mut results = Vec::new();
            for n in 0..calls {
                next_id += 1;
                let id = format!("toolu_01{}", token(22, 7_000 + next_id, ALNUM));
                let (name, input, content) = claude_tool(t, round, n);
                assistant.push(json!({"type": "tool_use", "id": id, "name": name, "input": input}));
                results.push(json!({"type": "tool_result", "tool_use_id": id, "content": content}));
            }
            s.items
                .push(json!({"role": "assistant", "content": assistant}));
            s.items.push(json!({"role": "user", "content": results}));
        }
        s.steps.push(s.items.len());
        s.items.push(json!({"role": "assistant", "content": [
            thinking_block(format!("Request {t} is done; summarise for the user."), (t * 100 + 99) as u64),
            text_block("Done: the change is in place and the crate's tests pass."),
        ]}));
    }
    s
}

fn claude_system_prompt() -> String {
    let mut p = String::from(
        "You are an interactive CLI tool that helps users with software engineering tasks. Use \
         the instructions below and the tools available to you to assist the user.\n\n\
         IMPORTANT: Assist with defensive security tasks only.\n\n# Tone and style\nYou should \
         be concise, direct, and to the point.\n\n# Doing tasks\n",
    );
    for i in 0..24 {
        p.push_str(&format!(
            "- Guideline {i}: use the available search tools to understand the codebase and the \
             user's query before editing; verify the solution with the project's tests.\n"
        ));
    }
    p.push_str("\nHere is useful information about the environment you are running in:\n<env>\nWorking directory: /home/dev/inkwell\nIs directory a git repo: Yes\nPlatform: linux\n</env>");
    p
}

fn claude_tools() -> Value {
    let tool = |name: &str, description: &str, properties: Value, required: Value| {
        json!({"name": name, "description": description, "input_schema": {
            "type": "object", "properties": properties, "required": required,
            "additionalProperties": false, "$schema": "http://json-schema.org/draft-07/schema#"}})
    };
    json!([
        tool(
            "Bash",
            "Executes a given bash command in a persistent shell session.",
            json!({"command": {"type": "string"}, "description": {"type": "string"}, "timeout": {"type": "number"}}),
            json!(["command"])
        ),
        tool(
            "Read",
            "Reads a file from the local filesystem.",
            json!({"file_path": {"type": "string"}, "offset": {"type": "number"}, "limit": {"type": "number"}}),
            json!(["file_path"])
        ),
        tool(
            "Grep",
            "A powerful search tool built on ripgrep.",
            json!({"pattern": {"type": "string"}, "path": {"type": "string"}, "output_mode": {"type": "string"}, "-n": {"type": "boolean"}}),
            json!(["pattern"])
        ),
        tool(
            "Edit",
            "Performs exact string replacements in files.",
            json!({"file_path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"}}),
            json!(["file_path", "old_string", "new_string"])
        ),
    ])
}

/// Claude Code's request carrying `messages`: the cache marker moves to the last block.
fn claude_code_body(messages: &[Value]) -> Vec<u8> {
    let mut messages = messages.to_vec();
    if let Some(block) = messages
        .last_mut()
        .and_then(|m| m["content"].as_array_mut())
        .and_then(|b| b.last_mut())
    {
        block["cache_control"] = json!({"type": "ephemeral"});
    }
    serde_json::to_vec(&json!({
        "model": CLAUDE_MODEL,
        "messages": messages,
        "temperature": 1,
        "system": [
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": claude_system_prompt(), "cache_control": {"type": "ephemeral"}}
        ],
        "tools": claude_tools(),
        "metadata": {"user_id": "user_2f9c0e1d_account_7b1e4a55_session_0c3d9a7e-1f2b-4c5d-8e9f-0a1b2c3d4e5f"},
        "max_tokens": 32000,
        "thinking": {"type": "enabled", "budget_tokens": 10000},
        "stream": true
    }))
    .expect("serialise")
}

/// Nine person-turns, 73 tool round trips, 164 messages and ~300 KB at the end: the session
/// compacts about ten times.
///
/// Breaks if the typed words of any person-turn drop out of a forwarded request (context
/// blocks mistaken for the person's words, a turn cut from the summary or from the prior
/// summary it carries forward, the latest turn not pinned), or if a rewrite breaks Anthropic's
/// rules (orphaned `tool_result`, a final turn not opening with thinking, roles not
/// alternating) or does not fit the window.
#[tokio::test]
async fn claude_code_typed_words_survive_every_compaction() {
    claude_code_session_through("summarize").await;
}

/// The same session under `hybrid` (the default): masking instead of most summaries, with
/// the same guarantees, and signed thinking blocks forwarded exactly as the client sent them.
#[tokio::test]
async fn claude_code_typed_words_and_signed_thinking_survive_hybrid_masking() {
    claude_code_session_through("hybrid").await;
}

async fn claude_code_session_through(strategy: &str) {
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let compaction = format!("strategy = \"{strategy}\"\n");
    let proxy = TestProxy::start(&proxy_toml(&mock, &compaction, "extractive")).await;
    let client = TestClient::http1();
    let session = claude_code_session();
    let key = "sk-ant-api03-claude-code-typed-words";
    let mut max_num = 0;
    let mut losses = Losses::default();
    let mut compacted = 0;
    let mut masked = 0;

    for (step, &k) in session.steps.iter().enumerate() {
        let what = format!("step {step} ({k} messages)");
        let body = claude_code_body(&session.items[..k]);
        let sent = send(&client, &proxy, &mock, MESSAGES, key, &body).await;
        assert_eq!(
            sent.ex.status,
            200,
            "{what}: {} (refused: {:?})",
            String::from_utf8_lossy(&sent.ex.body),
            provider.refused()
        );
        assert!(sent.summaries.is_empty(), "{what}: extractive is local");
        let v = sent.forwarded_json();
        assert_eq!(
            check_messages(&v, CLAUDE_WINDOW),
            Ok(()),
            "{what}: the forwarded body breaks Anthropic's rules"
        );
        if sent.compacted() {
            compacted += 1;
            max_num = max_num.max(sent.ex.compaction_num().expect("compaction number"));
        } else if sent.masked() {
            masked += 1;
        } else {
            assert_eq!(sent.forwarded.body, body, "{what}: untouched");
        }
        let sent_thinking = thinking_blocks(&serde_json::from_slice(&body).expect("JSON"));
        for block in thinking_blocks(&v) {
            assert!(
                sent_thinking.contains(&block),
                "{what}: a thinking block the client did not send: {block}"
            );
        }
        let view = View::of(&v["messages"]);
        let what = format!(
            "{what}, compaction #{}",
            sent.ex.compaction_num().unwrap_or(0)
        );
        check_typed_words(&what, &view, &session.typed_before(k), &mut losses);
    }
    if strategy == "summarize" {
        assert_eq!(masked, 0);
        assert!(
            max_num >= 3,
            "the session compacts several times (reached #{max_num})"
        );
        assert!(compacted > max_num as usize, "summaries are reused");
    } else {
        assert!(masked > 0, "old outputs are masked");
    }
    assert_eq!(provider.refused(), Vec::<String>::new());
    assert_eq!(automatic(&proxy, "failed").await, 0.0);
    losses.assert_none("the Claude Code session");
    proxy.shutdown().await;
}

/// Every `thinking` and `redacted_thinking` block of an Anthropic request, as sent.
fn thinking_blocks(request: &Value) -> Vec<Value> {
    let messages = request["messages"].as_array().into_iter().flatten();
    messages
        .filter_map(|m| m["content"].as_array())
        .flatten()
        .filter(|b| matches!(b["type"].as_str(), Some("thinking" | "redacted_thinking")))
        .cloned()
        .collect()
}

/// The `<user>` blocks of a compaction prompt.
fn user_blocks(prompt: &str) -> Vec<&str> {
    prompt
        .split("<user>\n")
        .skip(1)
        .map(|rest| rest.split("\n</user>").next().unwrap_or(rest))
        .collect()
}

/// Breaks if the prompt lists a person-turn's injected context (CLAUDE.md reminder, command
/// echo) before what the person typed — a summarizer reads the words last, and a truncated
/// turn loses them — or drops the typed words from a turn, or if the latest typed words are
/// not pinned when the LLM's summary leaves them out.
#[tokio::test]
async fn claude_code_summarizer_prompt_puts_typed_words_before_injected_context() {
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    // The standalone prompt's order is what this checks: the summary asked inside the
    // conversation (Claude Code marks cache breakpoints) is refused, and the prompt follows.
    provider.refuse_inside.store(true, Ordering::SeqCst);
    let proxy = TestProxy::start(&proxy_toml(&mock, "", "auto")).await;
    let client = TestClient::http1();
    let session = claude_code_session();
    let key = "sk-ant-api03-claude-code-prompt-order";
    let all_typed: Vec<&str> = session.typed.iter().map(|(_, w)| *w).collect();
    let mut seen_in_prompts: BTreeSet<&str> = BTreeSet::new();
    let mut prompts = 0;

    for (step, &k) in session.steps.iter().enumerate() {
        let what = format!("step {step} ({k} messages)");
        let body = claude_code_body(&session.items[..k]);
        let sent = send(&client, &proxy, &mock, MESSAGES, key, &body).await;
        assert_eq!(
            sent.ex.status,
            200,
            "{what}: {} (refused: {:?})",
            String::from_utf8_lossy(&sent.ex.body),
            provider.refused()
        );
        for call in &sent.summaries {
            assert_eq!(call.path(), MESSAGES, "{what}: auto asks Anthropic");
            assert_eq!(call.header("x-api-key"), Some(key), "{what}: caller's key");
            let prompt = prompt_of(call).expect("a <task> prompt");
            if asked_inside(&prompt) {
                // The conversation as forwarded, then the turn: valid for the provider.
                let asked: Value = serde_json::from_slice(&call.body).expect("JSON");
                assert_eq!(check_messages(&asked, CLAUDE_WINDOW), Ok(()), "{what}");
                continue;
            }
            prompts += 1;
            let blocks = user_blocks(&prompt);
            let with_context: Vec<&&str> = blocks
                .iter()
                .filter(|b| b.contains("<system-reminder>"))
                .collect();
            for block in with_context {
                let words = all_typed
                    .iter()
                    .find(|w| block.contains(**w))
                    .unwrap_or_else(|| {
                        panic!("{what}: a <user> block lost the typed words:\n{block:.3000}")
                    });
                seen_in_prompts.insert(words);
                assert!(
                    block.starts_with(words),
                    "{what}: the <user> block must open with the typed words {words:?}, \
                     before the injected context; it opens with:\n{:.600}",
                    block
                );
                for context in [
                    "<system-reminder>",
                    "<command-name>",
                    "<local-command-stdout>",
                ] {
                    if let Some(at) = block.find(context) {
                        assert!(
                            block.find(words).expect("present") < at,
                            "{what}: {words:?} after {context}"
                        );
                    }
                }
            }
        }
        // The LLM's summary is a placeholder here: the latest typed words must still be there.
        let v = sent.forwarded_json();
        let sent_body: Value = serde_json::from_slice(&body).expect("JSON");
        let opening = sent_body["messages"][0]["content"]
            .as_array()
            .expect("blocks");
        let first = v["messages"][0]["content"].as_array().expect("blocks");
        assert!(
            first.len() >= opening.len() && first[..opening.len()] == opening[..],
            "{what}: the opening (CLAUDE.md reminder and all) is forwarded verbatim"
        );
        assert_eq!(check_messages(&v, CLAUDE_WINDOW), Ok(()), "{what}");
        let view = View::of(&v["messages"]);
        let typed = session.typed_before(k);
        let latest = typed.last().expect("a person-turn");
        let pinned = format!("{LATEST_USER_OPEN}\n{latest}\n{LATEST_USER_CLOSE}");
        assert!(
            view.kept_verbatim("user", latest) || view.summary_contains(&pinned),
            "{what}: latest typed words {latest:?} neither kept nor pinned.\n--- summary ---\n{}",
            view.summary_text()
        );
    }
    assert!(prompts >= 2, "several compactions ({prompts} prompts)");
    assert_eq!(provider.summaries(), prompts);
    assert_eq!(
        provider.refused_inside.load(Ordering::SeqCst),
        prompts,
        "each compaction asked inside the conversation first"
    );
    // The first turn (the opening: the /clear echo, CLAUDE.md, the words) is kept verbatim in
    // every forwarded request, never summarised.
    assert!(
        !seen_in_prompts.contains(CLAUDE_TURNS[0].words),
        "the opening was summarised: {seen_in_prompts:?}"
    );
    assert!(
        seen_in_prompts.len() >= 3,
        "several person-turns were summarised: {seen_in_prompts:?}"
    );
    assert_eq!(provider.refused(), Vec::<String>::new());
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Codex sessions (OpenAI Responses)
// ---------------------------------------------------------------------------------------------

const CODEX_TURNS: [(&str, usize); 5] = [
    (
        "the export command writes an empty file when the board has no frames, fix it",
        9,
    ),
    (
        "also make inkwell export --format svg keep the text box outlines",
        8,
    ),
    ("run the integration tests and fix whatever broke", 10),
    ("now update CHANGELOG.md for the export fixes", 6),
    (
        "looks good, squash it into one commit with a short message",
        5,
    ),
];

fn codex_environment_context() -> String {
    "<environment_context>\n  <cwd>/home/dev/inkwell</cwd>\n  <approval_policy>on-request</approval_policy>\n  \
     <sandbox_mode>workspace-write</sandbox_mode>\n  <network_access>restricted</network_access>\n  \
     <shell>bash</shell>\n</environment_context>"
        .to_owned()
}

fn codex_user_instructions() -> String {
    format!(
        "<user_instructions>\n\n# AGENTS.md\n\n{}\n\n</user_instructions>",
        claude_md(4_200, 11)
    )
}

fn input_message(role: &str, text: &str) -> Value {
    let kind = if role == "assistant" {
        "output_text"
    } else {
        "input_text"
    };
    json!({"type": "message", "role": role, "content": [{"type": kind, "text": text}]})
}

fn reasoning_item(seed: u64, summary: &str) -> Value {
    json!({
        "type": "reasoning",
        "id": format!("rs_{}", token(48, seed, b"0123456789abcdef")),
        "summary": [{"type": "summary_text", "text": summary}],
        "content": null,
        "encrypted_content": format!("gAAAAABo{}", token(1_200, seed ^ 0x5eed, B64)),
    })
}

/// One `shell` call of a Codex round: (command, output).
fn codex_shell(turn: usize, round: usize) -> (Vec<String>, String) {
    let seed = turn * 17 + round;
    let files = [
        "crates/api/src/export/mod.rs",
        "crates/api/src/export/svg.rs",
        "crates/api/src/text_box.rs",
        "CHANGELOG.md",
    ];
    let file = files[seed % files.len()];
    let (script, output) = match seed % 3 {
        0 => (
            format!("sed -n '1,120p' {file}"),
            numbered_source(50 + seed % 30, seed),
        ),
        1 => (
            "cargo test -p inkwell-api --test export".to_owned(),
            cargo_test_output(20 + seed % 7, seed % 2, seed),
        ),
        _ => (
            format!("rg -n 'outline|frames' {file}"),
            (0..28)
                .map(|i| {
                    format!(
                        "{}:{}",
                        12 + i * 4,
                        RUST_LINES[(seed + i * 5) % RUST_LINES.len()]
                    )
                })
                .collect::<Vec<_>>()
                .join("\n"),
        ),
    };
    let command = vec!["bash".to_owned(), "-lc".to_owned(), script];
    let output = json!({"output": output, "metadata": {"exit_code": 0, "duration_seconds": 0.3}})
        .to_string();
    (command, output)
}

/// A long Codex session: five person-turns, each followed by reasoning and `shell` calls.
fn codex_session() -> Session {
    let mut s = Session::default();
    let mut seed = 0u64;
    for (t, (words, rounds)) in CODEX_TURNS.iter().enumerate() {
        if t == 0 {
            s.items
                .push(input_message("user", &codex_environment_context()));
            s.items
                .push(input_message("user", &codex_user_instructions()));
        }
        if t == 2 {
            // The sandbox changed: Codex sends the context again before the typed words.
            s.items.push(input_message(
                "user",
                &codex_environment_context().replace("on-request", "never"),
            ));
        }
        s.typed.push((s.items.len(), words));
        s.items.push(input_message("user", words));
        for round in 0..*rounds {
            s.steps.push(s.items.len());
            seed += 1;
            s.items.push(reasoning_item(
                seed,
                &format!(
                    "**Inspecting the export path**\n\nRequest {t}, step {round}: checking what \
                     the last command showed before editing."
                ),
            ));
            if round == 0 {
                // GPT-5 often says what it is about to do in the same response as the call.
                s.items.push(input_message(
                    "assistant",
                    "I'll look at the export code and its tests first.",
                ));
            }
            let (command, output) = codex_shell(t, round);
            let call_id = format!("call_{}", token(24, 9_000 + seed, ALNUM));
            s.items.push(json!({
                "type": "function_call",
                "name": "shell",
                "arguments": json!({"command": command, "workdir": "/home/dev/inkwell", "timeout_ms": 120000}).to_string(),
                "call_id": call_id,
            }));
            s.items.push(
                json!({"type": "function_call_output", "call_id": call_id, "output": output}),
            );
        }
        s.steps.push(s.items.len());
        seed += 1;
        s.items.push(reasoning_item(
            seed,
            "**Wrapping up**\n\nReporting what changed.",
        ));
        s.items.push(input_message(
            "assistant",
            "Done. The tests pass; the diff is ready for review.",
        ));
    }
    s
}

fn codex_instructions() -> String {
    let mut p = String::from(
        "You are Codex, based on GPT-5. You are running as a coding agent in the Codex CLI on a \
         user's computer.\n\n## General\n\n- The arguments to `shell` will be passed to \
         execvp(). Most terminal commands should be prefixed with [\"bash\", \"-lc\"].\n",
    );
    for i in 0..20 {
        p.push_str(&format!(
            "- Rule {i}: prefer `rg` over `grep`; keep edits minimal and in the existing style; \
             never revert changes you did not make.\n"
        ));
    }
    p
}

fn codex_body(input: &[Value]) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": CODEX_MODEL,
        "instructions": codex_instructions(),
        "input": input,
        "tools": [{"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
                   "strict": false, "parameters": {"type": "object", "properties": {
                       "command": {"type": "array", "items": {"type": "string"}},
                       "workdir": {"type": "string"}, "timeout_ms": {"type": "number"}},
                   "required": ["command"], "additionalProperties": false}}],
        "tool_choice": "auto",
        "parallel_tool_calls": false,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": false,
        "stream": true,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a7c2-5d1e-7f30-9b44-2a6e8c1d0f57"
    }))
    .expect("serialise")
}

/// Breaks if a typed request drops out of a forwarded request (Codex's injected
/// `<environment_context>`/`<user_instructions>` messages taken for the person's words, a turn
/// cut from the carried-forward summary, the latest turn not pinned), if a reasoning item is
/// altered, invented or separated from the item it produced, if a call loses its output, or
/// if a field other than `input` (`store`, `include`, `instructions`) changes.
#[tokio::test]
async fn codex_typed_words_survive_and_reasoning_items_are_never_altered() {
    codex_session_through("summarize").await;
}

/// The same session under `hybrid` (the default): masked outputs keep their calls, and
/// reasoning items stay exactly as sent.
#[tokio::test]
async fn codex_typed_words_and_reasoning_items_survive_hybrid_masking() {
    codex_session_through("hybrid").await;
}

async fn codex_session_through(strategy: &str) {
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let compaction = format!("strategy = \"{strategy}\"\n");
    let proxy = TestProxy::start(&proxy_toml(&mock, &compaction, "extractive")).await;
    let client = TestClient::http1();
    let session = codex_session();
    let key = "sk-proj-codex-typed-words";
    let mut max_num = 0;
    let mut masked = 0;
    let mut losses = Losses::default();

    for (step, &k) in session.steps.iter().enumerate() {
        let what = format!("step {step} ({k} items)");
        let sent_input = &session.items[..k];
        let body = codex_body(sent_input);
        let sent = send(&client, &proxy, &mock, RESPONSES, key, &body).await;
        assert_eq!(
            sent.ex.status,
            200,
            "{what}: {} (refused: {:?})",
            String::from_utf8_lossy(&sent.ex.body),
            provider.refused()
        );
        let v = sent.forwarded_json();
        assert_eq!(
            check_responses(&v, CODEX_WINDOW),
            Ok(()),
            "{what}: the forwarded body breaks the Responses rules"
        );
        if sent.compacted() {
            max_num = max_num.max(sent.ex.compaction_num().expect("compaction number"));
        } else if sent.masked() {
            masked += 1;
        } else {
            assert_eq!(sent.forwarded.body, body, "{what}: untouched");
        }
        for ((ks, vs), (ko, vo)) in top_level_fields(&body)
            .iter()
            .zip(&top_level_fields(&sent.forwarded.body))
        {
            assert_eq!(ks, ko, "{what}: field order");
            if ks != "input" {
                assert_eq!(vs, vo, "{what}: {ks} untouched");
            }
        }

        let out = v["input"].as_array().expect("input");
        for (j, item) in out.iter().enumerate() {
            if item["type"] != "reasoning" {
                continue;
            }
            let at = sent_input
                .iter()
                .position(|s| s == item)
                .unwrap_or_else(|| {
                    panic!(
                        "{what}: forwarded reasoning item {j} is not one the client sent: {item}"
                    )
                });
            assert_eq!(
                out.get(j + 1),
                sent_input.get(at + 1),
                "{what}: reasoning item {j} is no longer right before the item it produced"
            );
        }
        let view = View::of(&v["input"]);
        let what = format!(
            "{what}, compaction #{}",
            sent.ex.compaction_num().unwrap_or(0)
        );
        check_typed_words(&what, &view, &session.typed_before(k), &mut losses);
    }
    if strategy == "summarize" {
        assert_eq!(masked, 0);
        assert!(
            max_num >= 3,
            "the session compacts several times (reached #{max_num})"
        );
    } else {
        assert!(masked > 0, "old outputs are masked");
    }
    assert_eq!(provider.refused(), Vec::<String>::new());
    assert_eq!(automatic(&proxy, "failed").await, 0.0);
    losses.assert_none("the Codex session");
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Chat Completions sessions
// ---------------------------------------------------------------------------------------------

/// A coding agent's Chat Completions conversation: system, task, then `rounds` shell calls
/// with their outputs, the person chiming in every fourth round.
fn coding_chat(rounds: usize) -> Vec<Value> {
    let mut m = vec![
        json!({"role": "system", "content": "You are a coding agent working in /repo. Use the shell tool to inspect and change files; keep answers short."}),
        json!({"role": "user", "content": "The parser test in tests/parse.rs fails on empty input; find out why and fix it."}),
    ];
    let commands = [
        "cat src/parse.rs",
        "cargo test --test parse 2>&1 | tail -30",
        "rg -n 'fn parse' src",
        "git diff",
    ];
    for r in 0..rounds {
        // Every third round the model calls two tools in parallel.
        let calls = if r % 3 == 1 { 2 } else { 1 };
        let ids: Vec<String> = (0..calls)
            .map(|c| format!("call_{}", token(24, 500 + (r * 2 + c) as u64, ALNUM)))
            .collect();
        let tool_calls: Vec<Value> = ids
            .iter()
            .enumerate()
            .map(|(c, id)| {
                let cmd = commands[(r + c) % commands.len()];
                json!({"id": id, "type": "function", "function": {"name": "shell",
                    "arguments": json!({"command": ["bash", "-lc", cmd]}).to_string()}})
            })
            .collect();
        m.push(json!({"role": "assistant", "content": null, "tool_calls": tool_calls}));
        for (c, id) in ids.iter().enumerate() {
            m.push(json!({"role": "tool", "tool_call_id": id,
                          "content": numbered_source(12 + (r + c) % 5, r + c)}));
        }
        if r % 4 == 3 {
            m.push(json!({"role": "assistant", "content": format!("Round {r}: the empty-input path returns early before the tokenizer runs.")}));
            m.push(json!({"role": "user", "content": format!("ok, keep going (round {r})")}));
        }
    }
    m
}

fn chat_body(messages: &[Value]) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "gpt-4o", "messages": messages})).expect("serialise")
}

/// Indices of the assistant messages: the agent sends everything before each.
fn chat_steps(messages: &[Value]) -> Vec<usize> {
    (1..messages.len())
        .filter(|&i| messages[i]["role"] == "assistant")
        .collect()
}

/// Breaks if an empty (or one-message) conversation after a checkpoint makes compaction panic
/// (the connection closes, or the request is forwarded but counted as a panic), if it is
/// rewritten, or if the provider's answer does not come back.
#[tokio::test]
async fn empty_and_one_message_requests_after_a_checkpoint_are_forwarded_untouched() {
    let mock = MockUpstream::start().await;
    mock.set_handler(|req: &Recorded| {
        Reply::json(200, &json!({"mock": "answer", "path": req.path()}))
    });
    let proxy = TestProxy::start(&proxy_toml(&mock, "max_messages = 10\n", "extractive")).await;
    let client = TestClient::http1();
    let key = "sk-agent-traffic-empty-lists";

    // The tenant's checkpoint.
    let conversation = coding_chat(10);
    let first = send(
        &client,
        &proxy,
        &mock,
        CHAT,
        key,
        &chat_body(&conversation[..20]),
    )
    .await;
    assert_eq!(first.ex.status, 200);
    assert!(
        first.compacted(),
        "a 20-message request is compacted under max_messages = 10"
    );
    let session = first
        .ex
        .header("x-compactor-session")
        .expect("session")
        .to_owned();
    let covered = covered(&proxy, &session).await;
    assert!(covered > 5, "the checkpoint covers {covered} messages");

    let cases: Vec<(&str, &str, Value)> = vec![
        (
            "chat, messages: []",
            CHAT,
            json!({"model": "gpt-4o", "messages": []}),
        ),
        (
            "anthropic, messages: []",
            MESSAGES,
            json!({"model": CLAUDE_MODEL, "max_tokens": 1024, "messages": []}),
        ),
        (
            "responses, input: []",
            RESPONSES,
            json!({"model": CODEX_MODEL, "input": [], "store": false}),
        ),
        (
            "chat, one message",
            CHAT,
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "anthropic, one message",
            MESSAGES,
            json!({"model": CLAUDE_MODEL, "max_tokens": 1024,
                   "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
        ),
        (
            "responses, one item",
            RESPONSES,
            json!({"model": CODEX_MODEL, "store": false, "input": [input_message("user", "hi")]}),
        ),
        (
            "chat, the first 4 messages of the compacted conversation",
            CHAT,
            json!({"model": "gpt-4o", "messages": conversation[..4]}),
        ),
    ];
    for (what, path, value) in cases {
        let body = serde_json::to_vec(&value).expect("serialise");
        let sent = send(&client, &proxy, &mock, path, key, &body).await;
        assert_eq!(
            sent.ex.status,
            200,
            "{what}: {}",
            String::from_utf8_lossy(&sent.ex.body)
        );
        assert_eq!(
            sent.ex.json(),
            json!({"mock": "answer", "path": path}),
            "{what}: the provider's answer"
        );
        assert_eq!(
            sent.forwarded.body,
            Bytes::from(body),
            "{what}: forwarded byte-identical"
        );
        assert_ne!(
            sent.ex.header("x-compactor-compacted"),
            Some("true"),
            "{what}"
        );
    }
    assert_eq!(
        metric(&proxy, &[("trigger", "none"), ("outcome", "panic")]).await,
        0.0,
        "no compaction panicked"
    );
    proxy.shutdown().await;
}

/// Breaks if a request whose history is exactly a stored checkpoint's covered prefix is taken
/// as already served (the checkpoint cannot be spliced: no tail would remain) and forwarded
/// with more than `max_messages` messages without compaction and without a failure counted.
#[tokio::test]
async fn a_request_holding_exactly_the_covered_prefix_is_still_compacted() {
    const MAX: usize = 10;
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let proxy = TestProxy::start(&proxy_toml(&mock, "max_messages = 10\n", "auto")).await;
    let client = TestClient::http1();
    let key = "sk-agent-traffic-covered-prefix";
    let conversation = coding_chat(12);

    let first = send(
        &client,
        &proxy,
        &mock,
        CHAT,
        key,
        &chat_body(&conversation[..20]),
    )
    .await;
    assert_eq!(first.ex.status, 200);
    assert!(first.compacted(), "the 20-message request is compacted");
    assert_eq!(first.summaries.len(), 1, "one summarizer call");
    let session = first
        .ex
        .header("x-compactor-session")
        .expect("session")
        .to_owned();
    let covered = covered(&proxy, &session).await;
    assert!(
        covered > MAX && covered < 20,
        "the checkpoint covers {covered} messages: more than max_messages, for this test to mean anything"
    );

    let failed = automatic(&proxy, "failed").await;
    let prefix = &conversation[..covered];
    let sent = send(&client, &proxy, &mock, CHAT, key, &chat_body(prefix)).await;
    assert_eq!(
        sent.ex.status,
        200,
        "{}",
        String::from_utf8_lossy(&sent.ex.body)
    );
    let forwarded = sent.forwarded_json()["messages"]
        .as_array()
        .expect("messages")
        .clone();
    let counted = automatic(&proxy, "failed").await > failed;
    assert!(
        forwarded.len() <= MAX || counted,
        "a request of exactly the {covered} covered messages was forwarded with {} messages \
         (x-compactor-compacted: {:?}) and no failed compaction was counted",
        forwarded.len(),
        sent.ex.header("x-compactor-compacted")
    );
    if !counted {
        assert_eq!(
            sent.ex.header("x-compactor-compacted"),
            Some("true"),
            "compacted, and says so"
        );
        assert_eq!(forwarded[0], conversation[0], "system message first");
        let view = View::of(&json!(forwarded));
        assert!(view.summary.is_some(), "a summary stands in for the prefix");
    }
    assert_eq!(provider.refused(), Vec::<String>::new());
    proxy.shutdown().await;
}

/// What one placement of a mid-conversation instruction showed.
struct Placement {
    /// Where the instruction sits.
    at: usize,
    /// How many messages each compaction covered, in order, for the compactions of requests
    /// that held the instruction.
    covered: Vec<usize>,
    /// Requests forwarded without the instruction.
    losses: Losses,
}

/// A mid-conversation instruction and the route it travels on.
struct Instruction {
    path: &'static str,
    /// The conversation field: `messages` or `input`.
    list: &'static str,
    role: &'static str,
    text: &'static str,
    /// The agent's request carrying a conversation.
    body: fn(&[Value]) -> Vec<u8>,
}

/// Replays `items` (the agent sends `items[..k]` for each `k` of `steps`) with the
/// instruction at `at`, checking that every forwarded request holding it still has its text,
/// verbatim in a message of its role or inside the summary.
async fn replay_placement(
    proxy: &TestProxy,
    mock: &MockUpstream,
    instruction: &Instruction,
    items: &[Value],
    steps: &[usize],
    at: usize,
) -> Placement {
    let Instruction {
        path,
        list,
        role,
        text,
        body,
    } = *instruction;
    let client = TestClient::http1();
    let key = format!("sk-agent-traffic-instruction-at-{at}");
    let mut placement = Placement {
        at,
        covered: Vec::new(),
        losses: Losses::default(),
    };
    let mut last_num = 0;
    for &k in steps {
        let what = format!(
            "instruction at {at}, request of {k} (boundaries so far {:?})",
            placement.covered
        );
        let sent = send(&client, proxy, mock, path, &key, &body(&items[..k])).await;
        assert_eq!(
            sent.ex.status,
            200,
            "{what}: {}",
            String::from_utf8_lossy(&sent.ex.body)
        );
        let num = sent.ex.compaction_num().unwrap_or(0);
        if k <= at {
            last_num = num;
            continue;
        }
        if num > last_num {
            let session = sent.ex.header("x-compactor-session").expect("session");
            placement.covered.push(covered(proxy, session).await);
            last_num = num;
        }
        let v = sent.forwarded_json();
        let view = View::of(&v[list]);
        if !(view.kept_verbatim(role, text) || view.summary_contains(text)) {
            placement.losses.record(
                format!("{what}, compaction #{num}: {text:?} is lost"),
                &view,
            );
        }
    }
    placement
}

/// Checks the sweep: every placement went through at least two compactions while the
/// conversation held the instruction; some compaction's boundary landed on the instruction (it
/// opens the kept tail) and some right after it (it is the last compacted message); and no
/// forwarded request lost it.
fn check_placements(placements: &[Placement]) {
    let report: Vec<String> = placements
        .iter()
        .map(|p| format!("at {}: boundaries {:?}", p.at, p.covered))
        .collect();
    for p in placements {
        assert!(
            p.covered.len() >= 2,
            "instruction at {}: two compactions while it is in the conversation ({report:?})",
            p.at
        );
    }
    let opens_tail = placements.iter().any(|p| p.covered.contains(&p.at));
    let ends_prefix = placements.iter().any(|p| p.covered.contains(&(p.at + 1)));
    assert!(
        opens_tail && ends_prefix,
        "the sweep puts a boundary on the instruction and right after it: {report:?}"
    );
    let mut all = Losses::default();
    for p in placements {
        all.lines.extend(p.losses.lines.iter().cloned());
        if all.first_summary.is_none() {
            all.first_summary.clone_from(&p.losses.first_summary);
        }
    }
    all.assert_none(&format!("the sweep ({report:?})"));
}

const SYSTEM_MID: Instruction = Instruction {
    path: CHAT,
    list: "messages",
    role: "system",
    text: "SYSTEM-MID: from now on answer in French",
    body: chat_body,
};

/// Breaks if a `system` message in the middle of the conversation is neither kept nor
/// summarised by some compaction: e.g. a later compaction that treats a system message opening
/// the kept tail as part of the never-compacted head (so it is dropped from the rewrite), or a
/// summary that leaves mid-conversation system messages out.
#[tokio::test]
async fn a_mid_conversation_system_message_survives_every_compaction() {
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    // 12, not 10: the opening is kept verbatim, so at 10 a compaction covers four short
    // messages, fewer tokens than the extractive summary's fixed sections, and the rewrite
    // would not be smaller.
    let proxy = TestProxy::start(&proxy_toml(&mock, "max_messages = 12\n", "extractive")).await;
    let base = coding_chat(16);
    let mut placements = Vec::new();
    for at in 2..=24 {
        if base[at]["role"] == "tool" {
            continue; // between a call and its output: not a valid conversation
        }
        let mut items = base.clone();
        items.insert(at, json!({"role": "system", "content": SYSTEM_MID.text}));
        let steps = chat_steps(&items);
        placements.push(replay_placement(&proxy, &mock, &SYSTEM_MID, &items, &steps, at).await);
    }
    check_placements(&placements);
    assert_eq!(provider.refused(), Vec::<String>::new());
    proxy.shutdown().await;
}

const DEVELOPER_MID: Instruction = Instruction {
    path: RESPONSES,
    list: "input",
    role: "developer",
    text: "DEVELOPER-MID: from now on answer in French",
    body: codex_body,
};

/// Breaks like the system-message test, for a Responses `developer` message.
#[tokio::test]
async fn a_mid_conversation_developer_message_survives_every_compaction() {
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    // 12, as for the system message: a Codex step (reasoning, call, output) counts two
    // messages, and at 10 no compaction's boundary lands on the instruction itself.
    let proxy = TestProxy::start(&proxy_toml(&mock, "max_messages = 12\n", "extractive")).await;
    // The Codex session's first two turns; the agent sends a request before each reasoning item.
    let base: Vec<Value> = codex_session().items[..52].to_vec();
    let mut placements = Vec::new();
    for at in 2..=40 {
        let kind = base[at]["type"].as_str().unwrap_or("");
        let opens = kind == "reasoning" || (kind == "message" && base[at]["role"] == "user");
        if !opens {
            continue; // inside one model response, or between a call and its output
        }
        let mut items = base.clone();
        items.insert(at, input_message("developer", DEVELOPER_MID.text));
        let steps: Vec<usize> = (1..items.len())
            .filter(|&i| items[i]["type"] == "reasoning")
            .collect();
        placements.push(replay_placement(&proxy, &mock, &DEVELOPER_MID, &items, &steps, at).await);
    }
    check_placements(&placements);
    assert_eq!(provider.refused(), Vec::<String>::new());
    proxy.shutdown().await;
}
