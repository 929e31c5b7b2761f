//! Transparent forwarding over real sockets: bodies byte for byte (both ways, streamed), SSE
//! flushed event by event, headers (hop-by-hop, auth, vendor, Host, X-Forwarded-For),
//! `[[routes]]` prefixes, and the admin listener's metrics.

mod support;

use bytes::Bytes;
use http::{Request, StatusCode};
use serde_json::json;
use support::{
    body_bytes, channel_body, pseudo_random_bytes, upstream_toml, within, MockUpstream, Reply,
    SseReader, TestClient, TestProxy,
};

async fn setup() -> (MockUpstream, TestProxy, TestClient) {
    let mock = MockUpstream::start().await;
    let proxy = TestProxy::start(&upstream_toml(&mock.url())).await;
    (mock, proxy, TestClient::http1())
}

/// A JSON document of roughly `size` bytes (an embeddings request with a long input list).
fn big_json(size: usize) -> Bytes {
    let mut inputs = Vec::new();
    let mut total = 0;
    let mut i = 0u64;
    while total < size {
        let s = format!("document {i}: {}", "lorem ipsum dolor sit amet ".repeat(8));
        total += s.len() + 3;
        inputs.push(s);
        i += 1;
    }
    Bytes::from(json!({"model": "text-embedding-3-small", "input": inputs}).to_string())
}

#[tokio::test]
async fn five_megabyte_json_request_arrives_byte_identical() {
    let (mock, proxy, client) = setup().await;
    let body = big_json(5 * 1024 * 1024);
    assert!(body.len() >= 5 * 1024 * 1024);
    mock.push(Reply::json(200, &json!({"object": "list", "data": []})));

    let response = client
        .request(
            "POST",
            &proxy.url("/v1/embeddings?trace=1"),
            &[("content-type", "application/json")],
            body.clone(),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        body_bytes(response).await,
        Bytes::from(json!({"object": "list", "data": []}).to_string())
    );

    let seen = mock.last_request();
    assert_eq!(seen.method, "POST");
    assert_eq!(seen.path_and_query, "/v1/embeddings?trace=1");
    assert_eq!(seen.body.len(), body.len());
    assert!(seen.body == body, "request body changed in transit");
    proxy.shutdown().await;
}

#[tokio::test]
async fn binary_request_body_round_trips_byte_identical() {
    let (mock, proxy, client) = setup().await;
    let body = Bytes::from(pseudo_random_bytes(3 * 1024 * 1024 + 17, 7));
    mock.push(Reply::Echo);

    let response = client
        .request(
            "PUT",
            &proxy.url("/v1/files/upload"),
            &[("content-type", "application/octet-stream")],
            body.clone(),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-echo-method"], "PUT");
    let echoed = body_bytes(response).await;
    assert!(
        echoed == body,
        "echoed body differs ({} bytes)",
        echoed.len()
    );
    assert!(
        mock.last_request().body == body,
        "upstream saw a different body"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn five_megabyte_responses_come_back_byte_identical() {
    let (mock, proxy, client) = setup().await;
    let big = Bytes::from(pseudo_random_bytes(5 * 1024 * 1024, 9));

    // With a content-length…
    mock.push(Reply::bytes(200, "application/octet-stream", big.clone()));
    let response = client.get(&proxy.url("/v1/files/file-1/content")).await;
    assert_eq!(response.status(), StatusCode::OK);
    let got = body_bytes(response).await;
    assert!(got == big, "response body differs ({} bytes)", got.len());

    // …and chunked, in 64 KiB frames.
    mock.push(Reply::Chunks {
        status: 200,
        headers: vec![("content-type".into(), "application/octet-stream".into())],
        chunks: big.chunks(64 * 1024).map(Bytes::copy_from_slice).collect(),
    });
    let response = client.get(&proxy.url("/v1/files/file-2/content")).await;
    let got = body_bytes(response).await;
    assert!(
        got == big,
        "chunked response body differs ({} bytes)",
        got.len()
    );

    // Every method reaches the upstream.
    for method in ["GET", "DELETE", "PATCH", "OPTIONS", "HEAD"] {
        let response = client
            .request(method, &proxy.url("/v1/anything"), &[], Bytes::new())
            .await;
        assert_eq!(response.status(), StatusCode::OK, "{method}");
        let _ = body_bytes(response).await;
        assert_eq!(mock.last_request().method, method);
    }
    proxy.shutdown().await;
}

#[tokio::test]
async fn request_and_response_bodies_stream_both_ways_without_buffering() {
    let (mock, proxy, client) = setup().await;
    mock.push(Reply::EchoStream);
    let (tx, body) = channel_body();
    let request = Request::post(proxy.url("/v1/uploads/stream"))
        .header("content-type", "application/octet-stream")
        .body(body)
        .expect("request");
    // The request body is still open while we wait for the response head: only possible if
    // neither the proxy nor the upstream waits for the whole request body.
    let sending = tokio::spawn(async move {
        assert!(tx.send("chunk-one;").await, "request body closed early");
        tx
    });
    let response = client.send(request).await;
    assert_eq!(response.status(), StatusCode::OK);
    let tx = within("first chunk sent", sending)
        .await
        .expect("sender task");
    let mut body = response.into_body();
    let mut got = Vec::new();
    while got.len() < b"chunk-one;".len() {
        use http_body_util::BodyExt;
        let frame = within("first echoed chunk", body.frame())
            .await
            .expect("body ended early")
            .expect("body error");
        got.extend_from_slice(&frame.into_data().unwrap_or_default());
    }
    assert_eq!(got, b"chunk-one;");
    // Only now does the client produce the second chunk.
    assert!(tx.send("chunk-two").await);
    drop(tx);
    let rest = within("rest of echo", http_body_util::BodyExt::collect(body))
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(&rest[..], b"chunk-two");
    let seen = mock.wait_for_requests(1).await;
    assert_eq!(&seen[0].body[..], b"chunk-one;chunk-two");
    proxy.shutdown().await;
}

#[tokio::test]
async fn sse_events_reach_the_client_one_at_a_time() {
    let (mock, proxy, client) = setup().await;
    let (reply, sse) = Reply::sse_channel();
    mock.push(reply);
    let request = json!({
        "model": "gpt-4o-mini",
        "stream": true,
        "messages": [{"role": "user", "content": "Say hi"}]
    });
    // compactor holds a chat stream's head until its first content event (a refusal for length
    // may come before it, to be retried): the first event goes out with the head.
    let event =
        |n: usize| json!({"choices": [{"delta": {"content": format!("part {n}")}}]}).to_string();
    let (url, first) = (proxy.url("/v1/chat/completions"), event(1));
    let (response, sent) = tokio::join!(client.post_json(&url, &request), sse.event(&first));
    sent.expect("proxy still reading");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert_eq!(
        response
            .headers()
            .get("x-compactor-compacted")
            .map(|v| v.to_str().unwrap_or("")),
        Some("false"),
        "chat responses say whether they were compacted"
    );
    let mut reader = SseReader::new(response);
    assert_eq!(reader.next_data().await, Some(event(1)));

    // The upstream writes event 3 only after the client has received event 2.
    for n in 2..=3 {
        sse.event(&event(n)).await.expect("proxy still reading");
        assert_eq!(reader.next_data().await, Some(event(n)));
    }
    sse.event("[DONE]").await.expect("proxy still reading");
    assert_eq!(reader.next_data().await.as_deref(), Some("[DONE]"));
    sse.finish();
    assert_eq!(
        reader.next_event().await,
        None,
        "stream ends when upstream ends"
    );

    // Nothing to compact: the upstream saw the client's bytes.
    assert_eq!(mock.last_request().body, Bytes::from(request.to_string()));
    proxy.shutdown().await;
}

#[tokio::test]
async fn hop_by_hop_headers_are_stripped_both_ways_and_end_to_end_headers_kept() {
    let (mock, proxy, client) = setup().await;
    mock.push(
        Reply::json(200, &json!({"ok": true}))
            .with_header("connection", "x-resp-hop")
            .with_header("x-resp-hop", "1")
            .with_header("keep-alive", "timeout=5")
            .with_header("proxy-authenticate", "Basic realm=\"up\"")
            .with_header("upgrade", "h2c")
            .with_header("trailer", "x-checksum")
            .with_header("x-request-id", "req-123")
            .with_header("openai-processing-ms", "12")
            .with_header("anthropic-ratelimit-requests-remaining", "99")
            .with_header("x-ratelimit-remaining-tokens", "1000"),
    );
    let response = client
        .request(
            "POST",
            &proxy.url("/v1/messages"),
            &[
                ("host", "client-facing.example"),
                ("content-type", "application/json"),
                ("authorization", "Bearer sk-test-123"),
                ("x-api-key", "sk-ant-test-456"),
                ("anthropic-version", "2023-06-01"),
                ("anthropic-beta", "tools-2024-04-04"),
                ("openai-organization", "org-abc"),
                ("openai-project", "proj-def"),
                ("x-custom-end-to-end", "kept"),
                ("connection", "keep-alive, x-hop-custom"),
                ("x-hop-custom", "must-go"),
                ("keep-alive", "timeout=5"),
                ("proxy-connection", "keep-alive"),
                ("te", "trailers"),
                ("trailer", "x-checksum"),
                ("proxy-authorization", "Basic dXNlcjpwYXNz"),
                ("x-forwarded-for", "10.1.2.3"),
            ],
            json!({"model": "claude-3-5-haiku", "max_tokens": 16,
                   "messages": [{"role": "user", "content": "hi"}]})
            .to_string(),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);

    // Response side.
    let h = response.headers().clone();
    for gone in [
        "x-resp-hop",
        "keep-alive",
        "proxy-authenticate",
        "upgrade",
        "trailer",
    ] {
        assert!(
            h.get(gone).is_none(),
            "response kept hop-by-hop `{gone}`: {h:?}"
        );
    }
    if let Some(c) = h.get("connection") {
        let c = c.to_str().unwrap_or("").to_ascii_lowercase();
        assert!(
            !c.contains("x-resp-hop"),
            "upstream's Connection leaked: {c}"
        );
    }
    assert_eq!(h["x-request-id"], "req-123");
    assert_eq!(h["openai-processing-ms"], "12");
    assert_eq!(h["anthropic-ratelimit-requests-remaining"], "99");
    assert_eq!(h["x-ratelimit-remaining-tokens"], "1000");
    assert_eq!(h["content-type"], "application/json");
    let _ = body_bytes(response).await;

    // Request side.
    let seen = mock.last_request();
    for gone in [
        "connection",
        "x-hop-custom",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "proxy-authorization",
        "upgrade",
    ] {
        assert!(
            seen.headers.get(gone).is_none(),
            "upstream received hop-by-hop `{gone}`: {:?}",
            seen.headers
        );
    }
    assert_eq!(seen.header("authorization"), Some("Bearer sk-test-123"));
    assert_eq!(seen.header("x-api-key"), Some("sk-ant-test-456"));
    assert_eq!(seen.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(seen.header("anthropic-beta"), Some("tools-2024-04-04"));
    assert_eq!(seen.header("openai-organization"), Some("org-abc"));
    assert_eq!(seen.header("openai-project"), Some("proj-def"));
    assert_eq!(seen.header("x-custom-end-to-end"), Some("kept"));
    assert_eq!(seen.header("content-type"), Some("application/json"));
    assert_eq!(
        seen.host().as_deref(),
        Some(mock.addr().to_string().as_str())
    );
    assert_eq!(
        seen.header_all("x-forwarded-for"),
        vec!["10.1.2.3, 127.0.0.1".to_string()]
    );

    // Without an incoming X-Forwarded-For the proxy starts one.
    let response = client.get(&proxy.url("/v1/models")).await;
    let _ = body_bytes(response).await;
    let seen = mock.last_request();
    assert_eq!(
        seen.header_all("x-forwarded-for"),
        vec!["127.0.0.1".to_string()]
    );
    assert_eq!(
        seen.host().as_deref(),
        Some(mock.addr().to_string().as_str())
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn routes_select_upstreams_by_prefix_with_and_without_stripping() {
    let default = MockUpstream::start().await;
    let other = MockUpstream::start().await;
    let toml = format!(
        "{}\n\
         [[routes]]\nprefix = \"/anthropic\"\nbase_url = \"{o}\"\nstrip_prefix = true\n\n\
         [[routes]]\nprefix = \"/keep\"\nbase_url = \"{o}\"\nstrip_prefix = false\n\n\
         [[routes]]\nprefix = \"/based\"\nbase_url = \"{o}/base\"\n",
        upstream_toml(&default.url()),
        o = other.url()
    );
    let proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();
    let chat = json!({"model": "claude-3-5-haiku", "max_tokens": 16,
                      "messages": [{"role": "user", "content": "hi"}]});

    let response = client
        .post_json(&proxy.url("/anthropic/v1/messages?beta=true"), &chat)
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let _ = body_bytes(response).await;
    let seen = other.last_request();
    assert_eq!(seen.path_and_query, "/v1/messages?beta=true");
    assert_eq!(
        seen.host().as_deref(),
        Some(other.addr().to_string().as_str())
    );
    assert_eq!(seen.body, Bytes::from(chat.to_string()));

    let response = client.get(&proxy.url("/keep/v1/models")).await;
    let _ = body_bytes(response).await;
    assert_eq!(other.last_request().path_and_query, "/keep/v1/models");

    let response = client.get(&proxy.url("/based/v1/models?x=1")).await;
    let _ = body_bytes(response).await;
    assert_eq!(other.last_request().path_and_query, "/base/v1/models?x=1");

    let response = client.get(&proxy.url("/v1/models")).await;
    let _ = body_bytes(response).await;
    assert_eq!(default.last_request().path_and_query, "/v1/models");
    assert_eq!(
        default.request_count(),
        1,
        "only the unrouted request hit the default"
    );
    assert_eq!(other.request_count(), 3);
    proxy.shutdown().await;
}

#[tokio::test]
async fn upstream_base_url_path_is_prepended() {
    let mock = MockUpstream::start().await;
    let proxy = TestProxy::start(&upstream_toml(&format!("{}/api/openai", mock.url()))).await;
    let client = TestClient::http1();
    let response = client.get(&proxy.url("/v1/models?limit=2")).await;
    assert_eq!(response.status(), StatusCode::OK);
    let _ = body_bytes(response).await;
    assert_eq!(
        mock.last_request().path_and_query,
        "/api/openai/v1/models?limit=2"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn upstream_statuses_and_bodies_pass_through_unchanged() {
    let (mock, proxy, client) = setup().await;
    let body = json!({"error": {"message": "Rate limit reached", "type": "rate_limit_error"}});
    mock.push(Reply::json(429, &body).with_header("retry-after", "3"));
    let response = client.get(&proxy.url("/v1/models")).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()["retry-after"], "3");
    assert_eq!(body_bytes(response).await, Bytes::from(body.to_string()));
    proxy.shutdown().await;
}

#[tokio::test]
async fn admin_endpoints_and_exact_request_counters() {
    let (mock, proxy, client) = setup().await;
    let (status, _) = client.get_text(&proxy.admin_url("/livez")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, text) = client.get_text(&proxy.admin_url("/readyz")).await;
    assert_eq!(status, StatusCode::OK);
    let ready: serde_json::Value = serde_json::from_str(&text).expect("readyz JSON");
    assert_eq!(ready["store"], "memory", "{text}");
    let metrics = proxy.metrics().await;
    assert!(metrics.contains("compactor_build_info"), "{metrics}");
    assert_eq!(
        proxy
            .metric(
                "compactor_build_info",
                &[("version", env!("CARGO_PKG_VERSION"))]
            )
            .await,
        Some(1.0)
    );

    const N: usize = 7;
    for _ in 0..N {
        let response = client.get(&proxy.url("/v1/models")).await;
        assert_eq!(response.status(), StatusCode::OK);
        let _ = body_bytes(response).await;
    }
    let other_get_2xx = [
        ("route", "other"),
        ("method", "GET"),
        ("status_class", "2xx"),
    ];
    proxy
        .wait_metric("compactor_requests_total", &other_get_2xx, N as f64)
        .await;
    let response = client
        .post_json(
            &proxy.url("/v1/chat/completions"),
            &json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    let _ = body_bytes(response).await;
    proxy
        .wait_metric(
            "compactor_requests_total",
            &[
                ("route", "chat_completions"),
                ("method", "POST"),
                ("status_class", "2xx"),
            ],
            1.0,
        )
        .await;
    proxy
        .wait_metric("compactor_in_flight_requests", &[], 0.0)
        .await;
    // Still exactly N: admin traffic and the chat call are not counted as `other GET`.
    assert_eq!(
        proxy
            .metric("compactor_requests_total", &other_get_2xx)
            .await,
        Some(N as f64)
    );
    assert_eq!(
        proxy
            .metric(
                "compactor_request_duration_seconds_count",
                &[("route", "other")]
            )
            .await,
        Some(N as f64)
    );
    assert_eq!(
        proxy
            .metric("compactor_upstream_ttfb_seconds_count", &[])
            .await,
        Some((N + 1) as f64)
    );
    assert_eq!(mock.request_count(), N + 1);
    proxy.shutdown().await;
}
