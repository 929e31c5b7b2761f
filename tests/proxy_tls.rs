//! Transports: an `https` upstream behind a private CA (`upstream.ca_file`), inbound TLS
//! (`server.tls_cert` / `server.tls_key`), and HTTP/2 cleartext with prior knowledge.

mod support;

use bytes::Bytes;
use http::{StatusCode, Version};
use serde_json::json;
use support::{
    body_bytes, upstream_toml, MockUpstream, Reply, SseReader, TestClient, TestPki, TestProxy,
};

fn toml_path(p: &std::path::Path) -> String {
    p.display().to_string().replace('\\', "\\\\")
}

#[tokio::test]
async fn https_upstream_signed_by_a_trusted_extra_ca() {
    let pki = TestPki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, _, _) = pki.write_to(dir.path());
    let mock = MockUpstream::start_tls(&pki).await;
    assert!(mock.url().starts_with("https://127.0.0.1:"));
    let toml = format!(
        "{}ca_file = \"{}\"\n",
        upstream_toml(&mock.url()),
        toml_path(&ca)
    );
    let proxy = TestProxy::start(&toml).await;
    let client = TestClient::http1();

    let response = client.get(&proxy.url("/v1/models")).await;
    assert_eq!(response.status(), StatusCode::OK);
    let _ = body_bytes(response).await;
    let seen = mock.last_request();
    assert_eq!(seen.path(), "/v1/models");
    assert_eq!(
        seen.host().as_deref(),
        Some(mock.addr().to_string().as_str())
    );

    let chat = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]});
    mock.push(Reply::sse(&["{\"n\":1}", "[DONE]"]));
    let response = client
        .post_json(&proxy.url("/v1/chat/completions"), &chat)
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut reader = SseReader::new(response);
    assert_eq!(reader.rest().await, vec!["{\"n\":1}", "[DONE]"]);
    assert_eq!(mock.last_request().body, Bytes::from(chat.to_string()));
    proxy.shutdown().await;
}

#[tokio::test]
async fn https_upstream_with_an_untrusted_certificate_is_502() {
    let pki = TestPki::new();
    let mock = MockUpstream::start_tls(&pki).await;
    let proxy = TestProxy::start(&upstream_toml(&mock.url())).await;
    let client = TestClient::http1();
    let response = client.get(&proxy.url("/v1/models")).await;
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
    let _ = body_bytes(response).await;
    assert_eq!(
        mock.request_count(),
        0,
        "no request over an untrusted TLS session"
    );
    proxy.shutdown().await;
}

async fn tls_proxy(pki: &TestPki, dir: &std::path::Path, mock: &MockUpstream) -> TestProxy {
    let (_, cert, key) = pki.write_to(dir);
    let toml = format!(
        "[server]\ntls_cert = \"{}\"\ntls_key = \"{}\"\n\n{}",
        toml_path(&cert),
        toml_path(&key),
        upstream_toml(&mock.url())
    );
    TestProxy::start(&toml).await
}

#[tokio::test]
async fn inbound_tls_serves_clients_that_trust_the_ca() {
    let pki = TestPki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let mock = MockUpstream::start().await;
    let proxy = tls_proxy(&pki, dir.path(), &mock).await;
    let client = TestClient::https(&pki);

    let response = client.get(&proxy.https_url("/v1/models")).await;
    assert_eq!(response.status(), StatusCode::OK);
    let _ = body_bytes(response).await;
    assert_eq!(mock.last_request().path(), "/v1/models");

    let body = Bytes::from(vec![7u8; 100_000]);
    mock.push(Reply::Echo);
    let response = client
        .request("POST", &proxy.https_url("/v1/files"), &[], body.clone())
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body_bytes(response).await, body);

    // Cleartext to the TLS port gets no HTTP answer.
    let plain = TestClient::http1();
    assert!(plain
        .try_send(
            http::Request::get(proxy.url("/v1/models"))
                .body(support::empty_body())
                .expect("request")
        )
        .await
        .is_err());
    proxy.shutdown().await;
}

#[tokio::test]
async fn inbound_tls_negotiates_http2_by_alpn() {
    let pki = TestPki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let mock = MockUpstream::start().await;
    let proxy = tls_proxy(&pki, dir.path(), &mock).await;
    let client = TestClient::https(&pki);
    let response = client.get(&proxy.https_url("/v1/models")).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.version(), Version::HTTP_2);
    let _ = body_bytes(response).await;
    proxy.shutdown().await;
}

#[tokio::test]
async fn http2_cleartext_prior_knowledge_is_served() {
    let mock = MockUpstream::start().await;
    let proxy = TestProxy::start(&upstream_toml(&mock.url())).await;
    let client = TestClient::h2c();

    let response = client.get(&proxy.url("/v1/models?limit=1")).await;
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::OK);
    let _ = body_bytes(response).await;
    let seen = mock.last_request();
    assert_eq!(seen.path_and_query, "/v1/models?limit=1");
    assert_eq!(
        seen.host().as_deref(),
        Some(mock.addr().to_string().as_str())
    );

    // A streamed chat response over h2.
    let (reply, sse) = Reply::sse_channel();
    mock.push(reply);
    let chat = json!({"model": "gpt-4o-mini", "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]});
    // The head of a chat stream comes with its first content event (compactor holds it until
    // then, in case the provider refuses the request for its length first).
    let url = proxy.url("/v1/chat/completions");
    let (response, sent) = tokio::join!(client.post_json(&url, &chat), sse.event("a"));
    sent.expect("open");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.version(), Version::HTTP_2);
    let mut reader = SseReader::new(response);
    assert_eq!(reader.next_data().await.as_deref(), Some("a"));
    sse.event("b").await.expect("open");
    assert_eq!(reader.next_data().await.as_deref(), Some("b"));
    sse.finish();
    assert_eq!(reader.next_event().await, None);
    assert_eq!(mock.last_request().body, Bytes::from(chat.to_string()));

    // A large body over h2 (flow control windows).
    let big = Bytes::from(support::pseudo_random_bytes(1024 * 1024, 3));
    mock.push(Reply::Echo);
    let response = client
        .request("POST", &proxy.url("/v1/embeddings"), &[], big.clone())
        .await;
    assert_eq!(body_bytes(response).await, big);
    proxy.shutdown().await;
}
