//! Hot reload through the real binary: a changed config file is picked up for new requests,
//! SIGHUP reloads too, and an invalid file keeps the running configuration and is counted.

mod support;

use http::StatusCode;
use serde_json::json;
use support::{upstream_toml, Binary, MockUpstream, TestClient};

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
