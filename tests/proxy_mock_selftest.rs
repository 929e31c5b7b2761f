//! Self-tests of the test support (no proxy involved): the mock upstream's scripts behave as the
//! proxy tests assume, so a failure there points at the proxy, not at the harness.

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, Version};
use http_body_util::BodyExt;
use serde_json::json;
use support::{
    body_bytes, channel_body, full_body, raw_http1, within, MockUpstream, Reply, SseReader,
    TestClient, TestPki,
};

#[tokio::test]
async fn records_requests_and_serves_scripts_in_order() {
    let mock = MockUpstream::start().await;
    let client = TestClient::http1();
    mock.push(Reply::json(201, &json!({"a": 1})).with_header("x-k", "v"));
    mock.push(Reply::status(503));
    let r = client
        .request(
            "POST",
            &format!("{}/p?q=1", mock.url()),
            &[("authorization", "Bearer t")],
            "hello",
        )
        .await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(r.headers()["x-k"], "v");
    assert_eq!(body_bytes(r).await, Bytes::from(r#"{"a":1}"#));
    let r = client.get(&format!("{}/x", mock.url())).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let _ = body_bytes(r).await;
    let r = client.get(&format!("{}/y", mock.url())).await;
    assert_eq!(r.status(), StatusCode::OK, "default reply");
    let _ = body_bytes(r).await;

    let seen = mock.requests();
    assert_eq!(seen.len(), 3);
    assert_eq!(seen[0].path_and_query, "/p?q=1");
    assert_eq!(seen[0].body, Bytes::from("hello"));
    assert_eq!(seen[0].header("authorization"), Some("Bearer t"));
    assert_eq!(
        seen[0].host().as_deref(),
        Some(mock.addr().to_string().as_str())
    );
    assert_eq!(seen[2].method, "GET");
}

#[tokio::test]
async fn sse_channel_is_test_paced_and_observes_the_client_leaving() {
    let mock = MockUpstream::start().await;
    let (reply, sse) = Reply::sse_channel();
    mock.push(reply);
    let (mut sender, conn) = raw_http1(mock.addr()).await;
    let request = Request::get("/events")
        .header("host", mock.addr().to_string())
        .body(support::empty_body())
        .expect("request");
    let response = within("head", sender.send_request(request))
        .await
        .expect("ok");
    let mut reader = SseReader::new(response);
    sse.event("1").await.expect("open");
    assert_eq!(reader.next_data().await.as_deref(), Some("1"));
    sse.event("2").await.expect("open");
    assert_eq!(reader.next_data().await.as_deref(), Some("2"));
    drop(reader);
    drop(sender);
    conn.abort();
    within("close observed", async {
        loop {
            tokio::select! {
                _ = sse.closed() => break,
                _ = tokio::time::sleep(Duration::from_millis(50)) => {
                    if sse.send(": ping\n\n").await.is_err() { break; }
                }
            }
        }
    })
    .await;
}

#[tokio::test]
async fn stall_reset_and_echo_stream() {
    let mock = MockUpstream::start().await;
    let client = TestClient::http1();

    mock.push(Reply::Stall);
    let stalled = tokio::time::timeout(
        Duration::from_millis(300),
        client.try_send(
            Request::get(format!("{}/stall", mock.url()))
                .body(support::empty_body())
                .expect("request"),
        ),
    )
    .await;
    assert!(stalled.is_err(), "stall must not answer");

    mock.push(Reply::Reset);
    let reset = client
        .try_send(
            Request::get(format!("{}/reset", mock.url()))
                .body(support::empty_body())
                .expect("request"),
        )
        .await;
    assert!(reset.is_err(), "reset must not answer");

    mock.push(Reply::EchoStream);
    let (tx, body) = channel_body();
    let request = Request::post(format!("{}/echo", mock.url()))
        .body(body)
        .expect("request");
    let first = tokio::spawn(async move {
        assert!(tx.send("one").await);
        tx
    });
    let response = client.send(request).await;
    let tx = first.await.expect("sender");
    let mut body = response.into_body();
    let frame = within("echo", body.frame())
        .await
        .expect("frame")
        .expect("ok");
    assert_eq!(frame.into_data().unwrap_or_default(), Bytes::from("one"));
    assert!(tx.send("two").await);
    drop(tx);
    let rest = within("rest", body.collect()).await.expect("ok").to_bytes();
    assert_eq!(rest, Bytes::from("two"));
    let seen = mock.wait_for_requests(3).await;
    assert_eq!(
        seen.last().map(|r| r.body.clone()),
        Some(Bytes::from("onetwo"))
    );
}

#[tokio::test]
async fn h2c_and_tls_mocks() {
    let mock = MockUpstream::start().await;
    let r = TestClient::h2c().get(&format!("{}/h2", mock.url())).await;
    assert_eq!(r.version(), Version::HTTP_2);
    let _ = body_bytes(r).await;
    assert_eq!(
        mock.last_request().host().as_deref(),
        Some(mock.addr().to_string().as_str())
    );

    let pki = TestPki::new();
    let tls = MockUpstream::start_tls(&pki).await;
    let client = TestClient::https(&pki);
    let r = client
        .send(
            Request::post(format!("{}/tls", tls.url()))
                .body(full_body("x"))
                .expect("request"),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.version(), Version::HTTP_2, "ALPN h2");
    let _ = body_bytes(r).await;
    assert_eq!(tls.last_request().body, Bytes::from("x"));
    // A client without the CA is refused.
    let other = TestClient::https(&TestPki::new());
    assert!(other
        .try_send(
            Request::get(format!("{}/tls", tls.url()))
                .body(support::empty_body())
                .expect("request")
        )
        .await
        .is_err());
}
