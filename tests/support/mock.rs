//! A scriptable mock upstream: hyper 1 (HTTP/1.1 and HTTP/2, cleartext or rustls) on
//! `127.0.0.1:0`, recording every request and answering from a queue of [`Reply`] scripts,
//! then from a handler, then with `200 {"ok":true}`.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::tls::TestPki;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Chooses a reply for requests that found the script queue empty.
pub type Handler = Arc<dyn Fn(&Recorded) -> Reply + Send + Sync>;

/// One request as the upstream received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The method.
    pub method: Method,
    /// Path and query, e.g. `/v1/models?limit=2`.
    pub path_and_query: String,
    /// The full request URI as hyper parsed it (HTTP/2 carries scheme + authority here).
    pub uri: http::Uri,
    /// HTTP version of the upstream connection.
    pub version: Version,
    /// Headers as received.
    pub headers: HeaderMap,
    /// The whole body (empty when recording is off, or for `EchoStream` until it ends).
    pub body: Bytes,
}

impl Recorded {
    /// The value of one header as a string (`None` when absent or not UTF-8).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Every value of one header.
    pub fn header_all(&self, name: &str) -> Vec<String> {
        self.headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok().map(str::to_owned))
            .collect()
    }

    /// The request's authority: the `Host` header, or the URI authority (HTTP/2).
    pub fn host(&self) -> Option<String> {
        self.header("host")
            .map(str::to_owned)
            .or_else(|| self.uri.authority().map(|a| a.to_string()))
    }

    /// The path without the query.
    pub fn path(&self) -> &str {
        self.uri.path()
    }
}

/// What the mock does with one request.
pub enum Reply {
    /// A complete response.
    Full {
        /// Status code.
        status: u16,
        /// Extra headers, in order.
        headers: Vec<(String, String)>,
        /// Body.
        body: Bytes,
    },
    /// A response whose body is written as these separate chunks, immediately.
    Chunks {
        /// Status code.
        status: u16,
        /// Extra headers.
        headers: Vec<(String, String)>,
        /// Body chunks, each written as its own frame.
        chunks: Vec<Bytes>,
    },
    /// A response whose body chunks the test sends through a [`StreamSender`]; the body ends
    /// when the sender is dropped.
    Stream {
        /// Status code.
        status: u16,
        /// Extra headers.
        headers: Vec<(String, String)>,
        /// Where the chunks come from.
        rx: mpsc::Receiver<Bytes>,
    },
    /// A response head and these chunks, then the connection is dropped mid-body.
    ResetAfter {
        /// Status code.
        status: u16,
        /// Extra headers.
        headers: Vec<(String, String)>,
        /// Body chunks written before the reset.
        chunks: Vec<Bytes>,
    },
    /// A response head and these chunks, then nothing more, ever.
    StallAfter {
        /// Status code.
        status: u16,
        /// Extra headers.
        headers: Vec<(String, String)>,
        /// Body chunks written before the stall.
        chunks: Vec<Bytes>,
    },
    /// Read the request, then never send a response head.
    Stall,
    /// Read the request, then drop the connection without a response.
    Reset,
    /// `200`, the request body back, with `x-echo-method` and `x-echo-uri` headers.
    Echo,
    /// `200` sent at once, then each request body frame echoed as soon as it arrives.
    EchoStream,
}

impl Reply {
    /// A JSON response.
    pub fn json(status: u16, value: &serde_json::Value) -> Reply {
        Reply::Full {
            status,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Bytes::from(value.to_string()),
        }
    }

    /// A response with this status and a small JSON error body.
    pub fn status(status: u16) -> Reply {
        Reply::json(
            status,
            &serde_json::json!({"error": {"message": "mock failure", "type": "mock", "code": status}}),
        )
    }

    /// A response with an arbitrary body and content type.
    pub fn bytes(status: u16, content_type: &str, body: impl Into<Bytes>) -> Reply {
        Reply::Full {
            status,
            headers: vec![("content-type".into(), content_type.into())],
            body: body.into(),
        }
    }

    /// An SSE response (`text/event-stream`) with these `data:` events written immediately.
    pub fn sse<S: AsRef<str>>(events: &[S]) -> Reply {
        Reply::Chunks {
            status: 200,
            headers: sse_headers(),
            chunks: events
                .iter()
                .map(|e| Bytes::from(sse_event(e.as_ref())))
                .collect(),
        }
    }

    /// An SSE response whose events the test writes, one at a time, through the returned
    /// sender. Channel capacity is 1, so the test decides exactly when each event leaves.
    pub fn sse_channel() -> (Reply, StreamSender) {
        let (reply, tx) = Reply::stream_channel(200, sse_headers());
        (reply, tx)
    }

    /// A streamed response with arbitrary status and headers, fed through the sender.
    pub fn stream_channel(status: u16, headers: Vec<(String, String)>) -> (Reply, StreamSender) {
        let (tx, rx) = mpsc::channel(1);
        (
            Reply::Stream {
                status,
                headers,
                rx,
            },
            StreamSender { tx },
        )
    }

    /// Adds a response header (no effect on `Stall`, `Reset`, `Echo`, `EchoStream`).
    pub fn with_header(mut self, name: &str, value: &str) -> Reply {
        match &mut self {
            Reply::Full { headers, .. }
            | Reply::Chunks { headers, .. }
            | Reply::Stream { headers, .. } => headers.push((name.into(), value.into())),
            _ => {}
        }
        self
    }
}

fn sse_headers() -> Vec<(String, String)> {
    vec![
        ("content-type".into(), "text/event-stream".into()),
        ("cache-control".into(), "no-cache".into()),
    ]
}

/// One SSE frame: `data: <data>\n\n`.
pub fn sse_event(data: &str) -> String {
    format!("data: {data}\n\n")
}

/// The receiving side of the response went away (client or proxy dropped the stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

/// Test-side handle of a [`Reply::Stream`] body.
pub struct StreamSender {
    tx: mpsc::Sender<Bytes>,
}

impl StreamSender {
    /// Writes one chunk; `Err(Closed)` once the response body was dropped (connection gone).
    pub async fn send(&self, chunk: impl Into<Bytes>) -> Result<(), Closed> {
        self.tx.send(chunk.into()).await.map_err(|_| Closed)
    }

    /// Writes one SSE `data:` event.
    pub async fn event(&self, data: &str) -> Result<(), Closed> {
        self.send(sse_event(data)).await
    }

    /// Resolves when the response body has been dropped by the mock's HTTP server, i.e. the
    /// downstream side (the proxy) closed the stream or the connection.
    pub async fn closed(&self) {
        self.tx.closed().await
    }

    /// Ends the body cleanly.
    pub fn finish(self) {}
}

struct State {
    requests: Mutex<Vec<Recorded>>,
    replies: Mutex<VecDeque<Reply>>,
    handler: Mutex<Option<Handler>>,
    record: AtomicBool,
    seen: watch::Sender<usize>,
    /// How long the handler's replies wait before they are sent (a model's latency).
    latency: Mutex<std::time::Duration>,
}

/// The mock upstream. Dropping it stops accepting; open connections live on until the runtime
/// ends.
pub struct MockUpstream {
    addr: SocketAddr,
    tls: bool,
    state: Arc<State>,
    accept: JoinHandle<()>,
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl MockUpstream {
    /// A cleartext mock (HTTP/1.1 and HTTP/2 prior knowledge).
    pub async fn start() -> MockUpstream {
        Self::start_inner(None).await
    }

    /// A TLS mock using the server certificate of `pki` (ALPN `h2`, `http/1.1`).
    pub async fn start_tls(pki: &TestPki) -> MockUpstream {
        Self::start_inner(Some(tokio_rustls::TlsAcceptor::from(Arc::new(
            pki.server_config(),
        ))))
        .await
    }

    async fn start_inner(tls: Option<tokio_rustls::TlsAcceptor>) -> MockUpstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("mock upstream bind");
        let addr = listener.local_addr().expect("mock local addr");
        let state = Arc::new(State {
            requests: Mutex::new(Vec::new()),
            replies: Mutex::new(VecDeque::new()),
            handler: Mutex::new(None),
            record: AtomicBool::new(true),
            seen: watch::channel(0).0,
            latency: Mutex::default(),
        });
        let is_tls = tls.is_some();
        let accept_state = state.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let state = accept_state.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| handle(state.clone(), req));
                    let builder = auto::Builder::new(TokioExecutor::new());
                    match tls {
                        None => {
                            let _ = builder
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        }
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                let _ = builder
                                    .serve_connection(TokioIo::new(stream), service)
                                    .await;
                            }
                        }
                    }
                });
            }
        });
        MockUpstream {
            addr,
            tls: is_tls,
            state,
            accept,
        }
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT` (or `https://…`), no trailing slash.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Queues a reply; queued replies are used in order, one per request.
    pub fn push(&self, reply: Reply) {
        self.state
            .replies
            .lock()
            .expect("replies lock")
            .push_back(reply);
    }

    /// Sets the handler consulted when the queue is empty.
    pub fn set_handler(&self, handler: impl Fn(&Recorded) -> Reply + Send + Sync + 'static) {
        *self.state.handler.lock().expect("handler lock") = Some(Arc::new(handler));
    }

    /// Makes every reply of the handler wait `latency` before it is sent, as a model takes
    /// time to answer.
    pub fn set_latency(&self, latency: std::time::Duration) {
        *self.state.latency.lock().expect("latency lock") = latency;
    }

    /// Turns request recording on or off (off keeps memory flat under load).
    pub fn set_recording(&self, on: bool) {
        self.state.record.store(on, Ordering::SeqCst);
    }

    /// Every recorded request so far, in arrival order (of complete bodies).
    pub fn requests(&self) -> Vec<Recorded> {
        self.state.requests.lock().expect("requests lock").clone()
    }

    /// How many requests have arrived (counted even when recording is off).
    pub fn request_count(&self) -> usize {
        *self.state.seen.borrow()
    }

    /// The most recent recorded request; panics when there is none.
    pub fn last_request(&self) -> Recorded {
        self.requests()
            .pop()
            .expect("the mock upstream received no request")
    }

    /// Waits (bounded) until at least `n` requests have arrived, then returns the recorded ones.
    pub async fn wait_for_requests(&self, n: usize) -> Vec<Recorded> {
        let mut rx = self.state.seen.subscribe();
        super::within(
            &format!("{n} upstream request(s)"),
            rx.wait_for(|c| *c >= n),
        )
        .await
        .expect("mock state alive");
        self.requests()
    }
}

fn next_reply(state: &State, recorded: &Recorded) -> Reply {
    if let Some(r) = state.replies.lock().expect("replies lock").pop_front() {
        return r;
    }
    let handler = state.handler.lock().expect("handler lock").clone();
    match handler {
        Some(h) => h(recorded),
        None => Reply::json(200, &serde_json::json!({"ok": true})),
    }
}

fn record(state: &State, recorded: &Recorded) {
    if state.record.load(Ordering::SeqCst) {
        state
            .requests
            .lock()
            .expect("requests lock")
            .push(recorded.clone());
    }
    state.seen.send_modify(|c| *c += 1);
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<MockBody>, BoxError> {
    let (parts, body) = req.into_parts();
    let mut recorded = Recorded {
        method: parts.method,
        path_and_query: parts
            .uri
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_else(|| "/".into()),
        uri: parts.uri,
        version: parts.version,
        headers: parts.headers,
        body: Bytes::new(),
    };

    // Peek at the queue: `EchoStream` must not read the body first.
    let echo_stream = matches!(
        state.replies.lock().expect("replies lock").front(),
        Some(Reply::EchoStream)
    );
    if echo_stream {
        state.replies.lock().expect("replies lock").pop_front();
        let response = Response::builder()
            .status(200)
            .header("content-type", "application/octet-stream")
            .body(MockBody::EchoStream(Box::new(EchoState {
                incoming: body,
                seen: Vec::new(),
                recorded: Some(recorded),
                state,
            })))?;
        return Ok(response);
    }

    recorded.body = body.collect().await?.to_bytes();
    record(&state, &recorded);
    let latency = *state.latency.lock().expect("latency lock");
    let reply = next_reply(&state, &recorded);
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let (status, headers, body) = match reply {
        Reply::Full {
            status,
            headers,
            body,
        } => (status, headers, MockBody::Full(Some(body))),
        Reply::Chunks {
            status,
            headers,
            chunks,
        } => (status, headers, MockBody::Chunks(chunks.into())),
        Reply::Stream {
            status,
            headers,
            rx,
        } => (status, headers, MockBody::Channel(rx)),
        Reply::ResetAfter {
            status,
            headers,
            chunks,
        } => (
            status,
            headers,
            MockBody::Then(chunks.into(), Ending::Reset(None)),
        ),
        Reply::StallAfter {
            status,
            headers,
            chunks,
        } => (
            status,
            headers,
            MockBody::Then(chunks.into(), Ending::Stall),
        ),
        Reply::Stall => {
            std::future::pending::<()>().await;
            unreachable!("pending never resolves")
        }
        Reply::Reset => return Err("mock reset: closing the connection".into()),
        Reply::Echo => {
            let content_type = recorded
                .header("content-type")
                .unwrap_or("application/octet-stream")
                .to_owned();
            (
                200,
                vec![
                    ("content-type".into(), content_type),
                    ("x-echo-method".into(), recorded.method.to_string()),
                    ("x-echo-uri".into(), recorded.path_and_query.clone()),
                ],
                MockBody::Full(Some(recorded.body.clone())),
            )
        }
        Reply::EchoStream => {
            // Only reachable from a handler, after the body was read: echo it whole.
            (200, Vec::new(), MockBody::Full(Some(recorded.body.clone())))
        }
    };
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::from_u16(status)?;
    for (name, value) in headers {
        response.headers_mut().append(
            HeaderName::from_bytes(name.as_bytes())?,
            HeaderValue::from_str(&value)?,
        );
    }
    Ok(response)
}

/// Response bodies the mock can produce.
enum MockBody {
    /// One frame (or none when empty).
    Full(Option<Bytes>),
    /// Several frames, written back to back.
    Chunks(VecDeque<Bytes>),
    /// Frames supplied by the test; ends when the sender is dropped.
    Channel(mpsc::Receiver<Bytes>),
    /// The request body, frame by frame; the request is recorded when it ends.
    EchoStream(Box<EchoState>),
    /// Frames, then a reset or a stall.
    Then(VecDeque<Bytes>, Ending),
}

/// How a [`MockBody::Then`] ends.
enum Ending {
    /// After a pause (so the frames before it leave the socket, as they would from a real
    /// server that breaks down a moment later), an error that drops the connection.
    Reset(Option<Pin<Box<tokio::time::Sleep>>>),
    Stall,
}

struct EchoState {
    /// The request body being echoed.
    incoming: Incoming,
    /// Everything echoed so far.
    seen: Vec<u8>,
    /// Recorded once the request body ends.
    recorded: Option<Recorded>,
    /// Where to record it.
    state: Arc<State>,
}

impl Body for MockBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            MockBody::Full(b) => Poll::Ready(
                b.take()
                    .filter(|b| !b.is_empty())
                    .map(|b| Ok(Frame::data(b))),
            ),
            MockBody::Chunks(q) => Poll::Ready(q.pop_front().map(|b| Ok(Frame::data(b)))),
            MockBody::Then(q, ending) => match (q.pop_front(), ending) {
                (Some(b), _) => Poll::Ready(Some(Ok(Frame::data(b)))),
                (None, Ending::Reset(pause)) => {
                    let pause = pause.get_or_insert_with(|| {
                        Box::pin(tokio::time::sleep(std::time::Duration::from_millis(50)))
                    });
                    match std::future::Future::poll(pause.as_mut(), cx) {
                        Poll::Ready(()) => Poll::Ready(Some(Err("mock reset mid-body".into()))),
                        Poll::Pending => Poll::Pending,
                    }
                }
                (None, Ending::Stall) => Poll::Pending,
            },
            MockBody::Channel(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
            MockBody::EchoStream(echo) => loop {
                let EchoState {
                    incoming,
                    seen,
                    recorded,
                    state,
                } = &mut **echo;
                match Pin::new(&mut *incoming).poll_frame(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        Ok(data) => {
                            seen.extend_from_slice(&data);
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                        Err(_trailers) => continue,
                    },
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
                    Poll::Ready(None) => {
                        if let Some(mut r) = recorded.take() {
                            r.body = Bytes::from(std::mem::take(seen));
                            record(state, &r);
                        }
                        return Poll::Ready(None);
                    }
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            MockBody::Full(b) => match b {
                Some(b) => b.is_empty(),
                None => true,
            },
            MockBody::Chunks(q) => q.is_empty(),
            _ => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            MockBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            MockBody::Chunks(q) if q.is_empty() => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}
