//! compactor's HTTP(S) transport: the TLS settings of every outbound connection, and a small
//! pooled JSON-over-HTTP(S) client for summarizer backends that call an LLM endpoint.
//!
//! [`tls_config`] builds the client TLS settings compactor uses everywhere (rustls with the
//! `ring` provider; webpki roots, the system's roots and an optional extra CA file), so the
//! proxy's upstream pool and the summarizers trust the same roots; it fails with this crate's
//! own [`TlsError`]. One [`HttpClient`] holds one pooled hyper-util client over those settings,
//! so a backend instance reuses its connections. [`HttpClient::post_json`] sends one JSON body
//! and maps every way the exchange can fail onto the summarizer contract's [`SummarizeError`]:
//! deadline → `Timeout`, connect/IO → `Transport`, non-2xx → `Status` with the provider's own
//! message (bounded, secrets removed), unreadable JSON → `InvalidOutput`, a body over the
//! client's bound (see [`HttpClient::with_max_response_bytes`]) → `TooLarge`. The `openai`,
//! `anthropic` and `gemini` backends use it, and the helpers they share (endpoint, model and
//! output budget of a summary request, and [`inside_first`], the order of the summary asked
//! inside the conversation and the standalone prompt) live here with it.
#![deny(missing_docs)]

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, ACCEPT, CONTENT_LENGTH, CONTENT_TYPE, USER_AGENT};
use http::{Request, Uri};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use tokio::time::Instant;

use compactor_plugin_api::{
    Caller, InvalidSetting, SummarizeError, Summary, SummaryRequest, DEFAULT_MAX_SUMMARY_BYTES,
    SUMMARY_ENVELOPE_BYTES,
};

/// `body` encoded as a request body; an error that cannot encode is a configuration error.
pub fn json_body(body: &serde_json::Value) -> Result<Bytes, SummarizeError> {
    serde_json::to_vec(body)
        .map(Bytes::from)
        .map_err(|e| SummarizeError::Config(format!("cannot encode request: {e}")))
}

/// The largest answer body read from a provider when summaries may take `max_summary_bytes`:
/// the summary plus [`SUMMARY_ENVELOPE_BYTES`] for the JSON around it.
pub fn response_limit(max_summary_bytes: usize) -> usize {
    max_summary_bytes.saturating_add(SUMMARY_ENVELOPE_BYTES)
}

/// Longest provider error message kept in a [`SummarizeError::Status`].
pub const MAX_ERROR_MESSAGE_CHARS: usize = 300;

/// Shown instead of a secret that a provider echoed back.
const REDACTED: &str = "[redacted]";

/// A pooled HTTP/1.1 + HTTP/2 client for `http` and `https` endpoints.
#[derive(Clone)]
pub struct HttpClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// Largest response body read; see [`HttpClient::with_max_response_bytes`].
    max_response_bytes: usize,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpClient").finish_non_exhaustive()
    }
}

impl HttpClient {
    /// Builds a client trusting webpki's roots, the system's roots (best effort) and, when
    /// given, every certificate of the PEM file `extra_ca_file`.
    pub fn new(extra_ca_file: Option<&Path>) -> Result<HttpClient, SummarizeError> {
        let tls = tls_config(extra_ca_file).map_err(|e| SummarizeError::Config(e.to_string()))?;
        Ok(HttpClient::with_tls_config(tls))
    }

    /// Builds a client from a ready rustls configuration (its ALPN list must be empty).
    pub fn with_tls_config(tls: rustls::ClientConfig) -> HttpClient {
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .build();
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector);
        HttpClient {
            client,
            max_response_bytes: response_limit(DEFAULT_MAX_SUMMARY_BYTES),
        }
    }

    /// Bounds the response bodies read to `max` bytes (by default
    /// [`response_limit`]`(`[`DEFAULT_MAX_SUMMARY_BYTES`]`)`).
    ///
    /// A body announced larger (`Content-Length`) is refused before any of it is read; one
    /// that turns out larger is refused as soon as the bound is crossed. Either way the rest is
    /// never read and the connection is dropped rather than returned to the pool. A 2xx answer
    /// refused so is [`SummarizeError::TooLarge`]; an error status stays
    /// [`SummarizeError::Status`], with a message saying the body was too large to read.
    pub fn with_max_response_bytes(mut self, max: usize) -> HttpClient {
        self.max_response_bytes = max;
        self
    }

    /// POSTs `body` as JSON to `url` and returns the parsed JSON answer of a 2xx response.
    ///
    /// Gives up at `deadline` with [`SummarizeError::Timeout`] carrying `timeout`. `secrets`
    /// are the credential values sent: any of them echoed in an error body is replaced by
    /// `[redacted]` before it reaches the error (and therefore the logs).
    pub async fn post_json(
        &self,
        url: &str,
        headers: &[(HeaderName, HeaderValue)],
        body: &serde_json::Value,
        secrets: &[&str],
        deadline: Instant,
        timeout: Duration,
    ) -> Result<serde_json::Value, SummarizeError> {
        self.post(url, headers, json_body(body)?, secrets, deadline, timeout)
            .await
    }

    /// [`HttpClient::post_json`] for a body already encoded as JSON.
    pub async fn post(
        &self,
        url: &str,
        headers: &[(HeaderName, HeaderValue)],
        bytes: Bytes,
        secrets: &[&str],
        deadline: Instant,
        timeout: Duration,
    ) -> Result<serde_json::Value, SummarizeError> {
        let uri: Uri = url
            .parse()
            .map_err(|e| SummarizeError::Config(format!("invalid endpoint `{url}`: {e}")))?;
        let mut builder = Request::post(uri)
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, "application/json")
            .header(USER_AGENT, concat!("compactor/", env!("CARGO_PKG_VERSION")));
        for (name, value) in headers {
            builder = builder.header(name, value);
        }
        let request = builder
            .body(Full::new(bytes))
            .map_err(|e| SummarizeError::Config(format!("cannot build request: {e}")))?;

        let limit = self.max_response_bytes;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| SummarizeError::Transport(error_chain(&e)))?;
            let status = response.status();
            let announced = response
                .headers()
                .get(CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            if announced.is_some_and(|n| n > limit as u64) {
                // Dropping the response closes the connection with the body unread.
                return Ok((status, None));
            }
            let body = match Limited::new(response.into_body(), limit).collect().await {
                Ok(collected) => Some(collected.to_bytes()),
                Err(e) if e.is::<LengthLimitError>() => None,
                Err(e) => {
                    return Err(SummarizeError::Transport(format!(
                        "reading response: {}",
                        error_chain(&*e)
                    )))
                }
            };
            Ok::<_, SummarizeError>((status, body))
        };
        let (status, body) = tokio::time::timeout_at(deadline, exchange)
            .await
            .map_err(|_| SummarizeError::Timeout(timeout))??;

        let Some(body) = body else {
            return Err(if status.is_success() {
                SummarizeError::TooLarge {
                    what: "response body".into(),
                    limit,
                }
            } else {
                SummarizeError::Status {
                    status: status.as_u16(),
                    message: format!("error body larger than {limit} bytes, not read"),
                }
            });
        };
        if !status.is_success() {
            return Err(SummarizeError::Status {
                status: status.as_u16(),
                message: provider_message(&body, secrets),
            });
        }
        serde_json::from_slice(&body).map_err(|e| {
            SummarizeError::InvalidOutput(format!("response is not JSON ({status}): {e}"))
        })
    }
}

/// Checks a configured endpoint base: an `http://` or `https://` URL with a host and no
/// query string; `None` (the caller's own upstream) is fine.
pub fn check_base_url(url: Option<&str>) -> Result<(), InvalidSetting> {
    let Some(url) = url else {
        return Ok(());
    };
    let uri: Uri = url
        .parse()
        .map_err(|e| InvalidSetting::new("base_url", format!("{e}")))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err(InvalidSetting::new(
            "base_url",
            "must be an http:// or https:// URL with a host",
        ));
    }
    if uri.query().is_some() {
        return Err(InvalidSetting::new(
            "base_url",
            "must not carry a query string",
        ));
    }
    Ok(())
}

/// Checks an output budget: positive.
pub fn check_max_tokens(max_tokens: u32) -> Result<(), InvalidSetting> {
    if max_tokens == 0 {
        return Err(InvalidSetting::new("max_tokens", "must be positive"));
    }
    Ok(())
}

/// Whether a summary asked for inside the conversation
/// ([`SummaryRequest::in_conversation`](compactor_plugin_api::SummaryRequest::in_conversation))
/// that failed with `e` is worth asking again with the standalone prompt: the provider refused
/// that request's shape (a 4xx other than for credentials or rate) or answered no summary (a
/// tool call, nothing). A timeout, a broken connection, a refused credential, a rate limit or
/// a server error would meet the second request too.
pub fn standalone_may_succeed(e: &SummarizeError) -> bool {
    match e {
        SummarizeError::Status { status, .. } => {
            (400..500).contains(status) && ![401, 403, 408, 429].contains(status)
        }
        SummarizeError::InvalidOutput(_) | SummarizeError::Blank => true,
        SummarizeError::Timeout(_)
        | SummarizeError::Transport(_)
        | SummarizeError::Config(_)
        | SummarizeError::TooLarge { .. } => false,
    }
}

/// Asks for a summary inside the conversation first, when the backend has that request
/// (`inside`), and with the standalone prompt when there is none or when it failed in a way
/// the standalone prompt may not ([`standalone_may_succeed`]); any other outcome of the first
/// request is the answer. The order every backend calling the caller's own model follows;
/// `ask` sends one request body, `standalone` builds the standalone one (only when needed).
pub async fn inside_first<B, Fut>(
    backend: &str,
    inside: Option<B>,
    standalone: impl FnOnce() -> Result<B, SummarizeError>,
    ask: impl Fn(B) -> Fut,
) -> Result<Summary, SummarizeError>
where
    Fut: std::future::Future<Output = Result<Summary, SummarizeError>>,
{
    if let Some(body) = inside {
        match ask(body).await {
            Err(e) if standalone_may_succeed(&e) => tracing::debug!(
                backend,
                error = %e,
                "the summary asked inside the conversation failed; asking with the standalone prompt"
            ),
            answered => return answered,
        }
    }
    ask(standalone()?).await
}

/// The credential headers of one request, and the secret values they carry (so that a
/// provider echoing one back can be redacted).
#[derive(Default)]
pub struct Auth {
    /// Headers to send.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Secret strings that must never reach an error message or a log.
    pub secrets: Vec<String>,
}

impl Auth {
    /// Adds a credential header; `secrets` are the parts of `value` to redact.
    pub fn add(
        &mut self,
        name: HeaderName,
        value: &str,
        secrets: &[&str],
    ) -> Result<(), SummarizeError> {
        self.headers.push((name, secret_header(value)?));
        self.secrets.extend(
            secrets
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| s.to_string()),
        );
        Ok(())
    }

    /// Adds an `Authorization`-style value, redacting both it and its bearer token.
    pub fn add_bearer(&mut self, name: HeaderName, value: &str) -> Result<(), SummarizeError> {
        let token = value.strip_prefix("Bearer ").unwrap_or(value).trim();
        self.add(name, value, &[value, token])
    }

    /// The secrets as string slices, as [`HttpClient::post_json`] takes them.
    pub fn secret_refs(&self) -> Vec<&str> {
        self.secrets.iter().map(String::as_str).collect()
    }
}

/// Builds a header value for a credential, marked sensitive so it never shows in debug output.
pub fn secret_header(value: &str) -> Result<HeaderValue, SummarizeError> {
    let mut v = HeaderValue::from_str(value).map_err(|_| {
        SummarizeError::Config("a credential is not a valid HTTP header value".into())
    })?;
    v.set_sensitive(true);
    Ok(v)
}

/// The provider's error message from an error body: `error.message`, `error` or `message` of a
/// JSON body, else the body text; whitespace collapsed, secrets redacted, bounded.
pub fn provider_message(body: &[u8], secrets: &[&str]) -> String {
    let json: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let from_json = json.as_ref().and_then(|v| {
        let error = v.get("error");
        error
            .and_then(|e| e.get("message"))
            .and_then(|m| m.as_str())
            .or_else(|| error.and_then(|e| e.as_str()))
            .or_else(|| v.get("message").and_then(|m| m.as_str()))
            .or_else(|| v.get("detail").and_then(|m| m.as_str()))
            .map(str::to_owned)
    });
    let text = from_json.unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let mut text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    for secret in secrets {
        if !secret.is_empty() {
            text = text.replace(secret, REDACTED);
        }
    }
    bounded(&text, MAX_ERROR_MESSAGE_CHARS)
}

/// `text` cut to at most `max` characters, with `…` when cut.
pub fn bounded(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}

/// The output budget to send: the configured one, capped by the request's when it gives one
/// (0 means "not given" on either side).
pub fn output_budget(configured: u32, requested: u32) -> u32 {
    match (configured, requested) {
        (0, r) => r,
        (c, 0) => c,
        (c, r) => c.min(r),
    }
}

/// `base` and `path` joined with exactly one `/`.
pub fn join_url(base: &str, path: &str) -> String {
    format!(
        "{}/{}",
        base.trim_end_matches('/'),
        path.trim_start_matches('/')
    )
}

/// `path` on the endpoint a summary request goes to: `base_url` when configured, else the
/// caller's own upstream and API prefix (`default_prefix` when the caller has none).
pub fn endpoint(
    base_url: Option<&str>,
    caller: &Caller,
    default_prefix: &str,
    path: &str,
) -> Result<String, SummarizeError> {
    if let Some(base) = base_url {
        return Ok(join_url(base, path));
    }
    if caller.upstream_base_url.is_empty() {
        return Err(SummarizeError::Config(
            "no base_url configured and the request has no upstream".into(),
        ));
    }
    let prefix = match caller.api_prefix.as_str() {
        "" => default_prefix,
        prefix => prefix,
    };
    Ok(join_url(&join_url(&caller.upstream_base_url, prefix), path))
}

/// The model of a summary request: the configured one, else the request's own.
pub fn model<'a>(
    configured: Option<&'a str>,
    request: &'a SummaryRequest,
) -> Result<&'a str, SummarizeError> {
    configured.or(request.model.as_deref()).ok_or_else(|| {
        SummarizeError::Config("no model configured and the request names none".into())
    })
}

/// An error and its sources, `: `-separated (hyper's top-level messages alone say little).
pub fn error_chain(e: &dyn StdError) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Why [`tls_config`] could not build the TLS settings: the only error this crate owns (the
/// client's exchanges fail with the summarizer contract's [`SummarizeError`], since only
/// summarizers use them).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The extra CA file could not be read or holds a certificate rustls rejects.
    #[error("CA file {path}: {reason}")]
    CaFile {
        /// The file as configured.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// rustls refused the protocol versions of its own provider (a build problem).
    #[error("TLS setup: {0}")]
    Setup(String),
}

/// The client TLS settings compactor uses for every `https` endpoint: webpki's roots, the
/// system's (best effort) and the PEM certificates of `extra_ca_file`.
pub fn tls_config(extra_ca_file: Option<&Path>) -> Result<rustls::ClientConfig, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    // Native roots are best effort: a machine without a system store still has webpki's.
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    if let Some(path) = extra_ca_file {
        let bad = |e: &dyn std::fmt::Display| TlsError::CaFile {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        for cert in CertificateDer::pem_file_iter(path).map_err(|e| bad(&e))? {
            roots.add(cert.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Setup(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first request inside the conversation, the standalone one only when that failed in
    /// a way it may not, or when there is no first; each body asked once, in that order.
    #[test]
    fn inside_first_falls_back_only_when_the_standalone_prompt_may_succeed() {
        use std::cell::RefCell;
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        type Reply = fn() -> Result<Summary, SummarizeError>;
        let ok: Reply = || Summary::new("from inside");
        let refused: Reply = || {
            Err(SummarizeError::Status {
                status: 400,
                message: "unsupported".into(),
            })
        };
        let tool_call: Reply = || Err(SummarizeError::InvalidOutput("a tool call".into()));
        let rate_limited: Reply = || {
            Err(SummarizeError::Status {
                status: 429,
                message: "slow down".into(),
            })
        };
        let cases: [(Option<Reply>, &[&str], Option<&str>); 5] = [
            (None, &["standalone"], Some("from standalone")),
            (Some(ok), &["inside"], Some("from inside")),
            (
                Some(refused),
                &["inside", "standalone"],
                Some("from standalone"),
            ),
            (
                Some(tool_call),
                &["inside", "standalone"],
                Some("from standalone"),
            ),
            (Some(rate_limited), &["inside"], None),
        ];
        for (inside, asked, expected) in cases {
            let sent = RefCell::new(Vec::new());
            let answer = rt.block_on(inside_first(
                "test",
                inside.map(|_| "inside"),
                || Ok("standalone"),
                |body: &str| {
                    sent.borrow_mut().push(body.to_string());
                    std::future::ready(match (body, inside) {
                        ("inside", Some(reply)) => reply(),
                        _ => Summary::new("from standalone"),
                    })
                },
            ));
            assert_eq!(*sent.borrow(), asked);
            assert_eq!(answer.ok().map(|s| s.text), expected.map(str::to_string));
        }

        // A standalone body that cannot be built is the answer's error.
        let failed = rt.block_on(inside_first(
            "test",
            None::<&str>,
            || Err(SummarizeError::Config("cannot encode".into())),
            |_| std::future::ready(Summary::new("never")),
        ));
        assert!(matches!(failed, Err(SummarizeError::Config(_))));
    }

    #[test]
    fn provider_messages_are_extracted_redacted_and_bounded() {
        let body = br#"{"error":{"message":"Incorrect API key provided: sk-live-123.\n Check it.","type":"invalid_request_error"}}"#;
        assert_eq!(
            provider_message(body, &["sk-live-123"]),
            "Incorrect API key provided: [redacted]. Check it."
        );
        assert_eq!(provider_message(b"upstream  down", &[]), "upstream down");
        let long = "x".repeat(1000);
        let m = provider_message(long.as_bytes(), &[]);
        assert_eq!(m.chars().count(), MAX_ERROR_MESSAGE_CHARS + 1);
        assert!(m.ends_with('…'));
    }

    #[test]
    fn urls_join_with_one_slash() {
        assert_eq!(join_url("http://a/v1/", "/chat"), "http://a/v1/chat");
        assert_eq!(join_url("http://a", "v1/messages"), "http://a/v1/messages");
    }

    #[test]
    fn budgets_take_the_smaller_given_value() {
        assert_eq!(output_budget(4096, 1000), 1000);
        assert_eq!(output_budget(4096, 0), 4096);
        assert_eq!(output_budget(0, 2000), 2000);
    }

    #[test]
    fn an_unreadable_ca_file_is_a_tls_error_naming_the_file() {
        let path = Path::new("/nonexistent/compactor-test-ca.pem");
        match tls_config(Some(path)) {
            Err(e @ TlsError::CaFile { .. }) => {
                assert!(e
                    .to_string()
                    .starts_with("CA file /nonexistent/compactor-test-ca.pem: "));
            }
            other => panic!("expected a CA file error, got {:?}", other.map(|_| ())),
        }
        // The summarizers' client reports it as a configuration problem, same text.
        match HttpClient::new(Some(path)) {
            Err(SummarizeError::Config(m)) => assert!(m.starts_with("CA file "), "{m}"),
            other => panic!("expected a config error, got {other:?}"),
        }
        assert!(tls_config(None).is_ok());
    }

    /// Serves one connection on `127.0.0.1:0`: reads the request, answers `head` (status line
    /// and headers, without the blank line), then `body` followed by `filler` bytes of `x`,
    /// as one piece or (`chunked`) as chunks of at most 16 KiB. The task answers whether the
    /// whole body could be written, i.e. whether the client kept reading.
    async fn serve_once(
        head: String,
        body: &'static [u8],
        filler: usize,
        chunked: bool,
    ) -> (String, tokio::task::JoinHandle<bool>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let task = tokio::spawn(async move {
            let Ok((mut stream, _)) = listener.accept().await else {
                return false;
            };
            // The request is a few bytes: its headers and body arrive in one read or a few.
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            while !request_complete(&request) {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return false,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            let framing = if chunked {
                "\r\ntransfer-encoding: chunked"
            } else {
                ""
            };
            let start = format!("{head}{framing}\r\n\r\n");
            if stream.write_all(start.as_bytes()).await.is_err() {
                return false;
            }
            let filler_piece = [b'x'; 16 * 1024];
            let mut pieces = body.chunks(16 * 1024).collect::<Vec<_>>().into_iter();
            let mut left = filler;
            loop {
                let piece: &[u8] = match pieces.next() {
                    Some(p) => p,
                    None if left > 0 => {
                        let n = left.min(filler_piece.len());
                        left -= n;
                        &filler_piece[..n]
                    }
                    None => break,
                };
                let mut out = Vec::with_capacity(piece.len() + 16);
                if chunked {
                    out.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
                }
                out.extend_from_slice(piece);
                if chunked {
                    out.extend_from_slice(b"\r\n");
                }
                if stream.write_all(&out).await.is_err() {
                    return false;
                }
            }
            if chunked && stream.write_all(b"0\r\n\r\n").await.is_err() {
                return false;
            }
            stream.flush().await.is_ok()
        });
        (format!("http://{addr}/v1/chat/completions"), task)
    }

    /// Whether `request` holds a whole request: its headers and `content-length` bytes of body.
    fn request_complete(request: &[u8]) -> bool {
        let text = String::from_utf8_lossy(request);
        let Some(end) = text.find("\r\n\r\n") else {
            return false;
        };
        let length = text[..end]
            .lines()
            .find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse::<usize>().ok())
                    .flatten()
            })
            .unwrap_or(0);
        request.len() >= end + 4 + length
    }

    async fn post(client: &HttpClient, url: &str) -> Result<serde_json::Value, SummarizeError> {
        let timeout = Duration::from_secs(20);
        client
            .post_json(
                url,
                &[],
                &serde_json::json!({"model": "m"}),
                &[],
                Instant::now() + timeout,
                timeout,
            )
            .await
    }

    /// Far more than the socket buffers between the two ends hold: a server that manages to
    /// write it all had a client reading it all.
    const HUGE: usize = 64 * 1024 * 1024;

    fn client(max_response_bytes: usize) -> HttpClient {
        HttpClient::new(None)
            .expect("client")
            .with_max_response_bytes(max_response_bytes)
    }

    #[tokio::test]
    async fn an_answer_announced_too_large_is_refused_unread() {
        let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {HUGE}");
        let (url, server) = serve_once(head, b"", HUGE, false).await;
        match post(&client(1000), &url).await {
            Err(e @ SummarizeError::TooLarge { limit: 1000, .. }) => {
                assert_eq!(e.kind(), "too_large");
                assert_eq!(
                    e.to_string(),
                    "summarizer answer too large: response body exceeds 1000 bytes"
                );
            }
            other => panic!("expected too large, got {other:?}"),
        }
        assert!(
            !server.await.expect("server"),
            "the body was not read to its end"
        );
    }

    #[tokio::test]
    async fn a_streamed_answer_is_refused_once_it_crosses_the_bound() {
        let (url, server) = serve_once("HTTP/1.1 200 OK".into(), b"", HUGE, true).await;
        let err = post(&client(100_000), &url).await.expect_err("too large");
        assert!(
            matches!(err, SummarizeError::TooLarge { limit: 100_000, .. }),
            "{err:?}"
        );
        assert!(
            !server.await.expect("server"),
            "the body was not read to its end"
        );
    }

    #[tokio::test]
    async fn an_oversized_error_body_keeps_its_status() {
        let (url, server) = serve_once("HTTP/1.1 502 Bad Gateway".into(), b"", HUGE, true).await;
        match post(&client(1000), &url).await {
            Err(SummarizeError::Status {
                status: 502,
                message,
            }) => assert_eq!(message, "error body larger than 1000 bytes, not read"),
            other => panic!("expected a status error, got {other:?}"),
        }
        assert!(!server.await.expect("server"));
    }

    #[tokio::test]
    async fn answers_up_to_the_bound_are_read() {
        const BODY: &[u8] = br#"{"choices":[{"message":{"content":"ok"}}]}"#;
        for chunked in [false, true] {
            let head = if chunked {
                "HTTP/1.1 200 OK".to_owned()
            } else {
                format!("HTTP/1.1 200 OK\r\ncontent-length: {}", BODY.len())
            };
            let (url, server) = serve_once(head, BODY, 0, chunked).await;
            let answer = post(&client(BODY.len()), &url).await.expect("read");
            assert_eq!(answer["choices"][0]["message"]["content"], "ok");
            assert!(server.await.expect("server"));
        }
    }

    #[test]
    fn the_response_limit_adds_the_envelope() {
        assert_eq!(response_limit(1000), 1000 + SUMMARY_ENVELOPE_BYTES);
        assert_eq!(response_limit(usize::MAX), usize::MAX);
    }

    #[test]
    fn bounded_respects_char_boundaries() {
        assert_eq!(bounded("héllo", 2), "hé…");
        assert_eq!(bounded("hi", 2), "hi");
    }
}
