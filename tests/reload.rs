//! Hot reload through the real binary: a changed config file is picked up for new requests,
//! SIGHUP reloads too, and an invalid file keeps the running configuration and is counted.
//! A file caught mid-write (empty, comments only, cut off) or one that would drop the admin
//! token or the upstream is refused: requests keep going to the running upstream and the
//! admin API keeps its token. A real change is logged by key name, never by value, and a new
//! upstream is counted.

mod support;

use http::StatusCode;
use serde_json::json;
use support::{upstream_toml, Binary, MockUpstream, TestClient};

/// Every secret in these tests contains this marker; no log line may.
const SECRET: &str = "SECRET";

fn config(mock: &str, max_messages: usize) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [compaction]\nmax_messages = {max_messages}\nmin_preserve_tokens = 10\n\
         [summarizer]\nbackend = \"extractive\"\n\n{}",
        upstream_toml(mock)
    )
}

/// A six-message conversation: compacted only when `max_messages` < 6. Each `topic` is a
/// different conversation (a compacted one keeps its stored summary whatever the config).
fn request(topic: &str) -> serde_json::Value {
    let mut messages =
        vec![json!({"role": "system", "content": format!("Be brief about {topic}.")})];
    for i in 0..5 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages
            .push(json!({"role": role, "content": format!("turn {i}: {}", "words ".repeat(300))}));
    }
    json!({"model": "gpt-4o", "messages": messages})
}

async fn compacted(client: &TestClient, binary: &Binary, topic: &str) -> bool {
    let response = client
        .post_json(
            &format!("http://{}/v1/chat/completions", binary.proxy),
            &request(topic),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    response.headers()["x-compactor-compacted"] == "true"
}

async fn reloads(client: &TestClient, binary: &Binary, result: &str) -> f64 {
    let (_, text) = client
        .get_text(&format!("http://{}/metrics", binary.admin))
        .await;
    support::metric_value(
        &text,
        "compactor_config_reloads_total",
        &[("result", result)],
    )
    .unwrap_or(0.0)
}

#[tokio::test]
async fn file_changes_and_sighup_reload_and_bad_files_are_refused() {
    let mock = MockUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("compactor.toml");
    std::fs::write(&path, config(&mock.url(), 100)).expect("write config");
    let binary = Binary::serve(&path, dir.path()).await;
    let client = TestClient::http1();

    assert!(
        !compacted(&client, &binary, "a").await,
        "100 messages allowed at start"
    );

    // The file changes: new requests see the new threshold (the watcher polls the file).
    std::fs::write(&path, config(&mock.url(), 4)).expect("rewrite config");
    support::eventually("the changed file to be reloaded", || async {
        (reloads(&client, &binary, "ok").await >= 1.0).then_some(())
    })
    .await;
    assert!(
        compacted(&client, &binary, "b").await,
        "max_messages = 4 applies after reload"
    );

    // An invalid file is refused on SIGHUP; the running configuration stays.
    std::fs::write(
        &path,
        format!("{}\n[compaction]\nbogus = 1\n", config(&mock.url(), 100)),
    )
    .expect("write invalid config");
    binary.signal("HUP");
    support::eventually("the invalid reload to be counted", || async {
        (reloads(&client, &binary, "error").await >= 1.0).then_some(())
    })
    .await;
    assert!(
        compacted(&client, &binary, "c").await,
        "still max_messages = 4"
    );

    // A valid file again, by SIGHUP: back to no compaction.
    std::fs::write(&path, config(&mock.url(), 100)).expect("write config");
    binary.signal("HUP");
    support::eventually("the second good reload", || async {
        (reloads(&client, &binary, "ok").await >= 2.0).then_some(())
    })
    .await;
    assert!(
        !compacted(&client, &binary, "d").await,
        "max_messages = 100 again"
    );
    // Sessions survive reloads: the conversation compacted earlier still gets its summary.
    assert!(
        compacted(&client, &binary, "b").await,
        "stored summary reused after reload"
    );
}

/// A running configuration with an admin token and the upstream `mock`.
fn guarded(mock: &str, token: &str, max_messages: usize) -> String {
    format!(
        "{}[admin]\ntoken = \"{token}\"\n",
        config(mock, max_messages)
    )
}

/// `GET <admin><path>` with `token` (if any): the status.
async fn admin_status(
    client: &TestClient,
    binary: &Binary,
    path: &str,
    token: Option<&str>,
) -> StatusCode {
    let bearer = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = bearer
        .iter()
        .map(|b| ("authorization", b.as_str()))
        .collect();
    client
        .request(
            "GET",
            &format!("http://{}{path}", binary.admin),
            &headers,
            "",
        )
        .await
        .status()
}

/// One sample of `/metrics`, scraped with `token`; 0 when absent.
async fn metric(
    client: &TestClient,
    binary: &Binary,
    token: &str,
    name: &str,
    labels: &[(&str, &str)],
) -> f64 {
    let scraped = scrape(client, binary, token, name, labels).await;
    scraped.expect("GET /metrics answers 200 with this token")
}

/// One sample of `/metrics` scraped with `token` (0 when absent); `None` when the token is
/// refused (a reload may change it between two scrapes).
async fn scrape(
    client: &TestClient,
    binary: &Binary,
    token: &str,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<f64> {
    let response = client
        .request(
            "GET",
            &format!("http://{}/metrics", binary.admin),
            &[("authorization", &format!("Bearer {token}"))],
            "",
        )
        .await;
    if response.status() != StatusCode::OK {
        return None;
    }
    let text = String::from_utf8_lossy(&support::body_bytes(response).await).into_owned();
    Some(support::metric_value(&text, name, labels).unwrap_or(0.0))
}

/// Stops the binary and returns its whole log.
async fn log_of(mut binary: Binary) -> String {
    binary.signal("TERM");
    support::within("compactor exit", binary.child.wait())
        .await
        .expect("wait");
    let rest = (&mut binary.drain).await.unwrap_or_default();
    [binary.log.clone(), rest].concat().join("\n")
}

#[tokio::test]
async fn a_file_caught_mid_write_or_dropping_auth_or_the_upstream_is_refused() {
    const TOKEN: &str = "tok-SECRET-admin";
    let mock = MockUpstream::start().await;
    let full = guarded(&mock.url(), TOKEN, 100);
    let cut_in_token = full.find(TOKEN).expect("token in file") + 7;
    let without_upstream = full.replace(&upstream_toml(&mock.url()), "");
    assert_ne!(without_upstream, full);
    let cases: [(&str, &str, &str); 6] = [
        ("empty", "", "sets nothing"),
        ("whitespace", " \n\n\t\n", "sets nothing"),
        (
            "comments only",
            "# compactor\n\n# [upstream]\n# base_url = \"http://elsewhere\"\n",
            "sets nothing",
        ),
        (
            "cut off in the token",
            &full[..cut_in_token],
            "not valid TOML",
        ),
        (
            "[server] only",
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n",
            "invalid `admin.token`",
        ),
        (
            "no [upstream]",
            &without_upstream,
            "invalid `upstream.base_url`",
        ),
    ];
    let client = TestClient::http1();
    for (case, text, reason) in cases {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("compactor.toml");
        std::fs::write(&path, &full).expect("write config");
        let binary = Binary::serve(&path, dir.path()).await;
        assert_eq!(
            admin_status(&client, &binary, "/sessions", None).await,
            StatusCode::UNAUTHORIZED
        );

        std::fs::write(&path, text).expect("write the accidental file");
        binary.signal("HUP");
        let reloads = [("result", "error")];
        support::eventually("the refused reload to be counted", || async {
            (metric(
                &client,
                &binary,
                TOKEN,
                "compactor_config_reloads_total",
                &reloads,
            )
            .await
                >= 1.0)
                .then_some(())
        })
        .await;

        // The running configuration stays: the admin API keeps its token, requests keep
        // going to the running upstream.
        assert_eq!(
            admin_status(&client, &binary, "/sessions", None).await,
            StatusCode::UNAUTHORIZED,
            "{case}: /sessions without the token"
        );
        assert_eq!(
            admin_status(&client, &binary, "/sessions", Some(TOKEN)).await,
            StatusCode::OK,
            "{case}: /sessions with the token"
        );
        let before = mock.request_count();
        assert!(
            !compacted(&client, &binary, case).await,
            "{case}: still max_messages = 100"
        );
        assert_eq!(
            mock.request_count(),
            before + 1,
            "{case}: the request went to the running upstream"
        );
        let ok = [("result", "ok")];
        assert_eq!(
            metric(
                &client,
                &binary,
                TOKEN,
                "compactor_config_reloads_total",
                &ok
            )
            .await,
            0.0,
            "{case}: nothing was applied"
        );
        let removed = metric(
            &client,
            &binary,
            TOKEN,
            "compactor_config_risky_reloads_total",
            &[("change", "admin_auth_removed")],
        )
        .await;
        assert_eq!(
            removed > 0.0,
            case == "[server] only",
            "{case}: admin_auth_removed counted {removed}"
        );

        let log = log_of(binary).await;
        assert!(
            log.lines()
                .any(|l| l.contains("configuration reload failed") && l.contains(reason)),
            "{case}: no refusal naming {reason:?} in the log:\n{log}"
        );
        assert!(
            !log.contains("configuration reloaded"),
            "{case}: applied:\n{log}"
        );
        assert!(
            !log.contains(SECRET),
            "{case}: a secret reached the log:\n{log}"
        );
    }
}

#[tokio::test]
async fn a_real_change_is_logged_by_key_and_a_new_upstream_is_counted() {
    const OLD: &str = "tok-SECRET-old";
    const NEW: &str = "tok-SECRET-new";
    let (first, second) = (MockUpstream::start().await, MockUpstream::start().await);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("compactor.toml");
    std::fs::write(&path, guarded(&first.url(), OLD, 100)).expect("write config");
    let binary = Binary::serve(&path, dir.path()).await;
    let client = TestClient::http1();
    assert!(!compacted(&client, &binary, "a").await);
    assert_eq!(first.request_count(), 1);

    // Picked up by the file watcher (no signal), once the file has settled.
    std::fs::write(
        &path,
        format!(
            "{}[store]\nredis_url = \"redis://:pw-{SECRET}@127.0.0.1:6379\"\n",
            guarded(&second.url(), NEW, 4)
        ),
    )
    .expect("rewrite config");
    let ok = [("result", "ok")];
    support::eventually("the changed file to be reloaded", || async {
        // The token changes with the reload (possibly between two scrapes): only the new one
        // is let in once the reload counted.
        let reloads = scrape(&client, &binary, NEW, "compactor_config_reloads_total", &ok).await;
        reloads.filter(|n| *n >= 1.0).map(|_| ())
    })
    .await;

    assert!(
        compacted(&client, &binary, "b").await,
        "max_messages = 4 applies"
    );
    assert_eq!(second.request_count(), 1, "requests go to the new upstream");
    assert_eq!(first.request_count(), 1);
    assert_eq!(
        admin_status(&client, &binary, "/sessions", Some(OLD)).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        admin_status(&client, &binary, "/sessions", Some(NEW)).await,
        StatusCode::OK
    );
    let risky = |change: &'static str| {
        let (client, binary) = (&client, &binary);
        async move {
            metric(
                client,
                binary,
                NEW,
                "compactor_config_risky_reloads_total",
                &[("change", change)],
            )
            .await
        }
    };
    assert_eq!(risky("upstream").await, 1.0);
    assert_eq!(risky("admin_auth_removed").await, 0.0);

    let log = log_of(binary).await;
    let reloaded = log
        .lines()
        .find(|l| l.contains("INFO") && l.contains("configuration reloaded"))
        .unwrap_or_else(|| panic!("no reload line:\n{log}"));
    for key in [
        "\"admin.token\"",
        "\"compaction.max_messages\"",
        "\"store.redis_url\"",
        "\"upstream.base_url\"",
    ] {
        assert!(reloaded.contains(key), "{key} missing from {reloaded}");
    }
    assert!(!reloaded.contains("server.listen"), "{reloaded}");
    let warning = log
        .lines()
        .find(|l| l.contains("WARN") && l.contains("requests now go to a different upstream"))
        .unwrap_or_else(|| panic!("no upstream warning:\n{log}"));
    assert!(
        warning.contains(&format!("http://{}", second.addr())),
        "{warning}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("needs_restart") && l.contains("store")),
        "the store change needs a restart:\n{log}"
    );
    assert!(!log.contains(SECRET), "a secret reached the log:\n{log}");
}
