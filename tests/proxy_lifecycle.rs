//! Graceful shutdown: through the library API (in-flight streams finish, new connections are
//! refused, the drain is bounded by `server.shutdown_grace_secs`) and through the binary
//! (SIGTERM → exit 0).

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::StatusCode;
use serde_json::json;
use support::{
    upstream_toml, within, Binary, MockUpstream, Reply, SseReader, TestClient, TestProxy,
};

/// Polls until connecting to `addr` is refused (bounded by the test timeout).
async fn wait_until_refused(addr: SocketAddr) {
    support::eventually(&format!("{addr} to refuse connections"), || async move {
        match tokio::net::TcpStream::connect(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Some(()),
            _ => None,
        }
    })
    .await
}

#[tokio::test]
async fn shutdown_lets_in_flight_streams_finish_and_refuses_new_connections() {
    let mock = MockUpstream::start().await;
    let mut proxy = TestProxy::start(&upstream_toml(&mock.url())).await;
    let client = TestClient::http1();
    let (reply, sse) = Reply::sse_channel();
    mock.push(reply);

    // The head of a chat stream comes with its first content event (compactor holds it until
    // then, in case the provider refuses the request for its length first).
    let url = proxy.url("/v1/chat/completions");
    let request = json!({"model": "gpt-4o-mini", "stream": true,
                         "messages": [{"role": "user", "content": "count to three"}]});
    let (response, sent) = tokio::join!(client.post_json(&url, &request), sse.event("one"));
    sent.expect("open");
    assert_eq!(response.status(), StatusCode::OK);
    let mut reader = SseReader::new(response);
    assert_eq!(reader.next_data().await.as_deref(), Some("one"));

    proxy.trigger_shutdown();
    let mut task = proxy.take_task();
    wait_until_refused(proxy.addr).await;

    // The stream started before shutdown runs to its end.
    sse.event("two").await.expect("stream survives shutdown");
    assert_eq!(reader.next_data().await.as_deref(), Some("two"));
    sse.event("three").await.expect("stream survives shutdown");
    assert_eq!(reader.next_data().await.as_deref(), Some("three"));
    sse.event("[DONE]").await.expect("stream survives shutdown");
    assert_eq!(reader.next_data().await.as_deref(), Some("[DONE]"));
    assert!(
        tokio::time::timeout(Duration::from_millis(1), &mut task)
            .await
            .is_err(),
        "run returned while a stream was still open"
    );
    sse.finish();
    assert_eq!(reader.next_event().await, None);

    within("drain to complete", task)
        .await
        .expect("server task")
        .expect("run returns Ok after the drain");
}

#[tokio::test]
async fn shutdown_drain_is_bounded_by_the_grace_period() {
    let mock = MockUpstream::start().await;
    let toml = format!(
        "[server]\nshutdown_grace_secs = 0.5\n\n{}",
        upstream_toml(&mock.url())
    );
    let mut proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();
    let (reply, sse) = Reply::sse_channel();
    mock.push(reply);
    let response = client.get(&proxy.url("/v1/events")).await;
    let mut reader = SseReader::new(response);
    sse.event("one").await.expect("open");
    assert_eq!(reader.next_data().await.as_deref(), Some("one"));

    // The upstream never finishes; shutdown must not wait for it past the grace period.
    let started = Instant::now();
    proxy.trigger_shutdown();
    let task = proxy.take_task();
    let result = within("bounded drain", task).await.expect("server task");
    let elapsed = started.elapsed();
    assert!(result.is_ok(), "{result:?}");
    assert!(
        elapsed < Duration::from_secs(5),
        "drain took {elapsed:?} with a 0.5 s grace period"
    );
    drop(sse);
}

#[tokio::test]
async fn binary_exits_zero_on_sigterm_after_draining() {
    let mock = MockUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("compactor.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             shutdown_grace_secs = 10\n\n{}",
            upstream_toml(&mock.url())
        ),
    )
    .expect("write config");

    let mut binary = Binary::serve(&config, dir.path()).await;
    let (proxy, admin) = (binary.proxy, binary.admin);
    let client = TestClient::http1();
    let (status, _) = client.get_text(&format!("http://{admin}/livez")).await;
    assert_eq!(status, StatusCode::OK);

    // A stream is open when SIGTERM arrives; it still completes.
    let (reply, sse) = Reply::sse_channel();
    mock.push(reply);
    let response = client.get(&format!("http://{proxy}/v1/events")).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut reader = SseReader::new(response);
    sse.event("before").await.expect("open");
    assert_eq!(reader.next_data().await.as_deref(), Some("before"));

    binary.signal("TERM");
    wait_until_refused(proxy).await;

    sse.event("after").await.expect("stream survives SIGTERM");
    assert_eq!(reader.next_data().await.as_deref(), Some("after"));
    sse.finish();
    assert_eq!(reader.next_event().await, None);

    let status = within("compactor exit", binary.child.wait())
        .await
        .expect("wait");
    let rest = (&mut binary.drain).await.unwrap_or_default();
    assert_eq!(
        status.code(),
        Some(0),
        "exit status {status:?}; log:\n{}\n{}",
        binary.log.join("\n"),
        rest.join("\n")
    );
}

/// Secrets from the environment are taken as the exact strings they are: a numeric admin token
/// (figment would read `007` as the number 7) guards the admin port verbatim.
#[tokio::test]
async fn a_numeric_admin_token_from_the_environment_is_used_verbatim() {
    let mock = MockUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("compactor.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\n{}",
            upstream_toml(&mock.url())
        ),
    )
    .expect("write config");
    let binary = Binary::serve_with_env(
        &config,
        dir.path(),
        "info",
        &[("COMPACTOR_ADMIN__TOKEN", "007")],
    )
    .await;
    let client = TestClient::http1();
    let metrics = format!("http://{}/metrics", binary.admin);
    for (bearer, expected) in [
        (None, StatusCode::UNAUTHORIZED),
        (Some("Bearer 7"), StatusCode::UNAUTHORIZED),
        (Some("Bearer 007"), StatusCode::OK),
    ] {
        let headers: Vec<(&str, &str)> = bearer.map(|b| ("authorization", b)).into_iter().collect();
        let response = client.request("GET", &metrics, &headers, "").await;
        assert_eq!(response.status(), expected, "{bearer:?}");
    }
}
