//! Failures over real sockets: unreachable (502), silent (504) and resetting (502) upstreams,
//! oversized chat bodies (413), and clients that go away mid-stream.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::json;
use support::{
    body_bytes, channel_body, full_body, raw_http1, refused_port, upstream_toml, within,
    MockUpstream, Reply, SseReader, TestClient, TestProxy,
};

/// Asserts an error response: the status, `application/json`, and
/// `{"error":{"message":<string>,"type":<string>,"code":<code>}}`.
async fn assert_json_error(response: http::Response<Incoming>, status: StatusCode, code: &str) {
    assert_eq!(response.status(), status);
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/json")
    );
    let body = body_bytes(response).await;
    let value: serde_json::Value = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("error body is not JSON ({e}): {body:?}"));
    let error = &value["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{value}"
    );
    assert!(error["type"].as_str().is_some(), "{value}");
    assert_eq!(error["code"].as_str(), Some(code), "{value}");
}

#[tokio::test]
async fn unreachable_upstream_is_502_with_json_body() {
    let refused = refused_port();
    let port = refused.port();
    let proxy = TestProxy::start(&upstream_toml(&format!("http://127.0.0.1:{port}"))).await;
    let client = TestClient::http1();

    let response = client.get(&proxy.url("/v1/models")).await;
    assert_json_error(response, StatusCode::BAD_GATEWAY, "upstream_unavailable").await;
    let response = client
        .post_json(
            &proxy.url("/v1/chat/completions"),
            &json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_json_error(response, StatusCode::BAD_GATEWAY, "upstream_unavailable").await;
    // The message names the upstream that could not be reached, as configured.
    let text = body_bytes(client.get(&proxy.url("/v1/models")).await).await;
    let text = String::from_utf8_lossy(&text);
    assert!(
        text.contains(&format!("upstream API at http://127.0.0.1:{port}")),
        "the 502 names the upstream: {text}"
    );

    proxy
        .wait_metric(
            "compactor_upstream_errors_total",
            &[("kind", "connect")],
            3.0,
        )
        .await;
    proxy
        .wait_metric(
            "compactor_requests_total",
            &[
                ("route", "other"),
                ("method", "GET"),
                ("status_class", "5xx"),
            ],
            2.0,
        )
        .await;
    proxy.shutdown().await;
}

#[tokio::test]
async fn upstream_resetting_the_connection_is_502() {
    let mock = MockUpstream::start().await;
    let proxy = TestProxy::start(&upstream_toml(&mock.url())).await;
    let client = TestClient::http1();
    mock.push(Reply::Reset);
    let response = client.get(&proxy.url("/v1/models")).await;
    assert_json_error(response, StatusCode::BAD_GATEWAY, "upstream_unavailable").await;
    assert_eq!(
        mock.request_count(),
        1,
        "the request reached the upstream once"
    );
    // The proxy recovers: the next request gets a fresh connection.
    let response = client.get(&proxy.url("/v1/models")).await;
    assert_eq!(response.status(), StatusCode::OK);
    let _ = body_bytes(response).await;
    proxy.shutdown().await;
}

#[tokio::test]
async fn silent_upstream_is_504_after_the_response_timeout() {
    let mock = MockUpstream::start().await;
    let toml = format!(
        "{}response_timeout_secs = 0.3\n",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();
    mock.push(Reply::Stall);
    let started = Instant::now();
    let response = client.get(&proxy.url("/v1/models")).await;
    let elapsed = started.elapsed();
    assert_json_error(response, StatusCode::GATEWAY_TIMEOUT, "upstream_timeout").await;
    assert!(
        elapsed >= Duration::from_millis(300),
        "answered before the timeout: {elapsed:?}"
    );
    assert!(
        elapsed < Duration::from_secs(5),
        "timeout not applied: {elapsed:?}"
    );
    proxy
        .wait_metric(
            "compactor_upstream_errors_total",
            &[("kind", "timeout")],
            1.0,
        )
        .await;

    // Chat requests obey the same timeout.
    mock.push(Reply::Stall);
    let response = client
        .post_json(
            &proxy.url("/v1/chat/completions"),
            &json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_json_error(response, StatusCode::GATEWAY_TIMEOUT, "upstream_timeout").await;
    proxy.shutdown().await;
}

#[tokio::test]
async fn oversized_chat_body_is_413_and_never_forwarded() {
    let mock = MockUpstream::start().await;
    let toml = format!(
        "[server]\nmax_body_bytes = 1024\n\n{}",
        upstream_toml(&mock.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();
    let big_chat = json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "x".repeat(4096)}]
    });

    // With a content-length…
    let response = client
        .post_json(&proxy.url("/v1/chat/completions"), &big_chat)
        .await;
    assert_json_error(response, StatusCode::PAYLOAD_TOO_LARGE, "request_too_large").await;

    // …and chunked, without one.
    let (tx, body) = channel_body();
    let request = Request::post(proxy.url("/v1/messages"))
        .header("content-type", "application/json")
        .body(body)
        .expect("request");
    let feeding = tokio::spawn(async move {
        for chunk in big_chat.to_string().as_bytes().chunks(512) {
            if !tx.send(Bytes::copy_from_slice(chunk)).await {
                break;
            }
        }
    });
    let response = client.send(request).await;
    assert_json_error(response, StatusCode::PAYLOAD_TOO_LARGE, "request_too_large").await;
    let _ = feeding.await;

    assert_eq!(
        mock.request_count(),
        0,
        "oversized chat bodies must not be forwarded"
    );

    // The limit is for chat bodies only: other bodies stream through whatever their size.
    let big = Bytes::from(vec![b'a'; 64 * 1024]);
    mock.push(Reply::Echo);
    let response = client
        .request("POST", &proxy.url("/v1/embeddings"), &[], big.clone())
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body_bytes(response).await, big);
    proxy.shutdown().await;
}

/// Starts a streamed response through a raw connection, reads the first event, then drops the
/// connection; asserts the upstream sees its stream closed and the in-flight gauge returns to 0.
async fn disconnect_mid_stream(method: &str, path: &str, body: Bytes) {
    let mock = MockUpstream::start().await;
    let proxy = TestProxy::start(&upstream_toml(&mock.url())).await;
    let (reply, sse) = Reply::sse_channel();
    mock.push(reply);

    let (mut sender, conn) = raw_http1(proxy.addr).await;
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", proxy.addr.to_string())
        .header("content-type", "application/json")
        .body(full_body(body))
        .expect("request");
    // A chat stream's head waits for its first content event (compactor holds it in case the
    // provider refuses the request for its length first): the event goes with the head.
    let (response, sent) = within("response head", async {
        tokio::join!(sender.send_request(request), sse.event("first"))
    })
    .await;
    sent.expect("stream open");
    let response = response.expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    let mut reader = SseReader::new(response);
    assert_eq!(reader.next_data().await.as_deref(), Some("first"));
    proxy
        .wait_metric("compactor_in_flight_requests", &[], 1.0)
        .await;

    // The client goes away.
    drop(reader);
    drop(sender);
    conn.abort();
    let _ = conn.await;

    // The upstream notices: its response body is dropped. Keep-alive comments give the proxy
    // writes that fail, as a real upstream would.
    within("upstream stream closed", async {
        loop {
            tokio::select! {
                _ = sse.closed() => break,
                _ = tokio::time::sleep(Duration::from_millis(50)) => {
                    if sse.send(": keep-alive\n\n").await.is_err() {
                        break;
                    }
                }
            }
        }
    })
    .await;
    proxy
        .wait_metric("compactor_in_flight_requests", &[], 0.0)
        .await;
    proxy.shutdown().await;
}

#[tokio::test]
async fn client_disconnect_mid_chat_stream_closes_upstream_and_clears_in_flight() {
    let body = json!({"model": "gpt-4o-mini", "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]});
    disconnect_mid_stream(
        "POST",
        "/v1/chat/completions",
        Bytes::from(body.to_string()),
    )
    .await;
}

#[tokio::test]
async fn client_disconnect_mid_passthrough_stream_closes_upstream_and_clears_in_flight() {
    disconnect_mid_stream("GET", "/v1/events", Bytes::new()).await;
}

#[tokio::test]
async fn upstream_dying_mid_stream_ends_the_client_stream() {
    let mock = MockUpstream::start().await;
    let proxy = TestProxy::start(&upstream_toml(&mock.url())).await;
    let client = TestClient::http1();
    let (reply, sse) = Reply::stream_channel(
        200,
        vec![
            ("content-type".into(), "text/event-stream".into()),
            // A length the body never reaches: the upstream breaks off mid-response.
            ("content-length".into(), "1000".into()),
        ],
    );
    mock.push(reply);
    let response = client.get(&proxy.url("/v1/events")).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    sse.event("only").await.expect("open");
    let frame = within("first frame", body.frame())
        .await
        .expect("frame")
        .expect("ok");
    assert_eq!(
        frame.into_data().unwrap_or_default(),
        Bytes::from("data: only\n\n")
    );
    drop(sse);
    // The client must see the body end abnormally, not hang and not as a clean end.
    let failed = within("client body end", async {
        loop {
            match body.frame().await {
                Some(Ok(_)) => continue,
                Some(Err(_)) => break true,
                None => break false,
            }
        }
    })
    .await;
    assert!(
        failed,
        "a cut-off upstream body must reach the client as an error"
    );
    proxy
        .wait_metric("compactor_in_flight_requests", &[], 0.0)
        .await;
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_stream_cut_mid_body_is_counted_and_the_client_gets_what_came() {
    let mock = MockUpstream::start().await;
    let proxy = TestProxy::start(&upstream_toml(&mock.url())).await;
    mock.push(Reply::ResetAfter {
        status: 200,
        headers: vec![("content-type".into(), "text/event-stream".into())],
        chunks: vec![Bytes::from_static(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"partial\"}}]}\n\n",
        )],
    });
    let body = json!({"model": "gpt-4o", "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]});
    let response = TestClient::http1()
        .send(
            Request::post(proxy.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(full_body(Bytes::from(body.to_string())))
                .expect("request"),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK, "the head was a success");
    let mut received = Vec::new();
    let mut body = response.into_body();
    let ended_in_error = loop {
        match body.frame().await {
            Some(Ok(frame)) => received.extend(frame.into_data().unwrap_or_default()),
            Some(Err(_)) => break true,
            None => break false,
        }
    };
    assert!(ended_in_error, "the client sees the stream break off");
    assert!(String::from_utf8_lossy(&received).contains("partial"));
    proxy
        .wait_metric(
            "compactor_upstream_errors_total",
            &[("kind", "stream_cut")],
            1.0,
        )
        .await;
    proxy.shutdown().await;
}
