//! Connection upgrades (WebSocket) through the real proxy: an upgrade the upstream accepts is
//! tunnelled byte for byte both ways, with the client's credentials and upgrade headers sent
//! on; one it refuses comes back as it was answered; shutdown closes an open tunnel.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::{upstream_toml, within, TestProxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A WebSocket-speaking upstream in miniature: it records each request head; it refuses any
/// request to `/v1/refuse` (`403`), answers a plain request `200`, and an upgrade `101`, then
/// echoes every byte back.
struct EchoUpstream {
    addr: std::net::SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
}

impl EchoUpstream {
    async fn start() -> EchoUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = heads.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let head = read_head(&mut stream).await;
                    let upgrade = head.to_ascii_lowercase().contains("\r\nupgrade: websocket");
                    seen.lock().expect("lock").push(head.clone());
                    if head.starts_with("GET /v1/refuse") {
                        let _ = stream
                            .write_all(
                                b"HTTP/1.1 403 Forbidden\r\ncontent-length: 9\r\n\r\nforbidden",
                            )
                            .await;
                        return;
                    }
                    if !upgrade {
                        let _ = stream
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nplain")
                            .await;
                        return;
                    }
                    let _ = stream
                        .write_all(
                            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\
                              connection: Upgrade\r\nsec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n",
                        )
                        .await;
                    let mut buf = [0u8; 4096];
                    loop {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                if stream.write_all(&buf[..n]).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        EchoUpstream { addr, heads }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().expect("lock").clone()
    }
}

/// Reads an HTTP head (through the blank line) byte by byte, so nothing after it is consumed.
async fn read_head(stream: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// Opens a WebSocket handshake to `path` through the proxy; returns the stream and the head of
/// the answer.
async fn handshake(proxy: &TestProxy, path: &str, upgrade: bool) -> (TcpStream, String) {
    let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
    let upgrade = if upgrade {
        "Upgrade: websocket\r\nConnection: Upgrade\r\n"
    } else {
        ""
    };
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer sk-ws\r\n{upgrade}\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let head = within("the answer's head", read_head(&mut stream)).await;
    (stream, head)
}

#[tokio::test]
async fn an_upgrade_is_tunnelled_both_ways_and_closed_at_shutdown() {
    let upstream = EchoUpstream::start().await;
    let mut proxy = TestProxy::start(&upstream_toml(&upstream.url())).await;
    let (mut stream, head) = handshake(&proxy, "/v1/responses", true).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("upgrade: websocket"), "{head}");
    assert!(
        lower.contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{head}"
    );

    // What reached the upstream: the upgrade, the key and the credential.
    let sent = upstream.heads();
    assert_eq!(sent.len(), 1);
    let sent = sent[0].to_ascii_lowercase();
    assert!(sent.starts_with("get /v1/responses http/1.1"), "{sent}");
    for header in [
        "upgrade: websocket",
        "connection: upgrade",
        "sec-websocket-key: dghlihnhbxbszsbub25jzq==",
        "authorization: bearer sk-ws",
    ] {
        assert!(sent.contains(header), "{header} missing: {sent}");
    }

    // Bytes both ways, as they are (a WebSocket frame is just bytes to the tunnel).
    for message in [&b"\x81\x05hello"[..], &[0u8, 255, 13, 10, 13, 10][..]] {
        stream.write_all(message).await.expect("write");
        let mut echoed = vec![0u8; message.len()];
        within("the echo", stream.read_exact(&mut echoed))
            .await
            .expect("read");
        assert_eq!(echoed, message);
    }
    proxy
        .wait_metric("compactor_tunnels_total", &[("outcome", "opened")], 1.0)
        .await;
    proxy.wait_metric("compactor_tunnels_open", &[], 1.0).await;

    // Shutdown closes the tunnel: the client reads the end of the stream.
    proxy.trigger_shutdown();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut rest)).await;
    assert!(
        matches!(read, Ok(Ok(_)) | Ok(Err(_))),
        "the tunnel ends at shutdown"
    );
    let task = proxy.take_task();
    within("proxy drain", task)
        .await
        .expect("server task")
        .expect("run");
}

#[tokio::test]
async fn an_upgrade_the_upstream_refuses_comes_back_as_answered_and_plain_requests_stay_plain() {
    let upstream = EchoUpstream::start().await;
    let proxy = TestProxy::start(&upstream_toml(&upstream.url())).await;
    let (mut stream, head) = handshake(&proxy, "/v1/refuse", true).await;
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    let mut body = [0u8; 9];
    within("the refusal's body", stream.read_exact(&mut body))
        .await
        .expect("read");
    assert_eq!(&body, b"forbidden");
    proxy
        .wait_metric("compactor_tunnels_total", &[("outcome", "refused")], 1.0)
        .await;

    // A request without the upgrade headers stays a plain request.
    let (mut stream, head) = handshake(&proxy, "/v1/models", false).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let mut body = [0u8; 5];
    within("the body", stream.read_exact(&mut body))
        .await
        .expect("read");
    assert_eq!(&body, b"plain");
    let sent = upstream.heads();
    assert!(
        !sent[1].to_ascii_lowercase().contains("upgrade:"),
        "a plain request gains no upgrade: {}",
        sent[1]
    );
    assert_eq!(
        proxy
            .metric("compactor_tunnels_total", &[("outcome", "opened")])
            .await,
        Some(0.0)
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn past_the_tunnel_bound_an_upgrade_goes_as_a_plain_request() {
    let upstream = EchoUpstream::start().await;
    // One connection at a time, so one tunnel at a time; an upgraded connection leaves its slot.
    let toml = format!(
        "{}[server]\nmax_connections = 1\n",
        upstream_toml(&upstream.url())
    );
    let proxy = TestProxy::start(&toml).await;
    let (mut open, head) = handshake(&proxy, "/v1/responses", true).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    proxy.wait_metric("compactor_tunnels_open", &[], 1.0).await;

    let (mut second, head) = handshake(&proxy, "/v1/responses", true).await;
    assert!(head.starts_with("HTTP/1.1 200"), "forwarded plain: {head}");
    let mut body = [0u8; 5];
    within("the plain answer", second.read_exact(&mut body))
        .await
        .expect("read");
    assert_eq!(&body, b"plain");
    assert!(
        !upstream.heads()[1]
            .to_ascii_lowercase()
            .contains("upgrade:"),
        "sent without its upgrade: {}",
        upstream.heads()[1]
    );
    assert_eq!(
        proxy
            .metric("compactor_tunnels_total", &[("outcome", "busy")])
            .await,
        Some(1.0)
    );
    // The first tunnel still carries bytes.
    open.write_all(b"still here").await.expect("write");
    let mut echoed = [0u8; 10];
    within("the echo", open.read_exact(&mut echoed))
        .await
        .expect("read");
    assert_eq!(&echoed, b"still here");
    drop(second);
    proxy.shutdown().await;
}

/// An HTTP/2 extended CONNECT (RFC 8441) to `path` through the proxy over h2c; returns the
/// answer (its upgrade still pending) and the connection's task.
async fn h2_websocket(proxy: &TestProxy, path: &str) -> http::Response<hyper::body::Incoming> {
    let stream = TcpStream::connect(proxy.addr).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(connection);
    let request = http::Request::builder()
        .method(http::Method::CONNECT)
        .uri(format!("http://{}{path}", proxy.addr))
        .header("authorization", "Bearer sk-ws")
        .header("sec-websocket-version", "13")
        .extension(hyper::ext::Protocol::from_static("websocket"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    within("the CONNECT's answer", sender.send_request(request))
        .await
        .expect("answer")
}

#[tokio::test]
async fn an_http2_websocket_goes_upstream_as_an_http1_upgrade_and_is_tunnelled() {
    let upstream = EchoUpstream::start().await;
    let proxy = TestProxy::start(&upstream_toml(&upstream.url())).await;
    let answer = h2_websocket(&proxy, "/v1/responses").await;
    assert_eq!(answer.status(), 200, "the stream opens: {answer:?}");
    assert!(
        answer.headers().get("sec-websocket-accept").is_none(),
        "the HTTP/1.1 handshake's proof stays behind"
    );

    // Upstream: the HTTP/1.1 handshake, with a fresh key, the version and the credential.
    let sent = upstream.heads();
    assert_eq!(sent.len(), 1);
    let sent = sent[0].to_ascii_lowercase();
    assert!(sent.starts_with("get /v1/responses http/1.1"), "{sent}");
    for header in [
        "upgrade: websocket",
        "connection: upgrade",
        "sec-websocket-version: 13",
        "authorization: bearer sk-ws",
    ] {
        assert!(sent.contains(header), "{header} missing: {sent}");
    }
    let key = sent
        .lines()
        .find_map(|l| l.strip_prefix("sec-websocket-key: "))
        .unwrap_or_else(|| panic!("a key: {sent}"));
    assert_eq!(key.trim().len(), 24, "16 bytes, base64: {key}");

    // Bytes both ways through the HTTP/2 stream.
    let upgraded = within("the upgrade", hyper::upgrade::on(answer))
        .await
        .expect("upgraded");
    let mut io = hyper_util::rt::TokioIo::new(upgraded);
    for message in [&b"\x81\x05hello"[..], &[0u8, 255, 13, 10, 13, 10][..]] {
        io.write_all(message).await.expect("write");
        let mut echoed = vec![0u8; message.len()];
        within("the echo", io.read_exact(&mut echoed))
            .await
            .expect("read");
        assert_eq!(echoed, message);
    }
    assert_eq!(
        proxy
            .metric("compactor_tunnels_total", &[("outcome", "opened")])
            .await,
        Some(1.0)
    );

    // A CONNECT the upstream refuses comes back as answered.
    let refused = h2_websocket(&proxy, "/v1/refuse").await;
    assert_eq!(refused.status(), 403);
    proxy.shutdown().await;
}
