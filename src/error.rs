//! The proxy's error enum: each variant knows its HTTP status and renders the OpenAI-shaped
//! JSON body (`{"error":{"message","type","code"}}`) that SDKs display.
//!
//! Messages sent to clients are fixed, short and free of internal detail; the cause travels in
//! the variant and is logged by the proxy, never sent.

use bytes::Bytes;
use http::{header, Response, StatusCode};

/// Everything that can go wrong serving a request or starting the server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The upstream could not be reached or the exchange broke off before a response head
    /// (or, for a refusal being read, within its body).
    #[error("upstream {} unreachable: {cause}", upstream.as_deref().unwrap_or("API"))]
    UpstreamUnavailable {
        /// The upstream's origin (`scheme://host:port`), when known: it is named to the client
        /// too (the operator's own configuration, never a credential).
        upstream: Option<String>,
        /// What failed (addresses, OS errors): logged, never sent.
        cause: String,
    },
    /// `compactor run` could not start the agent's command.
    #[error("cannot run {0}")]
    Agent(String),
    /// `server.event_log` could not be opened.
    #[error("cannot open the event log {path}: {source}")]
    EventLog {
        /// The configured path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A listener could not be bound (at start-up).
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The configured address.
        addr: std::net::SocketAddr,
        /// Why (in use, not permitted, ...).
        source: std::io::Error,
    },
    /// The upstream sent no response head within `upstream.response_timeout_secs`.
    #[error("upstream response timed out")]
    UpstreamTimeout,
    /// A body compactor had to read exceeded `server.max_body_bytes`.
    #[error("request body exceeds {limit} bytes")]
    BodyTooLarge {
        /// The configured limit.
        limit: usize,
    },
    /// The client's request body could not be read.
    #[error("reading request body: {0}")]
    BadRequestBody(String),
    /// The client did not send its request body within `server.client_timeout_secs` (for a
    /// body streamed through: between two chunks).
    #[error("request body not received within {0:?}")]
    ClientTimeout(std::time::Duration),
    /// The request's URI cannot be mapped onto the upstream.
    #[error("invalid request target: {0}")]
    BadTarget(String),
    /// Start-up: the configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Start-up: a summarizer backend could not be built.
    #[error(transparent)]
    Summarizer(#[from] crate::summarizer::BuildError),
    /// Start-up: TLS material could not be loaded.
    #[error("TLS setup: {0}")]
    Tls(String),
    /// Start-up: metrics registry failure.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// Start-up or accept: socket failure.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// The status a client sees for this error.
    pub fn status(&self) -> StatusCode {
        match self {
            Error::UpstreamUnavailable { .. } => StatusCode::BAD_GATEWAY,
            Error::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Error::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Error::ClientTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Error::BadRequestBody(_) | Error::BadTarget(_) => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// `(message, type, code)` for the JSON body: fixed strings, no internal causes.
    fn public_parts(&self) -> (String, &'static str, &'static str) {
        match self {
            Error::UpstreamUnavailable { upstream, .. } => (
                match upstream {
                    Some(u) => format!("compactor could not reach the upstream API at {u}"),
                    None => "compactor could not reach the upstream API".into(),
                },
                "upstream_error",
                "upstream_unavailable",
            ),
            Error::UpstreamTimeout => (
                "the upstream API did not answer in time".into(),
                "upstream_error",
                "upstream_timeout",
            ),
            Error::BodyTooLarge { limit } => (
                format!("request body exceeds compactor's limit of {limit} bytes"),
                "invalid_request_error",
                "request_too_large",
            ),
            Error::BadRequestBody(_) => (
                "the request body could not be read".into(),
                "invalid_request_error",
                "bad_request_body",
            ),
            Error::ClientTimeout(_) => (
                "the request body was not received in time".into(),
                "invalid_request_error",
                "request_timeout",
            ),
            Error::BadTarget(_) => (
                "the request target cannot be forwarded".into(),
                "invalid_request_error",
                "bad_request_target",
            ),
            _ => (
                "compactor internal error".into(),
                "server_error",
                "internal_error",
            ),
        }
    }

    /// The full client response for this error.
    pub fn to_response<B: From<Bytes>>(&self) -> Response<B> {
        let (message, kind, code) = self.public_parts();
        error_response(self.status(), &message, kind, code)
    }
}

/// An OpenAI-shaped error response (`{"error":{"message","type","code"}}`), which every SDK
/// knows how to show.
pub fn error_response<B: From<Bytes>>(
    status: StatusCode,
    message: &str,
    kind: &str,
    code: &str,
) -> Response<B> {
    let body = serde_json::json!({
        "error": { "message": message, "type": kind, "code": code }
    });
    let mut response = Response::new(B::from(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;

    #[test]
    fn errors_render_openai_shaped_bodies_without_causes() {
        let e = Error::UpstreamUnavailable {
            upstream: Some("https://api.example.com:443".into()),
            cause: "connect refused to 10.0.0.7:443".into(),
        };
        assert!(e.to_string().contains("https://api.example.com:443"), "{e}");
        assert!(
            e.to_string().contains("10.0.0.7"),
            "the log has the cause: {e}"
        );
        let r: Response<Full<Bytes>> = e.to_response();
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        let text = format!("{:?}", r.body());
        assert!(!text.contains("10.0.0.7"), "internal cause leaked: {text}");
        assert!(text.contains("https://api.example.com:443"), "{text}");
        assert_eq!(Error::UpstreamTimeout.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(
            Error::BodyTooLarge { limit: 1 }.status(),
            StatusCode::PAYLOAD_TOO_LARGE
        );
    }
}
