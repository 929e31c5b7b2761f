//! A real HTTP client for tests: hyper-util's pooled client (HTTP/1.1, HTTP/2 prior knowledge,
//! or rustls trusting the test CA), a raw single-connection HTTP/1.1 client for tests that
//! must control the socket, and body / SSE readers.

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::client::conn::http1;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::tls::TestPki;
use super::within;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The request body type every test client sends.
pub type ClientBody = BoxBody<Bytes, BoxError>;

/// A complete request body.
pub fn full_body(bytes: impl Into<Bytes>) -> ClientBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// An empty request body.
pub fn empty_body() -> ClientBody {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed()
}

/// Sends the chunks of a streamed request body; dropping it ends the body.
pub struct ClientBodySender {
    tx: mpsc::Sender<Bytes>,
}

impl ClientBodySender {
    /// Sends one chunk; false once the body was dropped.
    pub async fn send(&self, chunk: impl Into<Bytes>) -> bool {
        self.tx.send(chunk.into()).await.is_ok()
    }
}

struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// A request body streamed chunk by chunk from the returned sender.
pub fn channel_body() -> (ClientBodySender, ClientBody) {
    let (tx, rx) = mpsc::channel(1);
    (ClientBodySender { tx }, ChannelBody { rx }.boxed())
}

enum Inner {
    Http(Client<HttpConnector, ClientBody>),
    Https(Client<HttpsConnector<HttpConnector>, ClientBody>),
}

/// A pooled hyper-util client.
pub struct TestClient {
    inner: Inner,
}

fn connector() -> HttpConnector {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c.enforce_http(false);
    c
}

impl Default for TestClient {
    fn default() -> Self {
        TestClient::http1()
    }
}

impl TestClient {
    /// HTTP/1.1 over cleartext.
    pub fn http1() -> TestClient {
        TestClient {
            inner: Inner::Http(
                Client::builder(TokioExecutor::new())
                    .pool_max_idle_per_host(64)
                    .build(connector()),
            ),
        }
    }

    /// HTTP/2 with prior knowledge over cleartext (h2c).
    pub fn h2c() -> TestClient {
        TestClient {
            inner: Inner::Http(
                Client::builder(TokioExecutor::new())
                    .http2_only(true)
                    .build(connector()),
            ),
        }
    }

    /// HTTPS trusting only the test CA of `pki`; HTTP/1.1 or HTTP/2 as negotiated by ALPN.
    pub fn https(pki: &TestPki) -> TestClient {
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(pki.client_config())
            .https_only()
            .enable_all_versions()
            .wrap_connector(connector());
        TestClient {
            inner: Inner::Https(Client::builder(TokioExecutor::new()).build(https)),
        }
    }

    /// Sends a request (no timeout).
    pub async fn try_send(
        &self,
        req: Request<ClientBody>,
    ) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
        match &self.inner {
            Inner::Http(c) => c.request(req).await,
            Inner::Https(c) => c.request(req).await,
        }
    }

    /// Sends a request; panics on a transport error or after the test timeout.
    pub async fn send(&self, req: Request<ClientBody>) -> Response<Incoming> {
        let what = format!("response head of {} {}", req.method(), req.uri());
        within(&what, self.try_send(req))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:?}"))
    }

    /// Builds and sends a request with the given headers and body.
    pub async fn request(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Response<Incoming> {
        let mut builder = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        self.send(builder.body(full_body(body)).expect("valid request"))
            .await
    }

    /// Sends a request and reads the whole response: what most tests compare.
    pub async fn exchange(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Exchange {
        let response = self.request(method, url, headers, body).await;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        Exchange {
            status,
            headers,
            body: body_bytes(response).await,
        }
    }

    /// `GET url`.
    pub async fn get(&self, url: &str) -> Response<Incoming> {
        self.request("GET", url, &[], Bytes::new()).await
    }

    /// `GET url`, returning status and body text.
    pub async fn get_text(&self, url: &str) -> (http::StatusCode, String) {
        let response = self.get(url).await;
        let status = response.status();
        let body = body_bytes(response).await;
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    /// `POST url` with a JSON body.
    pub async fn post_json(&self, url: &str, body: &serde_json::Value) -> Response<Incoming> {
        self.request(
            "POST",
            url,
            &[("content-type", "application/json")],
            body.to_string(),
        )
        .await
    }
}

/// One request's response as the client saw it, body read whole.
pub struct Exchange {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Exchange {
    /// A response header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as JSON; panics with the body text when it is not.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    /// `x-compactor-compaction-num`, when present.
    pub fn compaction_num(&self) -> Option<u32> {
        self.header("x-compactor-compaction-num")
            .map(|v| v.parse().expect("numeric compaction number"))
    }
}

/// Reads a whole response body (bounded by the test timeout).
pub async fn body_bytes(response: Response<Incoming>) -> Bytes {
    within("response body", response.into_body().collect())
        .await
        .expect("response body read")
        .to_bytes()
}

/// One HTTP/1.1 connection the test owns: dropping the `SendRequest` and aborting the returned
/// task closes the socket, like a client that goes away.
pub async fn raw_http1(addr: SocketAddr) -> (http1::SendRequest<ClientBody>, JoinHandle<()>) {
    let stream = within("tcp connect", tokio::net::TcpStream::connect(addr))
        .await
        .expect("connect");
    let _ = stream.set_nodelay(true);
    let (sender, conn) = http1::handshake(TokioIo::new(stream))
        .await
        .expect("http1 handshake");
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    (sender, task)
}

/// Reads a `text/event-stream` body event by event, however the bytes were chunked.
pub struct SseReader {
    body: Incoming,
    buf: Vec<u8>,
    done: bool,
}

impl SseReader {
    /// Wraps a response body.
    pub fn new(response: Response<Incoming>) -> SseReader {
        SseReader {
            body: response.into_body(),
            buf: Vec::new(),
            done: false,
        }
    }

    /// The next raw event (text before the blank line), or `None` at the end of the body.
    /// Panics on a body error or after the test timeout.
    pub async fn next_event(&mut self) -> Option<String> {
        loop {
            if let Some(pos) = find_blank_line(&self.buf) {
                let event: Vec<u8> = self.buf.drain(..pos.0).collect();
                self.buf.drain(..pos.1 - pos.0);
                return Some(String::from_utf8_lossy(&event).into_owned());
            }
            if self.done {
                assert!(
                    self.buf.is_empty(),
                    "stream ended mid-event: {:?}",
                    String::from_utf8_lossy(&self.buf)
                );
                return None;
            }
            match within("next SSE frame", self.body.frame()).await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => panic!("SSE body error: {e:?}"),
                None => self.done = true,
            }
        }
    }

    /// The `data:` payload of the next event (lines joined with `\n`), skipping comment-only
    /// events; `None` at the end of the body.
    pub async fn next_data(&mut self) -> Option<String> {
        loop {
            let event = self.next_event().await?;
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                return Some(data.join("\n"));
            }
        }
    }

    /// Every remaining `data:` payload until the end of the body.
    pub async fn rest(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(d) = self.next_data().await {
            out.push(d);
        }
        out
    }
}

/// `(start, end)` of the first blank line (`\n\n` or `\r\n\r\n`).
fn find_blank_line(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|p| (p, p + 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, p + 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}
