//! Sessions seen from the operator's side, over real sockets: the admin session API and manual
//! compaction (`POST /session/{id}/summarize`), the admin token, the per-session breaker after
//! repeated summarizer failures, eviction of the least recently used sessions under
//! `store.max_bytes`, the per-tenant share (`store.max_sessions_per_tenant`) that keeps one
//! tenant from evicting another's, and requests with made-up credentials, refused upstream,
//! that evict nobody's.
//!
//! One mock serves the agent's requests and the zero-config `openai` summarizer's calls (a
//! last user message starting with `<task>`), answering the n-th summarizer call `SUMMARY-<n>`,
//! or 500 while the test makes the summarizer fail.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use compactor::compaction::prompt::SUMMARY_INTRO;
use compactor::session::store::SESSION_OVERHEAD_BYTES;
use serde_json::{json, Value};

use support::provider_rules::{check_chat, rejection_body};
use support::summary_calls::{completion, prompt_of, received_since};
use support::{
    eventually, upstream_toml, Exchange, MockUpstream, Recorded, Reply, TestClient, TestProxy,
};

const CHAT: &str = "/v1/chat/completions";
const AUTH: &str = "Bearer sk-sessions-admin";
const WINDOW: usize = 128_000;
const COMPACTIONS: &str = "compactor_compactions_total";
/// The start of credentials the mock provider refuses with 401.
const MADE_UP: &str = "Bearer made-up-";

/// The mock provider.
#[derive(Default)]
struct Provider {
    summaries: AtomicUsize,
    /// Answer summarizer calls 500.
    failing: AtomicBool,
    /// Requests the provider refused (must stay 0).
    rejected: AtomicUsize,
}

impl Provider {
    fn install(mock: &MockUpstream) -> Arc<Provider> {
        let provider = Arc::new(Provider::default());
        let p = provider.clone();
        mock.set_handler(move |req: &Recorded| {
            // Credentials nobody issued: refused, as a provider does.
            if req
                .header("authorization")
                .is_some_and(|a| a.starts_with(MADE_UP))
            {
                return Reply::json(401, &json!({"error": {"type": "invalid_api_key"}}));
            }
            let Ok(v) = serde_json::from_slice::<Value>(&req.body) else {
                p.rejected.fetch_add(1, Ordering::SeqCst);
                return Reply::status(400);
            };
            if let Err(r) = check_chat(&v, WINDOW) {
                p.rejected.fetch_add(1, Ordering::SeqCst);
                return Reply::json(400, &rejection_body(&r));
            }
            if prompt_of(req).is_none() {
                return Reply::json(200, &completion("Next step."));
            }
            let n = p.summaries.fetch_add(1, Ordering::SeqCst) + 1;
            if p.failing.load(Ordering::SeqCst) {
                return Reply::status(500);
            }
            Reply::json(200, &completion(&format!("SUMMARY-{n}")))
        });
        provider
    }

    fn summaries(&self) -> usize {
        self.summaries.load(Ordering::SeqCst)
    }

    fn rejected(&self) -> usize {
        self.rejected.load(Ordering::SeqCst)
    }
}

/// A chat request of `messages` in session `session` (the `x-session-id` header).
async fn chat(
    client: &TestClient,
    proxy: &TestProxy,
    session: &str,
    messages: &[Value],
) -> Exchange {
    chat_as(client, proxy, AUTH, session, messages).await
}

/// [`chat`] as the tenant of credential `auth`.
async fn chat_as(
    client: &TestClient,
    proxy: &TestProxy,
    auth: &str,
    session: &str,
    messages: &[Value],
) -> Exchange {
    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "messages": messages})).expect("body");
    let headers = [
        ("content-type", "application/json"),
        ("authorization", auth),
        ("x-session-id", session),
    ];
    let ex = client
        .exchange("POST", &proxy.url(CHAT), &headers, body)
        .await;
    assert_eq!(ex.status, 200, "{}", String::from_utf8_lossy(&ex.body));
    assert_eq!(ex.header("x-compactor-session"), Some(session));
    ex
}

async fn admin(
    client: &TestClient,
    proxy: &TestProxy,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Exchange {
    let bearer = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(b) = &bearer {
        headers.push(("authorization", b.as_str()));
    }
    client
        .exchange(method, &proxy.admin_url(path), &headers, body.to_owned())
        .await
}

async fn session_ids(client: &TestClient, proxy: &TestProxy) -> Vec<String> {
    let ex = admin(client, proxy, "GET", "/sessions", None, "").await;
    assert_eq!(ex.status, 200);
    ex.json()["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_owned())
        .collect()
}

fn system() -> Value {
    json!({"role": "system", "content": "You are a coding agent."})
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn assistant(text: &str) -> Value {
    json!({"role": "assistant", "content": text})
}

/// `text` padded with filler to `len` characters.
fn long(text: &str, len: usize) -> String {
    let mut s = text.to_owned();
    while s.len() < len {
        s.push_str(" The billing service keeps invoices, payments and refunds.");
    }
    s
}

#[tokio::test]
async fn manual_summarize_compacts_a_session_and_the_next_request_uses_it() {
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let proxy = TestProxy::start(&upstream_toml(&mock.url())).await;
    let client = TestClient::http1();

    // Below every trigger: forwarded untouched. The opening (kept verbatim by any
    // compaction) is short; the long answer after it is what a summary replaces.
    let mut conversation = vec![
        system(),
        user("Let's work on the billing service."),
        assistant(&long(
            "Design the REST API of the billing service first.",
            2_000,
        )),
        assistant("I will start with the endpoints."),
        user("Go on."),
    ];
    let ex = chat(&client, &proxy, "s1", &conversation).await;
    assert_eq!(ex.header("x-compactor-compacted"), Some("false"));
    let short = vec![system(), user("hello")];
    let ex = chat(&client, &proxy, "s2", &short).await;
    assert_eq!(ex.header("x-compactor-compacted"), Some("false"));
    assert_eq!(provider.summaries(), 0);
    assert_eq!(
        session_ids(&client, &proxy).await,
        ["s2", "s1"],
        "newest first"
    );

    let seen = mock.requests().len();
    let ex = admin(
        &client,
        &proxy,
        "POST",
        "/session/s1/summarize",
        None,
        r#"{"instructions": "focus on the API"}"#,
    )
    .await;
    assert_eq!(ex.status, 200, "{}", String::from_utf8_lossy(&ex.body));
    let answer = ex.json();
    assert_eq!(answer["compacted"], true, "{answer}");
    assert_eq!(answer["session"], "s1");
    assert_eq!(answer["compaction_num"], 1);
    assert_eq!(answer["summary"], "SUMMARY-1");
    let covered = answer["covered_messages"].as_u64().expect("covered") as usize;
    assert!(
        (3..conversation.len()).contains(&covered),
        "covers part of the history: {answer}"
    );
    let (summaries, forwarded) = received_since(&mock, seen);
    assert!(forwarded.is_empty());
    assert_eq!(summaries.len(), 1);
    let prompt = prompt_of(&summaries[0]).expect("prompt");
    assert!(prompt.contains("focus on the API"), "{prompt:.2000}");
    assert!(prompt.contains("Design the REST API"), "{prompt:.2000}");
    assert_eq!(
        summaries[0].header("authorization"),
        Some(AUTH),
        "the session's own credentials"
    );
    assert_eq!(
        proxy
            .metric(
                COMPACTIONS,
                &[("trigger", "manual"), ("outcome", "compacted")]
            )
            .await,
        Some(1.0)
    );

    let info = admin(&client, &proxy, "GET", "/session/s1", None, "").await;
    assert_eq!(info.status, 200);
    let info = info.json();
    assert_eq!(info["id"], "s1");
    assert_eq!(info["compactions"], 1, "{info}");
    assert_eq!(info["latest"]["covered"], covered, "{info}");
    assert_eq!(info["latest"]["summary"], "SUMMARY-1", "{info}");
    assert_eq!(info["latest"]["compaction_num"], 1, "{info}");
    assert_eq!(info["breaker"], "closed");

    // The next request of the conversation carries the summary, without a new call.
    conversation.push(assistant("Endpoints: /invoices, /payments, /refunds."));
    conversation.push(user("Now the error format."));
    let seen = mock.requests().len();
    let ex = chat(&client, &proxy, "s1", &conversation).await;
    assert_eq!(ex.header("x-compactor-compacted"), Some("true"));
    assert_eq!(ex.header("x-compactor-compaction-num"), Some("1"));
    let (summaries, forwarded) = received_since(&mock, seen);
    assert!(summaries.is_empty(), "the stored summary is reused");
    let out: Value = serde_json::from_slice(&forwarded[0].body).expect("JSON");
    let out = out["messages"].as_array().expect("messages");
    assert_eq!(out[..2], conversation[..2], "system prompt and opening");
    let summary = out[2]["content"].as_str().expect("summary");
    assert!(summary.starts_with(SUMMARY_INTRO), "{summary}");
    assert!(summary.contains("SUMMARY-1"), "{summary}");
    assert_eq!(&out[3..], &conversation[covered..], "the rest verbatim");
    assert_eq!(session_ids(&client, &proxy).await, ["s1", "s2"]);

    // Unknown session, nothing to compact, a malformed body.
    let ex = admin(&client, &proxy, "POST", "/session/nope/summarize", None, "").await;
    assert_eq!(ex.status, 404);
    let ex = admin(&client, &proxy, "GET", "/session/nope", None, "").await;
    assert_eq!(ex.status, 404);
    let ex = admin(&client, &proxy, "POST", "/session/s2/summarize", None, "").await;
    assert_eq!(ex.status, 200);
    let answer = ex.json();
    assert_eq!(answer["compacted"], false, "{answer}");
    assert_eq!(answer["reason"], "nothing_to_compact", "{answer}");
    let ex = admin(
        &client,
        &proxy,
        "POST",
        "/session/s1/summarize",
        None,
        r#"{"instruction": "typo"}"#,
    )
    .await;
    assert_eq!(ex.status, 400);
    assert_eq!(provider.summaries(), 1);
    assert_eq!(provider.rejected(), 0);
    proxy.shutdown().await;
}

#[tokio::test]
async fn the_admin_token_guards_everything_but_the_probes() {
    let mock = MockUpstream::start().await;
    Provider::install(&mock);
    let proxy = TestProxy::start(&format!(
        "{}[admin]\ntoken = \"admin-secret-1\"\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let client = TestClient::http1();
    chat(&client, &proxy, "s1", &[system(), user("hello")]).await;

    for (method, path) in [
        ("GET", "/sessions"),
        ("GET", "/session/s1"),
        ("POST", "/session/s1/summarize"),
        ("GET", "/metrics"),
    ] {
        for token in [None, Some("wrong"), Some("admin-secret-")] {
            let ex = admin(&client, &proxy, method, path, token, "").await;
            assert_eq!(ex.status, 401, "{method} {path} with {token:?}");
        }
        let ex = admin(&client, &proxy, method, path, Some("admin-secret-1"), "").await;
        assert_eq!(
            ex.status,
            200,
            "{method} {path}: {}",
            String::from_utf8_lossy(&ex.body)
        );
    }
    for probe in ["/livez", "/readyz"] {
        let ex = admin(&client, &proxy, "GET", probe, None, "").await;
        assert_eq!(ex.status, 200, "{probe} needs no token");
    }
    proxy.shutdown().await;
}

/// Twelve messages: over `max_messages = 10`.
fn over_ten() -> Vec<Value> {
    let mut messages = vec![system()];
    for k in 0..5 {
        messages.push(user(&long(
            &format!("Step {k}: change the invoice model."),
            400,
        )));
        messages.push(assistant(&long(&format!("Done with step {k}."), 400)));
    }
    messages.push(user("Next."));
    messages
}

#[tokio::test]
async fn repeated_summarizer_failures_open_the_session_breaker_until_the_cooldown() {
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    provider.failing.store(true, Ordering::SeqCst);
    // 1 s rather than less: the fourth request must reach the proxy within the cooldown even
    // on a busy machine.
    let proxy = TestProxy::start(&format!(
        "{}[compaction]\nmax_messages = 10\nbreaker_cooldown_secs = 1.0\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let client = TestClient::http1();
    let messages = over_ten();
    let failed = [("trigger", "messages"), ("outcome", "failed")];
    let breaker = [("trigger", "messages"), ("outcome", "breaker")];

    for k in 1..=3 {
        let ex = chat(&client, &proxy, "brk", &messages).await;
        assert_eq!(
            ex.header("x-compactor-compacted"),
            Some("false"),
            "failure {k}"
        );
        assert_eq!(
            provider.summaries(),
            k,
            "failure {k}: the summarizer was asked"
        );
        assert_eq!(proxy.metric(COMPACTIONS, &failed).await, Some(k as f64));
    }
    assert_eq!(
        proxy.metric("compactor_breaker_open_total", &[]).await,
        Some(1.0)
    );
    let info = admin(&client, &proxy, "GET", "/session/brk", None, "")
        .await
        .json();
    assert_eq!(info["breaker"], "open", "{info}");
    assert_eq!(info["consecutive_failures"], 3, "{info}");

    // The 4th triggering request is not compacted, and the summarizer is left alone.
    let ex = chat(&client, &proxy, "brk", &messages).await;
    assert_eq!(ex.header("x-compactor-compacted"), Some("false"));
    assert_eq!(provider.summaries(), 3, "no summarizer call while open");
    assert_eq!(proxy.metric(COMPACTIONS, &breaker).await, Some(1.0));
    assert_eq!(proxy.metric(COMPACTIONS, &failed).await, Some(3.0));
    assert_eq!(
        proxy.metric("compactor_breaker_open_total", &[]).await,
        Some(1.0)
    );

    // The summarizer recovers; once the cooldown is over the next request compacts.
    provider.failing.store(false, Ordering::SeqCst);
    let (c, p) = (&client, &proxy);
    eventually("the breaker's cooldown", || async move {
        let info = admin(c, p, "GET", "/session/brk", None, "").await.json();
        (info["breaker"] == "half_open").then_some(())
    })
    .await;
    let ex = chat(&client, &proxy, "brk", &messages).await;
    assert_eq!(ex.header("x-compactor-compacted"), Some("true"));
    assert_eq!(ex.header("x-compactor-compaction-num"), Some("1"));
    assert_eq!(provider.summaries(), 4);
    assert_eq!(
        proxy
            .metric(
                COMPACTIONS,
                &[("trigger", "messages"), ("outcome", "compacted")]
            )
            .await,
        Some(1.0)
    );
    let info = admin(&client, &proxy, "GET", "/session/brk", None, "")
        .await
        .json();
    assert_eq!(info["breaker"], "closed", "{info}");
    assert_eq!(info["consecutive_failures"], 0, "{info}");
    assert_eq!(provider.rejected(), 0);
    proxy.shutdown().await;
}

/// Six messages (over `max_messages = 5`), distinct per session.
fn session_conversation(i: usize) -> Vec<Value> {
    vec![
        system(),
        user(&long(&format!("Task {i}: add the refunds endpoint."), 300)),
        assistant(&long(&format!("Plan for task {i}."), 300)),
        user(&long(&format!("Task {i}: also validate amounts."), 300)),
        assistant(&long(&format!("Validation for task {i}."), 300)),
        user(&format!("Task {i}: continue.")),
    ]
}

#[tokio::test]
async fn the_least_recently_used_sessions_are_evicted_under_max_bytes() {
    const MAX_BYTES: usize = 8_192;
    const SESSIONS: usize = 8;
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let proxy = TestProxy::start(&format!(
        // One tenant here: its share is the whole store (the default share, a tenth of
        // `max_bytes`, would not hold a single session).
        "{}[compaction]\nmax_messages = 5\nbackground_ratio = 0\n\
         [store]\nmax_bytes = {MAX_BYTES}\nmax_sessions_per_tenant = 10000\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let client = TestClient::http1();

    // s0, the oldest, is used again before each new session: least recently used is then s1.
    for i in 0..SESSIONS {
        if i > 0 {
            let ex = chat(&client, &proxy, "s0", &session_conversation(0)).await;
            assert_eq!(
                ex.header("x-compactor-compaction-num"),
                Some("1"),
                "s0 reused"
            );
        }
        let ex = chat(&client, &proxy, &format!("s{i}"), &session_conversation(i)).await;
        assert_eq!(ex.header("x-compactor-compacted"), Some("true"), "s{i}");
        assert_eq!(ex.header("x-compactor-compaction-num"), Some("1"), "s{i}");
    }
    assert_eq!(
        provider.summaries(),
        SESSIONS,
        "each session compacted once"
    );

    let ex = admin(&client, &proxy, "GET", "/session/s1", None, "").await;
    assert_eq!(
        ex.status, 404,
        "the least recently used session was evicted"
    );
    let ex = admin(&client, &proxy, "GET", "/session/s0", None, "").await;
    assert_eq!(
        ex.status, 200,
        "the oldest but recently used session is kept"
    );
    let newest = admin(
        &client,
        &proxy,
        "GET",
        &format!("/session/s{}", SESSIONS - 1),
        None,
        "",
    )
    .await;
    assert_eq!(newest.status, 200, "the newest is kept");
    assert_eq!(newest.json()["compactions"], 1);

    // Every session holds at least its overhead and its latest request body.
    let body_len =
        serde_json::to_vec(&json!({"model": "gpt-4o", "messages": session_conversation(0)}))
            .expect("body")
            .len();
    let fits = MAX_BYTES / (SESSION_OVERHEAD_BYTES + body_len);
    let held = proxy
        .metric("compactor_sessions", &[])
        .await
        .expect("gauge");
    assert!(
        held >= 1.0 && held <= fits as f64,
        "{held} sessions held, at most {fits} fit"
    );
    let evicted = proxy
        .metric("compactor_store_evictions_total", &[])
        .await
        .expect("counter");
    assert!(
        evicted > 0.0 && evicted + held == SESSIONS as f64,
        "{evicted} evicted, {held} held"
    );
    let listed = session_ids(&client, &proxy).await;
    assert_eq!(listed.len() as f64, held, "{listed:?}");
    assert_eq!(listed[0], format!("s{}", SESSIONS - 1), "{listed:?}");

    // The evicted session's checkpoint went with it: its conversation compacts again.
    let ex = chat(&client, &proxy, "s1", &session_conversation(1)).await;
    assert_eq!(ex.header("x-compactor-compaction-num"), Some("1"));
    assert_eq!(provider.summaries(), SESSIONS + 1);
    assert_eq!(provider.rejected(), 0);
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_tenant_flooding_sessions_evicts_only_its_own() {
    const FLOOD: &str = "Bearer sk-flooding-tenant";
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    // Room for four sessions, two per tenant: without the share, the flood's fourth session
    // would evict the quiet tenant's.
    let proxy = TestProxy::start(&format!(
        "{}[compaction]\nmax_messages = 5\nbackground_ratio = 0\n\
         [store]\nmax_sessions = 4\nmax_sessions_per_tenant = 2\n",
        upstream_toml(&mock.url())
    ))
    .await;
    let client = TestClient::http1();

    let quiet = session_conversation(0);
    let ex = chat(&client, &proxy, "quiet", &quiet).await;
    assert_eq!(ex.header("x-compactor-compaction-num"), Some("1"));
    assert_eq!(provider.summaries(), 1);

    const FLOODED: usize = 6;
    for i in 1..=FLOODED {
        let ex = chat_as(
            &client,
            &proxy,
            FLOOD,
            &format!("flood{i}"),
            &session_conversation(i),
        )
        .await;
        assert_eq!(
            ex.header("x-compactor-compaction-num"),
            Some("1"),
            "flood{i}"
        );
    }
    assert_eq!(provider.summaries(), 1 + FLOODED);

    // The flood kept its two most recent sessions and evicted only its own.
    assert_eq!(
        session_ids(&client, &proxy).await,
        ["flood6", "flood5", "quiet"]
    );
    let evicted = proxy
        .metric("compactor_store_evictions_total", &[])
        .await
        .expect("counter");
    assert_eq!(evicted, (FLOODED - 2) as f64);

    // The quiet tenant's summary is still there: its next request splices it, no new call.
    let ex = chat(&client, &proxy, "quiet", &quiet).await;
    assert_eq!(ex.header("x-compactor-compaction-num"), Some("1"));
    assert_eq!(provider.summaries(), 1 + FLOODED, "no new summarizer call");
    let info = admin(&client, &proxy, "GET", "/session/quiet", None, "").await;
    assert_eq!(info.status, 200);
    assert_eq!(info.json()["compactions"], 1);
    assert_eq!(provider.rejected(), 0);
    proxy.shutdown().await;
}

#[tokio::test]
async fn requests_the_provider_refuses_as_unauthorised_evict_no_established_session() {
    const ESTABLISHED: usize = 10;
    const FLOOD: usize = 300;
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    // Room for two more sessions than the established tenant holds, and no per-tenant share to
    // hide behind (every made-up credential is a tenant of its own anyway).
    let proxy = TestProxy::start(&format!(
        "{}[compaction]\nmax_messages = 5\nbackground_ratio = 0\n\
         [store]\nmax_sessions = {}\nmax_sessions_per_tenant = 10000\n",
        upstream_toml(&mock.url()),
        ESTABLISHED + 2
    ))
    .await;
    let client = TestClient::http1();
    for i in 0..ESTABLISHED {
        let ex = chat(&client, &proxy, &format!("s{i}"), &session_conversation(i)).await;
        assert_eq!(ex.header("x-compactor-compaction-num"), Some("1"));
    }
    assert_eq!(provider.summaries(), ESTABLISHED);

    // Each with a fresh random credential and its own conversation, all refused upstream.
    let url = proxy.url(CHAT);
    for i in 0..FLOOD {
        let auth = format!("{MADE_UP}{:016x}", rand_u64(i));
        let body = serde_json::to_vec(&json!({"model": "gpt-4o",
            "messages": [system(), user(&format!("Flood {i}: hello."))]}))
        .expect("body");
        let headers = [
            ("content-type", "application/json"),
            ("authorization", auth.as_str()),
        ];
        let ex = client.exchange("POST", &url, &headers, body).await;
        assert_eq!(ex.status, 401, "the provider's answer, passed on");
    }

    // Nothing the refused requests recorded is left, and every established session is.
    let mut ids = session_ids(&client, &proxy).await;
    ids.sort();
    let mut expected: Vec<String> = (0..ESTABLISHED).map(|i| format!("s{i}")).collect();
    expected.sort();
    assert_eq!(ids, expected);
    assert_eq!(
        proxy.metric("compactor_store_evictions_total", &[]).await,
        Some(0.0)
    );
    // Their summaries are spliced again: no new summarizer call.
    for i in 0..ESTABLISHED {
        let ex = chat(&client, &proxy, &format!("s{i}"), &session_conversation(i)).await;
        assert_eq!(ex.header("x-compactor-compaction-num"), Some("1"), "s{i}");
    }
    assert_eq!(provider.summaries(), ESTABLISHED, "no summary made again");
    assert_eq!(provider.rejected(), 0);
    proxy.shutdown().await;
}

/// A credential-shaped value per `i`, different for every `i` (splitmix64).
fn rand_u64(i: usize) -> u64 {
    let mut z = (i as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
