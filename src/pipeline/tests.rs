//! The request-level flow against real agents' shapes and the failure classes of the
//! "never drop, never skip" rules: panics caught, empty lists after a checkpoint, a request
//! that is exactly a covered prefix, a system message at a stored boundary, loops across
//! requests (calibrated sizing, still-over results feeding the breaker), blank summaries,
//! and the person's own words pinned.
use super::*;
use crate::compaction::engine::{LATEST_USER_CLOSE, LATEST_USER_OPEN};
use crate::session::{MemoryStore, StoreLimits};
use crate::testing::{
    body, caller, chat, compactions, compactor, config, messages_of, FakeSummarizer, Reply, SMALL,
};
use serde_json::{json, Value};

async fn send(c: &Arc<Pipeline>, messages: &[Value]) -> Outcome {
    c.process(
        DialectKind::ChatCompletions,
        &body("tiny", messages.to_vec()),
        &caller(),
    )
    .await
}

/// Handles one chat request of `messages` from `caller` (no session header) and waits for the
/// background summaries it started; returns its session id.
async fn session_of_request(
    c: &Arc<Pipeline>,
    caller: &Arc<Caller>,
    messages: Vec<Value>,
) -> String {
    let context = RequestContext {
        caller,
        session_header: None,
        long_context: false,
        attempts: &Attempts::per_request(),
        mode: None,
    };
    let body = Bytes::from(body("tiny", messages));
    let processed = c
        .handle(DialectKind::ChatCompletions, &body, &context)
        .await;
    c.background_idle().await;
    processed.session_id.expect("a conversation has a session")
}

/// The rewritten body of an outcome that rewrote or reused, else a panic naming `what`.
fn forwarded(what: &str, out: &Outcome) -> Vec<Value> {
    match out {
        Outcome::Rewritten { body, .. } | Outcome::Reused { body, .. } => messages_of(body),
        other => panic!("{what}: expected a rewrite, got {other:?}"),
    }
}

#[tokio::test]
async fn a_panic_in_compaction_forwards_the_original_and_is_counted() {
    // Without the guard in `handle` the panic unwinds into the caller (this test fails
    // with the fake's panic message).
    let fake = FakeSummarizer::new(vec![Reply::Panic, Reply::Text("Recovered.".into())]);
    let (c, metrics) = compactor(&config(SMALL), fake.clone());
    let out = send(&c, &chat(12)).await;
    assert!(matches!(out, Outcome::Unchanged), "{out:?}");
    assert_eq!(compactions(&metrics, "none", "panic"), 1);
    // The single flight and the store were left usable: the next request compacts.
    let out = send(&c, &chat(12)).await;
    assert!(matches!(out, Outcome::Rewritten { .. }), "{out:?}");
    assert_eq!(fake.requests().len(), 2);
    assert_eq!(compactions(&metrics, "none", "panic"), 1);
}

#[tokio::test]
async fn empty_and_tiny_lists_after_a_checkpoint_pass_through_in_every_dialect() {
    let (c, metrics) = compactor(&config(SMALL), FakeSummarizer::text("S."));
    assert!(matches!(
        send(&c, &chat(12)).await,
        Outcome::Rewritten { .. }
    ));
    assert!(
        c.store()
            .max_covered(TenantId::from_caller(&caller()))
            .await
            .unwrap_or(0)
            > 0,
        "a checkpoint exists"
    );
    let bodies: [(DialectKind, &str); 6] = [
        (
            DialectKind::ChatCompletions,
            r#"{"model":"tiny","messages":[]}"#,
        ),
        (
            DialectKind::Messages,
            r#"{"model":"tiny","max_tokens":10,"messages":[]}"#,
        ),
        (DialectKind::Responses, r#"{"model":"tiny","input":[]}"#),
        (
            DialectKind::ChatCompletions,
            r#"{"model":"tiny","messages":[{"role":"system","content":"You are helpful."}]}"#,
        ),
        (
            DialectKind::Messages,
            r#"{"model":"tiny","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}"#,
        ),
        (
            DialectKind::Responses,
            r#"{"model":"tiny","input":[{"role":"user","content":"hi"}]}"#,
        ),
    ];
    for (dialect, b) in bodies {
        let out = c.process(dialect, b.as_bytes(), &caller()).await;
        assert!(
            matches!(out, Outcome::Unchanged),
            "{dialect:?} {b}: {out:?}"
        );
    }
    assert_eq!(compactions(&metrics, "none", "panic"), 0);
}

#[tokio::test]
async fn a_request_that_is_exactly_a_covered_prefix_is_compacted() {
    let fake = FakeSummarizer::text("S.");
    let (c, metrics) = compactor(&config(SMALL), fake.clone());
    let all = chat(30);
    let first = forwarded("first compaction", &send(&c, &all).await);
    let covered = all.len() - (first.len() - 2);
    assert!(
        covered > 11,
        "the covered prefix alone is over max_messages ({covered})"
    );
    // The history is exactly what the checkpoint covers: it leaves no tail to splice onto,
    // so it must be compacted afresh, not forwarded whole.
    let out = send(&c, &all[..covered]).await;
    let sent = forwarded("covered prefix", &out);
    assert!(matches!(out, Outcome::Rewritten { .. }), "{out:?}");
    assert!(sent.len() <= 10, "{} messages forwarded", sent.len());
    assert_eq!(fake.requests().len(), 2);
    assert_eq!(compactions(&metrics, "messages", "compacted"), 2);
}

#[tokio::test]
async fn a_system_message_where_a_compaction_ended_is_summarised_next_time() {
    const MID: &str = "SYSTEM-MID: from now on answer in French";
    // A summarizer window that holds every turn: what is tested is the splice, not the
    // prompt fitting.
    let toml = "[compaction]\nmax_messages = 10\nmin_preserve_tokens = 20\n\
                max_preserve_tokens = 60\n[models.tiny]\ncontext_window = 16000\n";
    let mut on_boundary = 0;
    for at in 3..28 {
        let fake = FakeSummarizer::text("S.");
        let (c, _) = compactor(&config(toml), fake.clone());
        let mut all = chat(40);
        all.insert(at, json!({"role": "system", "content": MID}));
        // First compaction: note whether its boundary fell on the system message.
        let first = forwarded("first", &send(&c, &all[..30]).await);
        if 30 - (first.len() - 2) == at {
            on_boundary += 1;
        }
        // Second compaction of the whole conversation: the system message is either still
        // a message of the forwarded request or was in what a summarizer was asked about.
        let out = send(&c, &all).await;
        let Outcome::Rewritten { body, result, .. } = &out else {
            panic!("at={at}: expected a second compaction, got {out:?}");
        };
        assert_eq!(result.compaction_num, 2, "at={at}");
        let kept = messages_of(body).iter().any(|m| m["content"] == MID);
        let summarised = fake.requests().iter().any(|r| r.prompt.contains(MID));
        assert!(kept || summarised, "at={at}: the system message was lost");
    }
    assert!(
        on_boundary > 0,
        "no case put the boundary on the system message"
    );
}

#[tokio::test]
async fn the_rewrite_is_sized_with_the_calibrated_estimate() {
    // The provider counts twice compactor's estimate for this model. The engine must size
    // the rewrite so that the *calibrated* estimate is under the trigger; sized with the
    // raw estimate, the next request of the conversation compacts again.
    let toml = "[compaction]\nmin_preserve_tokens = 300\nmax_preserve_tokens = 300\n\
                [models.tiny]\ncontext_window = 2000\n";
    let fake = FakeSummarizer::text("S.");
    let (c, metrics) = compactor(&config(toml), fake.clone());
    c.calibration().observe("tiny", 1_000, 2_000);
    let mut all = vec![json!({"role": "system", "content": "sys"})];
    for i in 0..40 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        all.push(json!({"role": role, "content": format!("m{i} {}", "y".repeat(160))}));
    }
    let out = send(&c, &all).await;
    assert!(
        matches!(
            out,
            Outcome::Rewritten {
                trigger: Trigger::Tokens,
                ..
            }
        ),
        "{out:?}"
    );
    let calls = fake.requests().len();
    for i in 40..42 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        all.push(json!({"role": role, "content": format!("m{i} short")}));
    }
    let out = send(&c, &all).await;
    assert!(matches!(out, Outcome::Reused { .. }), "{out:?}");
    assert_eq!(fake.requests().len(), calls, "no second compaction");
    assert_eq!(compactions(&metrics, "tokens", "compacted"), 1);
}

#[tokio::test]
async fn rewrites_still_over_the_trigger_open_the_session_breaker() {
    // The last message alone is over the token trigger: every compaction shrinks the
    // request but cannot bring it under, so each counts as a failure and the breaker stops
    // the summarizer calls after three.
    let fake = FakeSummarizer::text("S.");
    let (c, metrics) = compactor(&config(SMALL), fake.clone());
    let big = json!({"role": "user", "content": "z".repeat(5_000)}); // 1,000 tokens
    let mut calls = Vec::new();
    for k in 0..5 {
        let mut m = chat(12 + 2 * k);
        m.push(big.clone());
        let out = send(&c, &m).await;
        assert!(!matches!(out, Outcome::Unchanged), "k={k}: {out:?}");
        calls.push(fake.requests().len());
    }
    assert_eq!(
        metrics.breaker_open.get(),
        1,
        "calls per request: {calls:?}"
    );
    assert_eq!(
        calls[4], calls[3],
        "no summarizer call once the breaker is open"
    );
    let breaker =
        compactions(&metrics, "messages", "breaker") + compactions(&metrics, "tokens", "breaker");
    assert!(breaker >= 1, "the fifth request met the open breaker");
}

#[tokio::test]
async fn invisible_or_pin_only_summaries_are_blank() {
    let pin_only = format!("{LATEST_USER_OPEN}\nmessage 10\n{LATEST_USER_CLOSE}");
    for reply in ["\u{200B}\u{FEFF} \n\u{2060}".to_string(), pin_only] {
        let (c, metrics) = compactor(&config(SMALL), FakeSummarizer::text(&reply));
        let out = send(&c, &chat(12)).await;
        assert!(matches!(out, Outcome::Failed), "{reply:?}: {out:?}");
        assert_eq!(compactions(&metrics, "messages", "blank"), 1, "{reply:?}");
    }
}

#[tokio::test]
async fn the_persons_own_words_are_pinned_and_lead_their_turn_in_the_prompt() {
    // A Claude Code turn: injected context blocks first, the typed words last.
    let reminder = format!(
        "<system-reminder>\nAs you answer the user's questions, you can use the following \
         context:\n# claudeMd\n{}\n</system-reminder>",
        "Always run the tests. ".repeat(60)
    );
    let words = "Does it also properly handle the outline of the text box?";
    let fake = FakeSummarizer::text("Work so far.");
    // A summarizer window large enough for the whole turn.
    let toml = "[compaction]\nmax_messages = 10\nmin_preserve_tokens = 20\n\
                max_preserve_tokens = 60\n[models.tiny]\ncontext_window = 16000\n";
    let (c, _) = compactor(&config(toml), fake.clone());
    // A later turn: the conversation's opening is kept verbatim, never summarised.
    let mut m = vec![
        json!({"role": "system", "content": "You are an agent."}),
        json!({"role": "user", "content": "hello"}),
        json!({"role": "assistant", "content": "Hello! What shall we work on?"}),
        json!({"role": "user", "content": [
            {"type": "text", "text": reminder},
            {"type": "text", "text": "<command-name>/clear</command-name>"},
            {"type": "text", "text": words},
        ]}),
    ];
    for i in 0..8 {
        let id = format!("call_{i}");
        m.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": id,
            "type": "function", "function": {"name": "Read",
            "arguments": format!("{{\"file_path\": \"src/f{i}.ts\"}}")}}]}),
        );
        m.push(json!({"role": "tool", "tool_call_id": id, "content": "x".repeat(60)}));
    }
    let out = send(&c, &m).await;
    let sent = forwarded("claude code turn", &out);
    assert_eq!(sent[..2], m[..2], "system prompt and opening kept");
    let summary = sent[2]["content"].as_str().expect("summary text");
    let pin = format!("{LATEST_USER_OPEN}\n{words}\n{LATEST_USER_CLOSE}");
    assert!(summary.contains(&pin), "{summary}");
    assert!(!summary.contains("claudeMd"), "context is not pinned");
    let prompt = &fake.requests()[0].prompt;
    let (w, r) = (prompt.find(words), prompt.find("<system-reminder>"));
    assert!(
        w.is_some() && r.is_some() && w < r,
        "own words lead the turn: {prompt}"
    );
}

#[tokio::test]
async fn summaries_made_ahead_and_manual_compactions_answer_to_the_conversations_breaker() {
    // SMALL compacts beyond 10 messages; 8 are over the background watermark (0.7 × 10).
    let fake = FakeSummarizer::new(vec![Reply::Error]);
    let config = config(SMALL);
    let (c, metrics) = compactor(&config, fake.clone());
    // Routed to the configured upstream, so a manual compaction may call the summarizer.
    let caller = Arc::new(Caller {
        upstream_base_url: config.upstream.base_url.clone(),
        ..Caller::default()
    });
    let tenant = TenantId::from_caller(&caller);
    let handle = |messages: Vec<Value>| session_of_request(&c, &caller, messages);
    let failures = |session: String| {
        let c = c.clone();
        async move {
            let info = c.store().session(&session).await.expect("store");
            info.expect("session recorded").consecutive_failures
        }
    };

    // A failing summary made ahead is a failure of the conversation's breaker.
    let session = handle(chat(8)).await;
    assert_eq!(metrics.background_counted(BackgroundOutcome::Failed), 1);
    assert_eq!(failures(session.clone()).await, 1, "fed by the background");

    // Two more failures (from any path) open it: a manual compaction is refused without a call.
    for _ in 0..2 {
        c.store()
            .record_compaction(tenant, &session, false)
            .await
            .expect("store");
    }
    let calls = fake.requests().len();
    let manual = c.compact_session(&session, None).await;
    assert!(
        matches!(
            manual,
            ManualOutcome::NotCompacted {
                reason: "breaker_open"
            }
        ),
        "{manual:?}"
    );
    assert_eq!(
        fake.requests().len(),
        calls,
        "no call past the open breaker"
    );
    assert_eq!(compactions(&metrics, "manual", "breaker"), 1);

    // Another conversation whose breaker is open before its first summary made ahead.
    let mut other = chat(3);
    other[0] = json!({"role": "system", "content": "You are another agent."});
    let session = handle(other.clone()).await;
    for _ in 0..3 {
        c.store()
            .record_compaction(tenant, &session, false)
            .await
            .expect("store");
    }
    let calls = fake.requests().len();
    other.extend(chat(8).into_iter().skip(4));
    assert_eq!(handle(other).await, session);
    assert_eq!(metrics.background_counted(BackgroundOutcome::Breaker), 1);
    assert_eq!(
        fake.requests().len(),
        calls,
        "no summary made ahead past the breaker"
    );
}

/// A memory store whose checkpoint writes all fail (a backend that cannot take them).
struct NoCheckpoints(MemoryStore);

impl SessionStore for NoCheckpoints {
    fn record_cost<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        cost: crate::session::SessionCost,
    ) -> compactor_plugin_api::BoxFuture<'a, Result<(), StoreError>> {
        self.0.record_cost(tenant, id, cost)
    }

    fn longest_checkpoint<'a>(
        &'a self,
        tenant: TenantId,
        hashes: &'a [crate::session::ChainHash],
    ) -> compactor_plugin_api::BoxFuture<'a, Result<Option<Arc<Checkpoint>>, StoreError>> {
        self.0.longest_checkpoint(tenant, hashes)
    }
    fn put_checkpoint(
        &self,
        _: TenantId,
        _: crate::session::ChainHash,
        _: Arc<Checkpoint>,
    ) -> compactor_plugin_api::BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(Err(StoreError::Backend("full".into()))))
    }
    fn touch_session<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        latest: LatestRequest,
        seen: usize,
    ) -> compactor_plugin_api::BoxFuture<'a, Result<(), StoreError>> {
        self.0.touch_session(tenant, id, latest, seen)
    }
    fn claim_opening<'a>(
        &'a self,
        tenant: TenantId,
        opening: &'a str,
        candidate: &'a str,
    ) -> compactor_plugin_api::BoxFuture<'a, Result<String, StoreError>> {
        self.0.claim_opening(tenant, opening, candidate)
    }
    fn provider_answered<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        answer: crate::session::ProviderAnswer,
    ) -> compactor_plugin_api::BoxFuture<'a, Result<(), StoreError>> {
        self.0.provider_answered(tenant, id, answer)
    }
    fn session<'a>(
        &'a self,
        id: &'a str,
    ) -> compactor_plugin_api::BoxFuture<'a, Result<Option<crate::session::SessionInfo>, StoreError>>
    {
        self.0.session(id)
    }
    fn latest_request<'a>(
        &'a self,
        id: &'a str,
    ) -> compactor_plugin_api::BoxFuture<'a, Result<Option<LatestRequest>, StoreError>> {
        self.0.latest_request(id)
    }
    fn list_sessions(
        &self,
        limit: usize,
    ) -> compactor_plugin_api::BoxFuture<'_, Result<Vec<crate::session::SessionInfo>, StoreError>>
    {
        self.0.list_sessions(limit)
    }
    fn compaction_allowed<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
    ) -> compactor_plugin_api::BoxFuture<'a, Result<bool, StoreError>> {
        self.0.compaction_allowed(tenant, id)
    }
    fn max_covered(
        &self,
        tenant: TenantId,
    ) -> compactor_plugin_api::BoxFuture<'_, Result<usize, StoreError>> {
        self.0.max_covered(tenant)
    }
    fn stats(
        &self,
    ) -> compactor_plugin_api::BoxFuture<'_, Result<crate::session::StoreStats, StoreError>> {
        SessionStore::stats(&self.0)
    }
    fn record_compaction<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        succeeded: bool,
    ) -> compactor_plugin_api::BoxFuture<'a, Result<bool, StoreError>> {
        self.0.record_compaction(tenant, id, succeeded)
    }
    fn learned_window<'a>(
        &'a self,
        upstream: &'a str,
        model: &'a str,
    ) -> compactor_plugin_api::BoxFuture<'a, Result<Option<LearnedWindow>, StoreError>> {
        self.0.learned_window(upstream, model)
    }
    fn learn_window<'a>(
        &'a self,
        key: &'a WindowKey,
        window: LearnedWindow,
    ) -> compactor_plugin_api::BoxFuture<'a, Result<bool, StoreError>> {
        self.0.learn_window(key, window)
    }
    fn learned_windows(
        &self,
    ) -> compactor_plugin_api::BoxFuture<'_, Result<Vec<(WindowKey, LearnedWindow)>, StoreError>>
    {
        self.0.learned_windows()
    }
    fn raise_mask_floor<'a>(
        &'a self,
        tenant: TenantId,
        id: &'a str,
        covered: usize,
        need: MaskNeed,
    ) -> compactor_plugin_api::BoxFuture<'a, Result<usize, StoreError>> {
        self.0.raise_mask_floor(tenant, id, covered, need)
    }
}

#[tokio::test]
async fn a_manual_compaction_not_stored_answers_and_counts_the_same() {
    let fake = FakeSummarizer::text("S.");
    let config = config(SMALL);
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let store = Arc::new(NoCheckpoints(MemoryStore::new(StoreLimits {
        max_sessions: 10,
        max_bytes: 1 << 20,
        max_sessions_per_tenant: 10,
        ttl: Duration::from_secs(60),
    })));
    let c = Arc::new(Pipeline::with_store(
        &config,
        fake.clone(),
        metrics.clone(),
        store,
    ));
    let caller = Arc::new(Caller {
        upstream_base_url: config.upstream.base_url.clone(),
        ..Caller::default()
    });
    let context = RequestContext {
        caller: &caller,
        session_header: Some("manual-not-stored"),
        long_context: false,
        attempts: &Attempts::per_request(),
        mode: None,
    };
    let body = Bytes::from(body("tiny", chat(6)));
    c.handle(DialectKind::ChatCompletions, &body, &context)
        .await;
    c.background_idle().await;

    let calls = fake.requests().len();
    let answer = c.compact_session("manual-not-stored", None).await;
    assert!(
        matches!(
            answer,
            ManualOutcome::NotCompacted {
                reason: "checkpoint_not_stored"
            }
        ),
        "{answer:?}"
    );
    assert!(fake.requests().len() > calls, "the summary was made");
    assert_eq!(compactions(&metrics, "manual", "compacted"), 0);
    assert_eq!(compactions(&metrics, "manual", "not_stored"), 1);
}

#[tokio::test]
async fn two_conversations_that_open_alike_are_two_sessions_from_the_first_reply_on() {
    // The same task started twice (an eval harness): one system prompt, one first
    // instruction, then each run's own replies, interleaved request by request.
    let fake = FakeSummarizer::text("S.");
    let (c, _) = compactor(&config(SMALL), fake);
    let caller = caller();
    let tenant = TenantId::from_caller(&caller);
    let opening = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the failing test in invoice.py."}),
    ];
    let run = |tag: &str, turns: usize| {
        let mut m = opening.clone();
        for k in 0..turns {
            m.push(json!({"role": "assistant", "content": format!("{tag}: step {k}")}));
            m.push(json!({"role": "user", "content": format!("{tag}: output {k}")}));
        }
        m
    };
    let session = |messages: Vec<Value>| session_of_request(&c, &caller, messages);
    let first_a = session(opening.clone()).await;
    let first_b = session(opening.clone()).await;
    assert_eq!(
        first_a, first_b,
        "identical so far: nothing tells them apart"
    );
    let (mut ids_a, mut ids_b) = (Vec::new(), Vec::new());
    for turns in 1..4 {
        ids_a.push(session(run("run A", turns)).await);
        ids_b.push(session(run("run B", turns)).await);
    }
    // A replied first: its id is the opening's on every request; B has its own from its
    // first reply on.
    assert!(ids_a.iter().all(|id| *id == first_a), "{ids_a:?}");
    assert!(ids_b.iter().all(|id| *id == ids_b[0]), "{ids_b:?}");
    assert_ne!(ids_a[0], ids_b[0], "parted at the first reply");

    // Each has its own latest request and breaker.
    let latest = c.store().latest_request(&ids_a[0]).await.expect("store");
    let latest = latest.expect("A's latest request");
    assert!(String::from_utf8_lossy(&latest.body).contains("run A: output 2"));
    for _ in 0..3 {
        c.store()
            .record_compaction(tenant, &ids_a[0], false)
            .await
            .expect("store");
    }
    let allowed = |id: String| {
        let c = c.clone();
        async move {
            c.store()
                .compaction_allowed(tenant, &id)
                .await
                .expect("store")
        }
    };
    assert!(!allowed(ids_a[0].clone()).await, "A's breaker is open");
    assert!(allowed(ids_b[0].clone()).await, "B's is not");
}

#[tokio::test]
async fn a_summary_ahead_that_would_not_help_is_not_needed_not_a_failure() {
    // Over the background watermark (8 of 10 messages); the summary the summarizer writes is
    // longer than what it would replace, so nothing is stored, nothing warned, and the
    // conversation's breaker is not told.
    let fake = FakeSummarizer::text(&"a long summary ".repeat(400));
    let (c, metrics) = compactor(&config(SMALL), fake.clone());
    let caller = caller();
    let session = session_of_request(&c, &caller, chat(8)).await;
    assert!(!fake.requests().is_empty(), "a summary was asked for");
    assert_eq!(metrics.background_counted(BackgroundOutcome::NotNeeded), 1);
    assert_eq!(metrics.background_counted(BackgroundOutcome::Failed), 0);
    let info = c.store().session(&session).await.expect("store");
    assert_eq!(info.expect("session").consecutive_failures, 0);
}

/// The requests (by turn) that waited for a summary in a session paced like the scripted
/// Codex sessions of issue 28: a turn every half second adding a reply and a tool output,
/// summaries that take four seconds (tokio's clock, paused: the test takes no real time).
async fn turns_that_waited(pacing: bool, output_lines: usize) -> (Vec<usize>, usize) {
    let toml =
        "[compaction]\nmax_messages = 1000\nbackground_ratio = 0.7\nmin_preserve_tokens = 100\n\
                max_preserve_tokens = 400\n[models.paced]\ncontext_window = 8000\n";
    let fake = FakeSummarizer::new(vec![Reply::Slow(
        Duration::from_secs(4),
        "Summary: the files read, the fix made, the tests run.".into(),
    )]);
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let pipeline = Pipeline::new(&config(toml), fake.clone(), metrics);
    let c = Arc::new(if pacing {
        pipeline
    } else {
        pipeline.without_pacing()
    });
    let caller = caller();
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the failing test in the parser."}),
    ];
    let mut waited = Vec::new();
    for turn in 0..120 {
        let context = RequestContext {
            caller: &caller,
            session_header: None,
            long_context: false,
            attempts: &Attempts::per_request(),
            mode: None,
        };
        let request = Bytes::from(body("paced", messages.clone()));
        let processed = c
            .handle(DialectKind::ChatCompletions, &request, &context)
            .await;
        if processed.summarizer_time > Duration::ZERO {
            waited.push(turn);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        messages.push(json!({"role": "assistant", "content": format!("step {turn}: {}", "reading the code ".repeat(25))}));
        messages.push(json!({"role": "user", "content": format!("output {turn}: {}", "line of tool output ".repeat(output_lines))}));
    }
    c.background_idle().await;
    (waited, fake.requests().len())
}

#[tokio::test(start_paused = true)]
async fn background_summaries_paced_by_growth_and_latency_are_ready_before_the_trigger() {
    // Tool outputs of 90 lines: about ten turns from a splice to the trigger, one more to the
    // wait threshold, eight to write a summary. From the plain watermark the summary is not
    // ready in time; paced, only the first summary (not yet timed) may be waited for.
    let (unpaced, _) = turns_that_waited(false, 90).await;
    let (paced, _) = turns_that_waited(true, 90).await;
    assert!(
        unpaced.len() >= 3,
        "from the plain watermark, the trigger comes first: {unpaced:?}"
    );
    assert!(paced.len() <= 1, "paced: {paced:?}");
    // Outputs of 45 lines: the room between the trigger and the wait threshold holds the
    // turns a summary started at the plain watermark still needs.
    let (unpaced, _) = turns_that_waited(false, 45).await;
    assert_eq!(unpaced, Vec::<usize>::new());
}

#[tokio::test(start_paused = true)]
async fn a_request_over_the_trigger_goes_on_while_its_summary_is_made_if_it_fits_below_the_wait_threshold(
) {
    // An 8,000-token window: the trigger at 6,800 estimated tokens, the wait threshold three
    // quarters of the way to the window (7,700), the background watermark at 70% of the trigger. Summaries take
    // four seconds (tokio's clock, paused); the agent's turns half a second.
    let toml =
        "[compaction]\nstrategy = \"summarize\"\nmax_messages = 1000\nbackground_ratio = 0.7\n\
                min_preserve_tokens = 100\nmax_preserve_tokens = 400\n\
                [models.paced]\ncontext_window = 8000\n";
    let fake = FakeSummarizer::new(vec![Reply::Slow(
        Duration::from_secs(4),
        "Summary: the files read, the fix made, the tests run.".into(),
    )]);
    let (c, metrics) = compactor(&config(toml), fake.clone());
    let limits = c.engine().limits(Some("paced"), None);
    assert_eq!(
        (limits.token_threshold, limits.wait_threshold),
        (6_800, 7_700)
    );
    let caller = caller();
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the failing test in the parser."}),
    ];
    let tokens = |messages: &[Value]| {
        let request = body("paced", messages.to_vec());
        DialectKind::ChatCompletions
            .scan(&request, c.engine().estimator())
            .expect("scan")
            .tokens
    };
    let mut turn = 0;
    // One turn at a time until the conversation reaches `at` estimated tokens; then the
    // request is sent, as the agent would after half a second.
    let mut grow_to = |at: usize, messages: &mut Vec<Value>| {
        while tokens(messages) < at {
            turn += 1;
            messages.push(json!({"role": "assistant", "content": format!("step {turn}")}));
            messages.push(json!({"role": "user", "content": format!("output {turn}: {}", "line of tool output ".repeat(10))}));
        }
        tokens(messages)
    };
    let send = |messages: Vec<Value>| {
        let c = c.clone();
        let caller = caller.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let context = RequestContext {
                caller: &caller,
                session_header: None,
                long_context: false,
                attempts: &Attempts::per_request(),
                mode: None,
            };
            let request = Bytes::from(body("paced", messages));
            c.handle(DialectKind::ChatCompletions, &request, &context)
                .await
        }
    };

    // Over the watermark, under the trigger: the summary starts in the background.
    let at = grow_to(4_800, &mut messages);
    assert!(at < limits.token_threshold, "{at}");
    let first = send(messages.clone()).await;
    assert_eq!(first.summarizer_time, Duration::ZERO);
    assert_eq!(
        metrics.background_running.get(),
        1,
        "a summary is being made"
    );

    // Over the trigger, under the wait threshold: forwarded as received, without waiting.
    let at = grow_to(limits.token_threshold, &mut messages);
    assert!(at < limits.wait_threshold, "{at}");
    let over = send(messages.clone()).await;
    assert_eq!(over.summarizer_time, Duration::ZERO, "it did not wait");
    assert!(
        matches!(over.outcome, Outcome::Unchanged),
        "forwarded as received"
    );
    assert_eq!(metrics.compactions_deferred(), 1);
    assert_eq!(metrics.background_running.get(), 1, "still being made");

    // At the wait threshold: it waits for that summary (no second one) and is compacted.
    let at = grow_to(limits.wait_threshold, &mut messages);
    assert!(at < limits.usable_window(), "{at}");
    let waited = send(messages.clone()).await;
    assert!(waited.summarizer_time > Duration::ZERO, "it waited");
    assert!(
        matches!(
            waited.outcome,
            Outcome::Reused { .. } | Outcome::Rewritten { .. }
        ),
        "compacted"
    );
    assert_eq!(metrics.compactions_deferred(), 1);
    assert_eq!(fake.requests().len(), 1, "one summary, made once");
}

/// Grows one conversation of `model` (a 100,000-token window: the token trigger at 85,000,
/// never reached) by about 750 estimated tokens a turn for 60 turns (to about 44,000), waiting for the
/// background summaries each request starts. Returns the turns whose request carried a
/// summary made because compacting paid (`trigger="cost"`), the first of them, and the
/// largest request forwarded.
async fn cost_compactions(toml: &str, model: &str) -> (Vec<usize>, Option<usize>, usize) {
    let fake = FakeSummarizer::text("Summary: the parser was read and its failing test fixed.");
    let (c, metrics) = compactor(&config(toml), fake.clone());
    let caller = caller();
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the failing test in the parser."}),
    ];
    let (mut spliced, mut largest) = (Vec::new(), 0);
    for turn in 0..60 {
        let context = RequestContext {
            caller: &caller,
            session_header: None,
            long_context: false,
            attempts: &Attempts::per_request(),
            mode: None,
        };
        let request = Bytes::from(body(model, messages.clone()));
        let processed = c
            .handle(DialectKind::ChatCompletions, &request, &context)
            .await;
        c.background_idle().await;
        assert_eq!(
            processed.summarizer_time,
            Duration::ZERO,
            "turn {turn} waited"
        );
        let estimate = processed.estimate.expect("a chat request is estimated");
        assert!(
            estimate.received < 85_000 * 9 / 10,
            "the token trigger is never near"
        );
        largest = largest.max(estimate.tokens);
        if matches!(processed.outcome, Outcome::Reused { .. }) {
            assert!(estimate.tokens < estimate.received, "turn {turn}");
            spliced.push(turn);
        }
        messages.push(json!({"role": "assistant", "content": format!("step {turn}: {}", "reading the code ".repeat(20))}));
        messages.push(json!({"role": "user", "content": format!("output {turn}: {}", "line of tool output ".repeat(180))}));
    }
    let made = compactions(&metrics, "cost", "compacted");
    assert_eq!(
        made as usize,
        fake.requests().len(),
        "every summary was a paying one"
    );
    let first = spliced.first().copied();
    (spliced, first, largest)
}

const PRICED: &str = "[compaction]\nstrategy = \"summarize\"\nmax_messages = 1000\n\
                      background_ratio = 0.0\n[models.priced]\ncontext_window = 100000\n\
                      price = { input = 1.0, output = 8.0, cache_read = 0.1 }\n\
                      [models.cache-less]\ncontext_window = 100000\n\
                      price = { input = 1.0, output = 8.0 }\n\
                      [models.unpriced]\ncontext_window = 100000\n";

#[tokio::test]
async fn a_conversation_far_below_its_window_is_compacted_once_its_cached_history_costs_more_than_a_summary(
) {
    let (spliced, first, largest) = cost_compactions(PRICED, "priced").await;
    let first = first.expect("compacting paid within 60 turns");
    // Not at once: the reads of the first turns cost less than a summary.
    assert!(first >= 8, "first compaction at turn {first}");
    // Every later request carries the summary, and none comes near the 44,000 tokens the
    // conversation reaches.
    assert_eq!(spliced.len(), 60 - first, "{spliced:?}");
    assert!(largest < 30_000, "largest request forwarded: {largest}");

    // Reads as dear as new input (no cache discount): it pays sooner.
    let (_, dearer, _) = cost_compactions(PRICED, "cache-less").await;
    assert!(dearer.expect("paid") < first, "{dearer:?} vs {first}");

    // No price, or the trigger off: nothing is compacted below the window's trigger.
    let (spliced, _, largest) = cost_compactions(PRICED, "unpriced").await;
    assert!(
        spliced.is_empty() && largest > 40_000,
        "{spliced:?}, {largest}"
    );
    let off = PRICED.replace("background_ratio", "cost_trigger = false\nbackground_ratio");
    let (spliced, _, _) = cost_compactions(&off, "priced").await;
    assert!(spliced.is_empty(), "{spliced:?}");
}

#[tokio::test]
async fn what_the_summaries_cost_is_added_to_the_conversations_cost() {
    // `tiny` priced at $1 input and $10 output per million tokens; each summary billed 10,000
    // input and 1,000 output tokens: $0.02.
    let usage = compactor_plugin_api::SummaryUsage {
        model: "tiny".into(),
        input: 10_000,
        output: 1_000,
        cache_read: 0,
        cache_write: 0,
    };
    let toml = SMALL.replace(
        "context_window = 1000\n",
        "context_window = 1000\nprice = { input = 1.0, output = 10.0 }\n",
    );
    let fake = FakeSummarizer::new(vec![Reply::Billed("S.".into(), usage.clone())]);
    let (c, _) = compactor(&config(&toml), fake.clone());
    let caller = caller();
    let session = session_of_request(&c, &caller, chat(12)).await;
    assert_eq!(fake.requests().len(), 1);
    let cost = |session: String| {
        let c = c.clone();
        async move {
            let info = c.store().session(&session).await.expect("store");
            info.expect("session").cost
        }
    };
    let spent = cost(session.clone()).await.expect("a summary was billed");
    assert!((spent.summarizer_usd - 0.02).abs() < 1e-12, "{spent:?}");
    assert_eq!(
        spent.usd, 0.0,
        "the summary is not a request of the conversation"
    );

    // A model without a price, or a backend that reports nothing: no cost at all.
    let unpriced = FakeSummarizer::new(vec![Reply::Billed(
        "S.".into(),
        compactor_plugin_api::SummaryUsage {
            model: "a-model-nobody-prices".into(),
            ..usage
        },
    )]);
    let (c, _) = compactor(&config(SMALL), unpriced.clone());
    let session = session_of_request(&c, &caller, chat(12)).await;
    assert_eq!(unpriced.requests().len(), 1);
    let info = c.store().session(&session).await.expect("store");
    assert_eq!(info.expect("session").cost, None);
}

/// The messages of a summary request asked inside the conversation, and its last (the turn).
fn asked_inside(r: &compactor_plugin_api::SummaryRequest) -> (Vec<Value>, Value) {
    let body = r
        .in_conversation
        .as_ref()
        .expect("asked inside the conversation");
    let mut messages = messages_of(body);
    let turn = messages.pop().expect("the turn");
    (messages, turn)
}

#[tokio::test]
async fn the_summary_is_asked_inside_the_conversation_as_the_provider_received_it() {
    let fake = FakeSummarizer::text("S.");
    let (c, _) = compactor(&config(SMALL), fake.clone());
    // Over the message trigger on its first request: compacted on the request path, the
    // conversation asked as received, then the turn asking for the summary.
    let first = chat(12);
    let out = send(&c, &first).await;
    let rewritten = forwarded("first", &out);
    let requests = fake.requests();
    assert_eq!(requests.len(), 1);
    let (conversation, turn) = asked_inside(&requests[0]);
    assert_eq!(conversation, first);
    assert_eq!(turn["role"], "user");
    let turn = turn["content"].as_str().expect("text");
    assert!(turn.contains("Summarize the conversation above"), "{turn}");
    let asked: Value =
        serde_json::from_slice(requests[0].in_conversation.as_deref().expect("body"))
            .expect("json");
    assert_eq!(asked["max_tokens"], requests[0].max_output_tokens);
    assert_eq!(asked["stream"], false);

    // The conversation goes on with the summary spliced in; the next summary (made ahead or
    // on the request path) is asked inside the request as forwarded: the first summary, then
    // the messages after what it covers.
    let summary = rewritten
        .iter()
        .position(|m| m["content"].as_str().is_some_and(|t| t.contains("S.")))
        .expect("the summary message");
    let covered = first
        .iter()
        .position(|m| *m == rewritten[summary + 1])
        .expect("the tail is the request's own");
    let mut sent = first;
    while fake.requests().len() < 2 {
        assert!(sent.len() < 40, "a second summary is made");
        sent.push(json!({"role": "user", "content": format!("more {}", sent.len())}));
        sent.push(json!({"role": "assistant", "content": format!("ok {}", sent.len())}));
        session_of_request(&c, &caller(), sent.clone()).await;
    }
    let (conversation, _) = asked_inside(&fake.requests()[1]);
    assert_eq!(
        conversation[..=summary],
        rewritten[..=summary],
        "the head, then the first summary"
    );
    assert_eq!(conversation[summary + 1..], sent[covered..]);

    // Where the provider's cache saves little, the standalone prompt (whose tool outputs are
    // cut short) costs less: a cache read dearer than new input is the extreme case.
    for (cache_read, inside) in [(0.1, true), (5.0, false)] {
        let toml =
            format!("{SMALL}price = {{ input = 1.0, output = 1.0, cache_read = {cache_read} }}\n");
        let fake = FakeSummarizer::text("S.");
        let (c, _) = compactor(&config(&toml), fake.clone());
        assert!(matches!(
            send(&c, &chat(12)).await,
            Outcome::Rewritten { .. }
        ));
        let asked: Vec<bool> = fake
            .requests()
            .iter()
            .map(|r| r.in_conversation.is_some())
            .collect();
        assert_eq!(asked, [inside], "cache read at {cache_read}");
    }

    // A conversation that would not fit its window beside the summary is asked with the
    // standalone prompt alone.
    let fake = FakeSummarizer::text("S.");
    let (c, _) = compactor(&config(SMALL), fake.clone());
    let mut long = chat(12);
    for m in long.iter_mut().skip(1) {
        m["content"] = json!(format!(
            "{} {}",
            m["content"].as_str().unwrap_or(""),
            "y".repeat(200)
        ));
    }
    assert!(matches!(send(&c, &long).await, Outcome::Rewritten { .. }));
    let requests = fake.requests();
    assert!(!requests.is_empty());
    assert!(requests.iter().all(|r| r.in_conversation.is_none()));
}
