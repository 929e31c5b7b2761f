//! Test helpers for summarizer plugins that call a provider over HTTP: a mock provider on a
//! real `127.0.0.1:0` socket that records every request and answers from a script, and a
//! [`Caller`] builder. The `openai` and `anthropic` backends test against it; a plugin author
//! can too (as a dev-dependency). [`rules`] holds the request rules real providers enforce,
//! which compactor's own tests check every rewrite against.
#![deny(missing_docs)]

pub mod rules;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpListener;

use compactor_plugin_api::Caller;

/// One request the mock received.
#[derive(Debug, Clone)]
pub struct Received {
    /// The request path.
    pub path: String,
    /// The request headers.
    pub headers: http::HeaderMap,
    /// The body as JSON (`Null` when it is not JSON).
    pub body: Value,
}

impl Received {
    /// A header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// How the mock answers one request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// This status with a JSON body.
    Json(u16, Value),
    /// This status with a raw body (for malformed answers).
    Text(u16, &'static str),
    /// Never answer (for timeouts).
    Hang,
}

/// A mock provider: records every request, answers the n-th with the n-th scripted reply.
pub struct MockProvider {
    addr: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
}

impl MockProvider {
    /// Starts serving HTTP/1.1 on `127.0.0.1:0`; request `n` gets `replies[n]`, and the last
    /// reply repeats.
    ///
    /// # Panics
    /// When `replies` is empty or no port can be bound.
    pub async fn start(replies: Vec<Reply>) -> MockProvider {
        assert!(!replies.is_empty(), "a mock needs at least one reply");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let received = Arc::new(Mutex::new(Vec::new()));
        let log = received.clone();
        let replies = Arc::new(replies);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (log, replies) = (log.clone(), replies.clone());
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    answer(req, log.clone(), replies.clone())
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        MockProvider { addr, received }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().expect("lock").clone()
    }
}

async fn answer(
    req: Request<Incoming>,
    log: Arc<Mutex<Vec<Received>>>,
    replies: Arc<Vec<Reply>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let bytes = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let n = {
        let mut log = log.lock().expect("lock");
        log.push(Received {
            path: parts.uri.path().to_owned(),
            headers: parts.headers,
            body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        });
        log.len() - 1
    };
    let (status, body) = match &replies[n.min(replies.len() - 1)] {
        Reply::Json(status, v) => (*status, v.to_string()),
        Reply::Text(status, text) => (*status, (*text).to_owned()),
        Reply::Hang => std::future::pending().await,
    };
    Ok(Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts"))
}

/// A caller whose upstream is `base` (API prefix `/v1`), carrying `credentials` as headers.
pub fn caller(base: &str, credentials: &[(&str, &str)]) -> Caller {
    Caller {
        upstream_base_url: base.into(),
        api_prefix: "/v1".into(),
        credentials: credentials
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Caller::default()
    }
}
