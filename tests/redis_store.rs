//! The Redis session store with a real `redis-server` (started here on a free port; Debian's
//! package, which `.ci/run` installs): replicas that share sessions make one summary per
//! compaction however requests are spread over them, a restarted replica reuses what was
//! stored, Redis killed mid-run loses no request and sharing resumes when it is back, tenants
//! stay apart, no credential reaches Redis, and a claim left by a dead replica expires.

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use compactor::metrics::Metrics;
use compactor::session::{
    Claim, MaskNeed, MemoryStore, RedisSettings, RedisStore, SessionStore, StoreLimits, TenantId,
};
use serde_json::{json, Value};
use support::summary_calls::{completion, summary_prompt, Summaries};
use support::{
    eventually, upstream_toml, within, Exchange, MockUpstream, Recorded, RedisServer, Reply,
    TestClient, TestProxy,
};

const CHAT: &str = "/v1/chat/completions";
const AUTH: &str = "Bearer sk-redis-tenant-a";
const OTHER_AUTH: &str = "Bearer sk-redis-tenant-b";

/// The provider behind every replica: summarizer calls are answered `SUMMARY-<n>`, optionally
/// held until released; everything else is the agent's request.
#[derive(Default)]
struct Provider {
    summarizer: Summaries,
}

impl Provider {
    fn install(mock: &MockUpstream) -> Arc<Provider> {
        let provider = Arc::new(Provider::default());
        let p = provider.clone();
        mock.set_handler(move |r: &Recorded| p.answer(r));
        provider
    }

    fn answer(&self, r: &Recorded) -> Reply {
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        if summary_prompt(&v).is_none() {
            return Reply::json(200, &completion("Next step."));
        }
        self.summarizer.answer(completion)
    }

    fn summaries(&self) -> usize {
        self.summarizer.count()
    }
}

/// Compacts beyond 10 messages, on the request path (no background summaries, so every
/// summary is attributable to a request).
fn toml(mock: &MockUpstream, redis: Option<&RedisServer>) -> String {
    let store = match redis {
        Some(r) => format!(
            "[store]\nbackend = \"redis\"\nredis_url = \"{}\"\nredis_timeout_secs = 0.5\n",
            r.url()
        ),
        None => String::new(),
    };
    format!(
        "{}[compaction]\nmax_messages = 10\nbackground_ratio = 0\nmin_preserve_tokens = 20\n\
         max_preserve_tokens = 200\n{store}",
        upstream_toml(&mock.url())
    )
}

/// A conversation of `turns` user/assistant exchanges, `tag` making it unique.
fn conversation(tag: &str, turns: usize) -> Vec<Value> {
    let mut messages = vec![json!({"role": "system", "content": "You are a coding agent."})];
    for k in 0..turns {
        messages.push(json!({
            "role": "user",
            "content": format!("{tag} step {k}: change the invoice model and run the tests again, \
                                then report what failed and why, file by file.")
        }));
        messages.push(json!({
            "role": "assistant",
            "content": format!("{tag} step {k} done: the invoice model now rounds half-even; \
                                tests pass except test_totals, which expects truncation.")
        }));
    }
    messages
}

/// The request before assistant message `i`.
fn request_before(messages: &[Value], i: usize) -> Bytes {
    Bytes::from(
        serde_json::to_vec(&json!({"model": "gpt-4o", "messages": &messages[..i]}))
            .expect("serialise"),
    )
}

/// The same request as [`chat`] (tenant `AUTH`), in a task of its own, status unchecked.
fn spawn_chat(proxy: &TestProxy, body: Bytes) -> tokio::task::JoinHandle<Exchange> {
    let url = proxy.url(CHAT);
    tokio::spawn(async move {
        TestClient::http1()
            .exchange(
                "POST",
                &url,
                &[
                    ("content-type", "application/json"),
                    ("authorization", AUTH),
                ],
                body,
            )
            .await
    })
}

async fn chat(client: &TestClient, proxy: &TestProxy, auth: &str, body: Bytes) -> Exchange {
    let ex = client
        .exchange(
            "POST",
            &proxy.url(CHAT),
            &[
                ("content-type", "application/json"),
                ("authorization", auth),
            ],
            body,
        )
        .await;
    assert_eq!(
        ex.status,
        200,
        "chat request failed: {}",
        String::from_utf8_lossy(&ex.body)
    );
    ex
}

/// The summaries (`SUMMARY-<n>`) a forwarded body carries.
fn summaries_in(body: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(body);
    text.match_indices("SUMMARY-")
        .map(|(at, _)| {
            text[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect()
        })
        .collect()
}

/// The agent requests the mock received after its first `seen` requests.
fn forwarded_since(mock: &MockUpstream, seen: usize) -> Vec<Recorded> {
    mock.requests()[seen..]
        .iter()
        .filter(|r| {
            let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
            summary_prompt(&v).is_none()
        })
        .cloned()
        .collect()
}

/// Plays every request of `messages` (one per assistant turn), sending request `k` to
/// `replicas[k % replicas.len()]`; returns the summaries each forwarded request carried.
async fn play(
    mock: &MockUpstream,
    replicas: &[&TestProxy],
    auth: &str,
    messages: &[Value],
) -> Vec<Vec<String>> {
    play_from(mock, replicas, auth, messages, 1).await
}

/// [`play`] from the request before assistant message `start` on.
async fn play_from(
    mock: &MockUpstream,
    replicas: &[&TestProxy],
    auth: &str,
    messages: &[Value],
    start: usize,
) -> Vec<Vec<String>> {
    let client = TestClient::http1();
    let mut carried = Vec::new();
    let turns = (start..messages.len()).filter(|i| messages[*i]["role"] == "assistant");
    for (k, i) in turns.enumerate() {
        let seen = mock.requests().len();
        chat(
            &client,
            replicas[k % replicas.len()],
            auth,
            request_before(messages, i),
        )
        .await;
        let forwarded = forwarded_since(mock, seen);
        assert_eq!(forwarded.len(), 1, "request {k}: forwarded once");
        carried.push(summaries_in(&forwarded[0].body));
    }
    carried
}

async fn readyz_store(proxy: &TestProxy) -> String {
    let (status, text) = TestClient::http1()
        .get_text(&proxy.admin_url("/readyz"))
        .await;
    assert_eq!(
        status, 200,
        "/readyz stays ready whatever the store: {text}"
    );
    let v: Value = serde_json::from_str(&text).expect("readyz JSON");
    v["store"].as_str().expect("store state").to_owned()
}

async fn store_errors(proxy: &TestProxy) -> f64 {
    let text = proxy.metrics().await;
    ["lookup", "put", "touch", "breaker", "claim"]
        .iter()
        .map(|op| {
            support::metric_value(&text, "compactor_store_errors_total", &[("op", op)])
                .unwrap_or(0.0)
        })
        .sum()
}

#[tokio::test]
async fn two_replicas_alternating_make_the_summaries_of_one() {
    let redis = RedisServer::start().await;
    let messages = conversation("alternating", 30);

    // The reference: one replica with its memory store.
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let single = TestProxy::start(&toml(&mock, None)).await;
    let alone = play(&mock, &[&single], AUTH, &messages).await;
    let reference = provider.summaries();
    assert!(reference >= 3, "the conversation compacts several times");
    single.shutdown().await;

    // Two replicas sharing Redis, taking turns.
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let a = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let b = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let shared = play(&mock, &[&a, &b], AUTH, &messages).await;
    assert_eq!(
        provider.summaries(),
        reference,
        "two replicas make exactly the summaries one replica makes"
    );
    assert_eq!(
        shared, alone,
        "every request carries the summary one replica would have forwarded"
    );
    assert_eq!(store_errors(&a).await + store_errors(&b).await, 0.0);
    assert_eq!(readyz_store(&a).await, "connected");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn concurrent_requests_on_two_replicas_make_one_summary() {
    let redis = RedisServer::start().await;
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    provider.summarizer.hold();
    let a = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let b = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let messages = conversation("concurrent", 8);
    let body = request_before(&messages, messages.len() - 1);

    let first = spawn_chat(&a, body.clone());
    eventually("replica A to ask for the summary", || async {
        (provider.summarizer.held() == 1).then_some(())
    })
    .await;
    // Replica B gets the same request while A's summary is being made: it must wait for A's
    // claim (it polls the lock) instead of asking for a second summary.
    let mut stats = redis.connection().await;
    let polls = || async {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut redis.connection().await)
            .await
            .expect("INFO");
        info.lines()
            .find(|l| l.starts_with("cmdstat_exists:"))
            .and_then(|l| l.split("calls=").nth(1))
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut stats)
        .await
        .expect("CONFIG RESETSTAT");
    let second = spawn_chat(&b, body.clone());
    eventually("replica B to wait on A's claim", || async {
        (polls().await > 0).then_some(())
    })
    .await;
    assert_eq!(
        provider.summarizer.held(),
        1,
        "B asked for no summary of its own"
    );
    provider.summarizer.release().await;
    let first = within("replica A's answer", first).await.expect("task");
    let second = within("replica B's answer", second).await.expect("task");
    assert_eq!((first.status, second.status), (200, 200));
    assert_eq!(provider.summaries(), 1, "one summary for both replicas");
    let forwarded = forwarded_since(&mock, 0);
    assert_eq!(forwarded.len(), 2);
    for r in &forwarded {
        assert_eq!(
            summaries_in(&r.body),
            ["SUMMARY-1"],
            "both carry A's summary"
        );
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn a_restarted_replica_reuses_the_stored_summaries() {
    let redis = RedisServer::start().await;
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let messages = conversation("restart", 12);
    let before = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let played = play(&mock, &[&before], AUTH, &messages[..20]).await;
    assert!(
        played.last().is_some_and(|s| !s.is_empty()),
        "compacted before the restart"
    );
    let summaries = provider.summaries();
    before.shutdown().await;

    let after = TestProxy::start(&toml(&mock, Some(&redis))).await;
    // The last request again (a retry): a replica with an empty memory would compact it anew.
    let seen = mock.requests().len();
    chat(
        &TestClient::http1(),
        &after,
        AUTH,
        request_before(&messages, 18),
    )
    .await;
    assert_eq!(
        provider.summaries(),
        summaries,
        "the restarted replica asked for no summary"
    );
    let forwarded = forwarded_since(&mock, seen);
    assert_eq!(
        summaries_in(&forwarded[0].body),
        played.last().cloned().unwrap_or_default(),
        "it forwards the summary stored before the restart"
    );
    after.shutdown().await;
}

#[tokio::test]
async fn redis_killed_mid_run_loses_no_request_and_sharing_resumes() {
    let mut redis = RedisServer::start().await;
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let a = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let b = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let messages = conversation("outage", 24);
    play(&mock, &[&a, &b], AUTH, &messages[..16]).await;
    assert_eq!(readyz_store(&a).await, "connected");

    redis.kill();
    // Every request still goes through (`play` asserts 200 and one forwarded request each),
    // compacting in each replica's memory when due.
    let during = play_from(&mock, &[&a, &b], AUTH, &messages, 16).await;
    assert!(
        during.iter().all(|s| !s.is_empty()),
        "requests over the trigger are still compacted during the outage: {during:?}"
    );
    assert!(store_errors(&a).await > 0.0, "the outage is counted");
    assert_eq!(readyz_store(&a).await, "degraded");

    redis.restart().await;
    // The link is probed by calls: requests bring it back.
    let fresh = conversation("after-outage", 12);
    let client = TestClient::http1();
    eventually("replica A to reach Redis again", || {
        let (client, a, body) = (&client, &a, request_before(&fresh, 2));
        async move {
            chat(client, a, AUTH, body).await;
            (readyz_store(a).await == "connected").then_some(())
        }
    })
    .await;
    eventually("replica B to reach Redis again", || {
        let (client, b, body) = (&client, &b, request_before(&fresh, 2));
        async move {
            chat(client, b, AUTH, body).await;
            (readyz_store(b).await == "connected").then_some(())
        }
    })
    .await;
    // Sharing resumed: A compacts the fresh conversation, B reuses A's summary for its next
    // request.
    let on_a = play(&mock, &[&a], AUTH, &fresh[..22]).await;
    let summaries = provider.summaries();
    let stored = on_a.last().cloned().unwrap_or_default();
    assert!(!stored.is_empty(), "A compacted after the outage");
    let seen = mock.requests().len();
    chat(&client, &b, AUTH, request_before(&fresh, 22)).await;
    assert_eq!(
        provider.summaries(),
        summaries,
        "B made no summary of its own"
    );
    assert_eq!(summaries_in(&forwarded_since(&mock, seen)[0].body), stored);
    a.shutdown().await;
    b.shutdown().await;
}

/// A tenant's key holding what compactor did not write (another version's format, an
/// operator's mistake) fails that tenant's calls alone: Redis stays connected for every other
/// call, and the request is served from the replica's memory.
#[tokio::test]
async fn a_corrupted_key_fails_its_own_calls_and_leaves_redis_up() {
    let redis = RedisServer::start().await;
    let mock = MockUpstream::start().await;
    let _provider = Provider::install(&mock);
    let a = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let messages = conversation("corrupt", 8);
    play(&mock, &[&a], AUTH, &messages).await;
    let lens: Vec<String> = redis
        .dump()
        .await
        .into_iter()
        .map(|(key, _)| key)
        .filter(|key| key.ends_with(":lens"))
        .collect();
    assert!(
        !lens.is_empty(),
        "the tenant's checkpoint lengths are stored"
    );
    let mut admin = redis.connection().await;
    for key in &lens {
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg("not a sorted set")
            .query_async(&mut admin)
            .await
            .expect("SET");
    }
    let before = store_errors(&a).await;
    let ex = chat(
        &TestClient::http1(),
        &a,
        AUTH,
        request_before(&messages, messages.len() - 1),
    )
    .await;
    assert_eq!(ex.status, 200);
    assert!(
        store_errors(&a).await > before,
        "the refused lookup is counted"
    );
    assert_eq!(
        readyz_store(&a).await,
        "connected",
        "one tenant's bad key does not take Redis away"
    );
    a.shutdown().await;
}

/// A session's latest request read back from Redis names where it went; a manual compaction
/// on another replica sends the summarizer (its key, the conversation) there only when this
/// replica routes requests to that upstream itself. Whoever can write Redis cannot redirect it.
#[tokio::test]
async fn a_manual_compaction_never_follows_an_upstream_read_from_redis_it_does_not_route_to() {
    let redis = RedisServer::start().await;
    let mock = MockUpstream::start().await;
    let _provider = Provider::install(&mock);
    let elsewhere = MockUpstream::start().await;
    let a = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let b = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let messages = conversation("redirect", 5);
    let ex = chat(
        &TestClient::http1(),
        &a,
        AUTH,
        request_before(&messages, messages.len() - 1),
    )
    .await;
    let id = ex
        .header("x-compactor-session")
        .expect("session id")
        .to_owned();
    let summarize = |proxy: &TestProxy| proxy.admin_url(&format!("/session/{id}/summarize"));
    let latest = support::eventually("the latest request shared", || async {
        redis
            .dump()
            .await
            .into_iter()
            .map(|(key, _)| key)
            .find(|key| key.ends_with(":req"))
    })
    .await;

    // As written by replica A: replica B may compact it, through the upstream both route to.
    let got = TestClient::http1()
        .exchange("POST", &summarize(&b), &[], Bytes::new())
        .await;
    let answer: Value = serde_json::from_slice(&got.body).expect("JSON");
    assert_eq!(answer["compacted"], true, "{answer}");

    // Pointed elsewhere in Redis: refused, and nothing reaches the other host.
    let mut admin = redis.connection().await;
    let _: () = redis::cmd("HSET")
        .arg(&latest)
        .arg("upstream")
        .arg(elsewhere.url())
        .query_async(&mut admin)
        .await
        .expect("HSET");
    let got = TestClient::http1()
        .exchange("POST", &summarize(&b), &[], Bytes::new())
        .await;
    let answer: Value = serde_json::from_slice(&got.body).expect("JSON");
    assert_eq!(answer["compacted"], false, "{answer}");
    assert_eq!(answer["reason"], "unknown_upstream");
    assert_eq!(
        elsewhere.request_count(),
        0,
        "the summarizer never went there"
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn tenants_stay_apart_across_replicas_and_no_credential_reaches_redis() {
    let redis = RedisServer::start().await;
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let a = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let b = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let messages = conversation("tenants", 8);

    let on_a = play(&mock, &[&a], AUTH, &messages).await;
    let mine = on_a.last().cloned().unwrap_or_default();
    assert!(!mine.is_empty(), "tenant A's conversation was compacted");
    let after_a = provider.summaries();

    // The same conversation from another credential, on the other replica: it must not see
    // tenant A's summary; it makes its own.
    let seen = mock.requests().len();
    chat(
        &TestClient::http1(),
        &b,
        OTHER_AUTH,
        request_before(&messages, messages.len() - 1),
    )
    .await;
    assert_eq!(
        provider.summaries(),
        after_a + 1,
        "tenant B compacts for itself"
    );
    let theirs = summaries_in(&forwarded_since(&mock, seen)[0].body);
    assert!(
        !theirs.is_empty() && theirs != mine,
        "tenant B never gets tenant A's summary: {theirs:?} vs {mine:?}"
    );

    let dump = redis.dump().await;
    assert!(
        !dump.is_empty(),
        "the replicas stored their sessions in Redis"
    );
    for (key, value) in &dump {
        let value = String::from_utf8_lossy(value);
        for secret in ["sk-redis-tenant-a", "sk-redis-tenant-b"] {
            assert!(
                !key.contains(secret) && !value.contains(secret),
                "a credential reached Redis under {key}"
            );
        }
    }
    a.shutdown().await;
    b.shutdown().await;
}

fn settings(claim_ttl: Duration) -> RedisSettings {
    RedisSettings {
        key_prefix: "compactor-test".into(),
        ttl: Duration::from_secs(600),
        timeout: Duration::from_millis(500),
        max_shared_request_bytes: 1 << 20,
        breaker_cooldown: Duration::from_secs(300),
        claim_ttl,
    }
}

fn redis_store(redis: &RedisServer, claim_ttl: Duration) -> RedisStore {
    store_at(&redis.url(), claim_ttl)
}

/// A Redis store at `url` with a small memory store of its own and its own metrics.
fn store_at(url: &str, claim_ttl: Duration) -> RedisStore {
    let local = MemoryStore::new(StoreLimits {
        max_sessions: 100,
        max_bytes: 1 << 24,
        max_sessions_per_tenant: 100,
        ttl: Duration::from_secs(600),
    });
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    RedisStore::new(url, settings(claim_ttl), local, metrics).expect("store")
}

#[tokio::test]
async fn a_claim_left_by_a_dead_replica_expires() {
    let redis = RedisServer::start().await;
    let tenant = TenantId::from_credential("sk-claims");
    let ttl = Duration::from_millis(400);

    // A replica that takes the claim and dies: its runtime (and the renewal task) goes away
    // without releasing it.
    let url = redis.url();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let dead = store_at(&url, ttl);
            match dead
                .claim_compaction(tenant, "s", 0, Duration::ZERO)
                .await
                .expect("claim")
            {
                Claim::Won(lease) => std::mem::forget(lease),
                Claim::Waited => panic!("the first claim wins"),
            }
        });
    })
    .join()
    .expect("dead replica thread");

    let alive = redis_store(&redis, ttl);
    let claim = alive
        .claim_compaction(tenant, "s", 0, Duration::ZERO)
        .await
        .expect("claim");
    assert!(matches!(claim, Claim::Waited), "still held: {claim:?}");
    // Waiting (bounded well above the claim's ttl) ends when the claim expires...
    let waited = within(
        "the dead claim to expire",
        alive.claim_compaction(tenant, "s", 0, Duration::from_secs(10)),
    )
    .await
    .expect("claim");
    assert!(matches!(waited, Claim::Waited), "{waited:?}");
    // ...after which it can be taken, and a held lease keeps it (renewed past its ttl).
    let lease = match alive
        .claim_compaction(tenant, "s", 0, Duration::ZERO)
        .await
        .expect("claim")
    {
        Claim::Won(lease) => lease,
        Claim::Waited => panic!("the expired claim can be taken"),
    };
    let other = redis_store(&redis, ttl);
    let held = other
        .claim_compaction(tenant, "s", 0, ttl * 3)
        .await
        .expect("claim");
    assert!(matches!(held, Claim::Waited));
    let still = other
        .claim_compaction(tenant, "s", 0, Duration::ZERO)
        .await
        .expect("claim");
    assert!(
        matches!(still, Claim::Waited),
        "a live lease is renewed past its ttl"
    );
    drop(lease);
    eventually("the dropped lease to be released", || async {
        match other.claim_compaction(tenant, "s", 0, Duration::ZERO).await {
            Ok(Claim::Won(lease)) => Some(lease),
            _ => None,
        }
    })
    .await;
}

#[tokio::test]
async fn a_sessions_spend_adds_up_across_replicas() {
    use compactor::session::SessionCost;
    let redis = RedisServer::start().await;
    let tenant = TenantId::from_credential("sk-spend");
    let one = redis_store(&redis, Duration::from_secs(10));
    let two = redis_store(&redis, Duration::from_secs(10));
    // A session the store does not hold gets no entry from its spend.
    one.record_cost(tenant, "unknown", SessionCost::default())
        .await
        .expect("record");
    assert!(two.session("unknown").await.expect("session").is_none());

    let latest = compactor::session::LatestRequest {
        tenant,
        dialect: compactor::dialect::DialectKind::ChatCompletions,
        body: Bytes::from_static(b"{\"messages\":[]}"),
        caller: Default::default(),
    };
    one.touch_session(tenant, "s", latest, 1)
        .await
        .expect("touch");
    eventually("the session to be shared", || async {
        two.session("s").await.ok().flatten()
    })
    .await;
    let info = two.session("s").await.expect("session").expect("known");
    assert_eq!(info.cost, None, "nothing billed yet");
    one.record_cost(
        tenant,
        "s",
        SessionCost {
            usd: 0.25,
            without_compactor_usd: 0.5,
            over_window_without_compactor: 0,
            input_tokens: 1_000,
            cache_read_tokens: 600,
            summarizer_usd: 0.0,
        },
    )
    .await
    .expect("record");
    two.record_cost(
        tenant,
        "s",
        SessionCost {
            usd: 0.125,
            without_compactor_usd: 0.0,
            over_window_without_compactor: 1,
            input_tokens: 500,
            cache_read_tokens: 0,
            summarizer_usd: 0.0625,
        },
    )
    .await
    .expect("record");
    let cost = one
        .session("s")
        .await
        .expect("session")
        .expect("known")
        .cost
        .expect("billed");
    assert!((cost.usd - 0.375).abs() < 1e-12, "{cost:?}");
    assert!((cost.without_compactor_usd - 0.5).abs() < 1e-12, "{cost:?}");
    assert_eq!(cost.over_window_without_compactor, 1);
    assert_eq!((cost.input_tokens, cost.cache_read_tokens), (1_500, 600));
    assert!((cost.summarizer_usd - 0.0625).abs() < 1e-12, "{cost:?}");
}

#[tokio::test]
async fn the_session_breaker_is_shared() {
    let redis = RedisServer::start().await;
    let tenant = TenantId::from_credential("sk-breaker");
    let one = redis_store(&redis, Duration::from_secs(10));
    let two = redis_store(&redis, Duration::from_secs(10));
    let latest = compactor::session::LatestRequest {
        tenant,
        dialect: compactor::dialect::DialectKind::ChatCompletions,
        body: Bytes::from_static(b"{\"messages\":[]}"),
        caller: Default::default(),
    };
    one.touch_session(tenant, "s", latest, 1)
        .await
        .expect("touch");
    eventually("the session to be shared", || async {
        two.session("s").await.ok().flatten()
    })
    .await;
    let opened = [
        one.record_compaction(tenant, "s", false)
            .await
            .expect("record"),
        two.record_compaction(tenant, "s", false)
            .await
            .expect("record"),
        one.record_compaction(tenant, "s", false)
            .await
            .expect("record"),
    ];
    assert_eq!(
        opened,
        [false, false, true],
        "three failures across replicas open it"
    );
    assert!(!two.compaction_allowed(tenant, "s").await.expect("allowed"));
    let info = two.session("s").await.expect("session").expect("known");
    assert_eq!(info.consecutive_failures, 3);
    assert_eq!(
        serde_json::to_value(info.breaker).expect("json"),
        json!("open")
    );
    // Another tenant's session of the same id has its own breaker.
    let other = TenantId::from_credential("sk-breaker-other");
    assert!(two.compaction_allowed(other, "s").await.expect("allowed"));
}

#[tokio::test]
async fn a_full_or_stalled_redis_is_served_around() {
    let redis = RedisServer::start().await;
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let a = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let mut admin = redis.connection().await;

    // Full: Redis refuses every write (maxmemory reached, no eviction).
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query_async(&mut admin)
        .await
        .expect("CONFIG SET");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("1")
        .query_async(&mut admin)
        .await
        .expect("CONFIG SET");
    let messages = conversation("full", 8);
    let played = play(&mock, &[&a], AUTH, &messages).await;
    assert!(
        played.last().is_some_and(|s| !s.is_empty()),
        "compacted in memory while Redis refuses writes"
    );
    let text = a.metrics().await;
    let put_errors = support::metric_value(&text, "compactor_store_errors_total", &[("op", "put")]);
    assert!(
        put_errors.is_some_and(|n| n >= 1.0),
        "refused writes counted: {put_errors:?}"
    );
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("0")
        .query_async(&mut admin)
        .await
        .expect("CONFIG SET");

    // Stalled: Redis holds every other client's commands for 30 s; a request waits at most
    // the store timeout (0.5 s) per call instead.
    let summaries = provider.summaries();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(30_000)
        .arg("ALL")
        .query_async(&mut admin)
        .await
        .expect("CLIENT PAUSE");
    let before = store_errors(&a).await;
    let ex = within(
        "a request while Redis stalls",
        chat(
            &TestClient::http1(),
            &a,
            AUTH,
            request_before(&messages, messages.len() - 1),
        ),
    )
    .await;
    assert_eq!(ex.status, 200);
    assert_eq!(
        provider.summaries(),
        summaries,
        "the replica's own memory still had the checkpoint"
    );
    assert!(
        store_errors(&a).await > before,
        "the stalled calls are counted"
    );
    // Shutting down waits for no Redis call (the server is killed still paused).
    a.shutdown().await;
}

#[tokio::test]
async fn learned_windows_reach_every_replica() {
    use compactor::compaction::models::{LearnedWindow, WindowKey, WindowSource};
    let redis = RedisServer::start().await;
    let one = redis_store(&redis, Duration::from_secs(10));
    let two = redis_store(&redis, Duration::from_secs(10));
    let window = LearnedWindow {
        context_window: 1_000,
        source: WindowSource::Error,
        learned_unix: 1,
    };
    let local = "http://127.0.0.1:8000";
    let key = WindowKey::new(local, "gpt-unknown").expect("a key");
    assert!(one.learn_window(&key, window).await.expect("learn"));
    // Replica two reads its own copy, refreshed from Redis in the background at most once a
    // second: the admin listing refreshes at once.
    let listed = two.learned_windows().await.expect("windows");
    assert_eq!(listed, vec![(key, window)]);
    assert_eq!(
        two.learned_window(local, "GPT-Unknown")
            .await
            .expect("window"),
        Some(window),
        "looked up by upstream and model key"
    );
    assert_eq!(
        two.learned_window("https://api.openai.com", "gpt-unknown")
            .await
            .expect("window"),
        None,
        "another upstream's deployment of the model learned nothing"
    );
}

#[tokio::test]
async fn the_hybrid_mask_floor_is_shared_and_only_rises() {
    let redis = RedisServer::start().await;
    let tenant = TenantId::from_credential("sk-floor");
    let one = redis_store(&redis, Duration::from_secs(10));
    let two = redis_store(&redis, Duration::from_secs(10));
    async fn raise(
        store: &RedisStore,
        tenant: TenantId,
        covered: usize,
        need: (usize, usize),
    ) -> usize {
        let (enough, step) = need;
        store
            .raise_mask_floor(tenant, "s", covered, MaskNeed { enough, step })
            .await
            .expect("raise")
    }
    // Over the trigger, masking moves a whole step.
    assert_eq!(raise(&one, tenant, 0, (2, 8)).await, 8);
    // Another replica whose request needs less masks what the first one did.
    assert_eq!(raise(&two, tenant, 0, (0, 0)).await, 8);
    assert_eq!(raise(&two, tenant, 0, (8, 10)).await, 8);
    // Past the floor, the next step.
    assert_eq!(raise(&two, tenant, 0, (9, 12)).await, 12);
    assert_eq!(raise(&one, tenant, 0, (3, 6)).await, 12);
    // A newer summary starts over; a request behind it leaves the new floor alone.
    assert_eq!(raise(&one, tenant, 30, (0, 0)).await, 0);
    assert_eq!(raise(&two, tenant, 0, (4, 6)).await, 4);
    assert_eq!(raise(&two, tenant, 30, (0, 0)).await, 0);
    // A step that cannot reach what the request needs is not taken (it is summarised).
    assert_eq!(raise(&one, tenant, 30, (5, 0)).await, 0);
    assert_eq!(raise(&two, tenant, 30, (5, 6)).await, 6);
    // Another tenant's session of the same id has its own floor.
    let other = TenantId::from_credential("sk-floor-other");
    assert_eq!(raise(&two, other, 0, (1, 2)).await, 2);
}

/// A SWE-agent function-calling session played three times over in one conversation (call
/// ids made unique per round), so it outgrows a 16k window twice.
fn swe_agent_thrice() -> Vec<Value> {
    let recorded = support::transcript("swe-agent-marshmallow-function-calling.json");
    let mut messages = recorded[..2].to_vec();
    for round in 0..3 {
        for m in &recorded[2..] {
            let mut m = m.clone();
            if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
                for call in calls {
                    let id = call["id"].as_str().unwrap_or_default().to_string();
                    call["id"] = json!(format!("{id}-{round}"));
                }
            }
            if let Some(id) = m.get("tool_call_id").and_then(Value::as_str) {
                let id = format!("{id}-{round}");
                m["tool_call_id"] = json!(id);
            }
            messages.push(m);
        }
    }
    messages
}

/// Sums a counter's samples whose labels include `labels`.
fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter_map(support::metrics::parse_sample_line)
        .filter(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| v)
        .sum()
}

/// The summarizing strategy with background summaries on (the default ratio), a 16k window.
/// The cost trigger is off: its rent is followed per process, so replicas that each see half
/// of a conversation compact later than one that sees all of it (by design), and these tests
/// compare the summaries the window's trigger asks for.
fn background_toml(mock: &MockUpstream, redis: Option<&RedisServer>) -> String {
    let store = match redis {
        Some(r) => format!(
            "[store]\nbackend = \"redis\"\nredis_url = \"{}\"\nredis_timeout_secs = 0.5\n",
            r.url()
        ),
        None => String::new(),
    };
    format!(
        "{}[compaction]\nstrategy = \"summarize\"\ncost_trigger = false\n\
         [models.\"gpt-4o\"]\ncontext_window = 16000\n{store}",
        upstream_toml(&mock.url())
    )
}

/// Plays the conversation request by request over `replicas` in turn, each request after the
/// background summaries the previous one started have ended (an agent's think time outlasting
/// a summary). Returns the compactions the replicas counted and the background outcomes.
async fn play_with_background(replicas: &[&TestProxy], messages: &[Value]) -> (f64, f64, f64) {
    let client = TestClient::http1();
    let turns = (1..messages.len()).filter(|i| messages[*i]["role"] == "assistant");
    for (k, i) in turns.enumerate() {
        chat(
            &client,
            replicas[k % replicas.len()],
            AUTH,
            request_before(messages, i),
        )
        .await;
        for r in replicas {
            r.wait_metric("compactor_background_compactions_running", &[], 0.0)
                .await;
        }
    }
    let mut compacted = 0.0;
    let mut stored = 0.0;
    let mut discarded = 0.0;
    for r in replicas {
        let text = r.metrics().await;
        compacted += metric_sum(
            &text,
            "compactor_compactions_total",
            &[("outcome", "compacted")],
        );
        let background = "compactor_background_compactions_total";
        stored += metric_sum(&text, background, &[("outcome", "stored")]);
        discarded += metric_sum(&text, background, &[("outcome", "discarded")]);
    }
    (compacted, stored, discarded)
}

#[tokio::test]
async fn alternating_replicas_with_background_summaries_make_one_summary_per_compaction() {
    let messages = swe_agent_thrice();

    // One replica alone: the reference.
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let single = TestProxy::start(&background_toml(&mock, None)).await;
    let (compacted, _, discarded) = play_with_background(&[&single], &messages).await;
    let reference = provider.summaries();
    assert!(reference >= 2, "the conversation compacts at least twice");
    assert_eq!(
        reference as f64, compacted,
        "one replica: a call per compaction"
    );
    assert_eq!(discarded, 0.0);
    single.shutdown().await;

    let redis = RedisServer::start().await;
    let mock = MockUpstream::start().await;
    let provider = Provider::install(&mock);
    let a = TestProxy::start(&background_toml(&mock, Some(&redis))).await;
    let b = TestProxy::start(&background_toml(&mock, Some(&redis))).await;
    let (compacted, stored, discarded) = play_with_background(&[&a, &b], &messages).await;
    assert_eq!(discarded, 0.0, "no summary made ahead is thrown away");
    assert!(stored >= 1.0, "summaries are made ahead");
    assert_eq!(
        provider.summaries() as f64,
        compacted,
        "two replicas: one summarizer call per compaction"
    );
    assert_eq!(
        provider.summaries(),
        reference,
        "as many as one replica makes"
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn conversations_that_open_alike_part_at_their_first_reply_on_every_replica() {
    let redis = RedisServer::start().await;
    let mock = MockUpstream::start().await;
    Provider::install(&mock);
    let a = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let b = TestProxy::start(&toml(&mock, Some(&redis))).await;
    let client = TestClient::http1();
    let opening = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the failing test."}),
    ];
    let run = |tag: &str, turns: usize| {
        let mut m = opening.clone();
        for k in 0..turns {
            m.push(json!({"role": "assistant", "content": format!("{tag} step {k}")}));
            m.push(json!({"role": "user", "content": format!("{tag} output {k}")}));
        }
        Bytes::from(json!({"model": "gpt-4o", "messages": m}).to_string())
    };
    let id = |ex: Exchange| {
        ex.header("x-compactor-session")
            .expect("session")
            .to_owned()
    };
    let first = id(chat(&client, &a, AUTH, run("A", 0)).await);
    assert_eq!(first, id(chat(&client, &b, AUTH, run("B", 0)).await));
    let (mut ids_a, mut ids_b) = (Vec::new(), Vec::new());
    for turns in 1..5 {
        // Each conversation alternates replicas, the two interleaved.
        let (ra, rb) = if turns % 2 == 0 { (&a, &b) } else { (&b, &a) };
        ids_a.push(id(chat(&client, ra, AUTH, run("A", turns)).await));
        ids_b.push(id(chat(&client, rb, AUTH, run("B", turns)).await));
    }
    assert!(
        ids_a.iter().all(|i| *i == first),
        "A keeps its id: {ids_a:?}"
    );
    assert!(
        ids_b.iter().all(|i| *i == ids_b[0]),
        "B keeps its own: {ids_b:?}"
    );
    assert_ne!(ids_b[0], first, "B parted from A at its first reply");
    a.shutdown().await;
    b.shutdown().await;
}
