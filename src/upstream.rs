//! The upstream side: where a request goes, how its headers are cleaned, and the pooled client
//! that carries it.
//!
//! [`Upstream::resolve`] maps an incoming URI onto a target (the first `[[routes]]` prefix that
//! matches, else the default `upstream.base_url`), [`prepare_headers`] removes hop-by-hop
//! headers and sets `Host` / `X-Forwarded-For`, and [`Upstream::send`] sends through one shared
//! hyper-util pool (rustls with the `ring` provider; webpki, native and optional extra roots,
//! the settings of `compactor_transport::tls_config` that the summarizers use too) with the
//! response-head timeout. Classifying failures (connect / timeout / protocol) lives here
//! because only this module knows the client's error types.

use std::net::IpAddr;
use std::time::Duration;

use bytes::Bytes;
use compactor_transport::{error_chain, tls_config};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri, Version};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::config::Config;
use crate::error::Error;
use crate::metrics::UpstreamErrorKind;

/// The error type of every body compactor forwards.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type compactor sends upstream and back to clients.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// `body`, carrying `guard` until it has been sent or dropped (when it finishes, or when the
/// client goes away and hyper drops it mid-stream): how a request stays counted as in progress
/// while its answer streams.
pub fn holding<G: Send + Unpin + 'static>(body: ProxyBody, guard: G) -> ProxyBody {
    Holding {
        inner: body,
        _guard: guard,
    }
    .boxed_unsync()
}

struct Holding<G> {
    inner: ProxyBody,
    _guard: G,
}

impl<G: Unpin> hyper::body::Body for Holding<G> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BoxError>>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Headers that describe one connection, not the message: never forwarded (RFC 9110 §7.6.1;
/// `Proxy-Authenticate` answers `Proxy-Authorization`).
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
];

/// `X-Forwarded-For`, which the proxy appends the client's address to.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Where one upstream lives.
#[derive(Debug, Clone)]
struct Target {
    scheme: Scheme,
    authority: Authority,
    /// Path of the base URL without its trailing slash ("" for none).
    base_path: String,
    host: HeaderValue,
    /// The base URL as configured, handed to summarizers that call the same upstream.
    base_url: String,
}

impl Target {
    fn parse(url: &str) -> Result<Target, Error> {
        let uri: Uri = url
            .parse()
            .map_err(|e: http::uri::InvalidUri| Error::BadTarget(e.to_string()))?;
        let scheme = uri.scheme().cloned().unwrap_or(Scheme::HTTPS);
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| Error::BadTarget(format!("no host in {url}")))?;
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|e| Error::BadTarget(e.to_string()))?;
        Ok(Target {
            scheme,
            authority,
            base_path: uri.path().trim_end_matches('/').to_string(),
            host,
            base_url: url.trim_end_matches('/').to_string(),
        })
    }
}

#[derive(Debug, Clone)]
struct Route {
    prefix: String,
    strip_prefix: bool,
    target: Target,
}

/// A request's destination, as decided by [`Upstream::resolve`].
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The absolute URI to send to.
    pub uri: Uri,
    /// The `Host` header value for it.
    pub host: HeaderValue,
    /// The path as the upstream API sees it, relative to the base URL (used to recognise
    /// chat endpoints): `/v1/chat/completions` for `/anthropic/v1/...` under a stripping route.
    pub api_path: String,
    /// The target's base URL plus the request path before the API part is added by callers.
    pub base_url: String,
    /// The `[[routes]]` entry that matched (its index), `None` for the default upstream.
    pub route: Option<usize>,
}

/// A pooled client to the upstreams.
type Pooled = Client<HttpsConnector<HttpConnector>, ProxyBody>;

/// The pooled clients and the routing table.
pub struct Upstream {
    client: Pooled,
    /// HTTP/1.1 only, for upgrades: an `Upgrade` is an HTTP/1.1 mechanism, and a connection
    /// the pool negotiated as HTTP/2 (ALPN, as most TLS upstreams offer) cannot carry one.
    upgrades: Pooled,
    default: Target,
    routes: Vec<Route>,
    response_timeout: Duration,
}

impl Upstream {
    /// Builds the client and routing table from the configuration.
    pub fn new(config: &Config) -> Result<Upstream, Error> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(config.connect_timeout()));
        let tls = tls_client_config(config)?;
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(http.clone());
        let h1_connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = |connector| {
            Client::builder(TokioExecutor::new())
                .pool_idle_timeout(config.pool_idle_timeout())
                .pool_timer(TokioTimer::new())
                .timer(TokioTimer::new())
                .build(connector)
        };
        Upstream::with_clients(config, client(connector), client(h1_connector))
    }

    /// The routing table of `config` over this upstream's pooled client, for a reload that
    /// leaves `[upstream]` as it was: warm connections and TLS sessions are kept.
    pub fn with_routes(&self, config: &Config) -> Result<Upstream, Error> {
        Upstream::with_clients(config, self.client.clone(), self.upgrades.clone())
    }

    fn with_clients(config: &Config, client: Pooled, upgrades: Pooled) -> Result<Upstream, Error> {
        let default = Target::parse(&config.upstream.base_url)?;
        let routes = config
            .routes
            .iter()
            .map(|r| {
                Ok(Route {
                    prefix: r.prefix.trim_end_matches('/').to_string(),
                    strip_prefix: r.strip_prefix,
                    target: Target::parse(&r.base_url)?,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        Ok(Upstream {
            client,
            upgrades,
            default,
            routes,
            response_timeout: config.response_timeout(),
        })
    }

    /// Picks the target for `uri` and builds the upstream URI: the first route whose prefix
    /// matches a whole path segment wins, else the default upstream.
    pub fn resolve(&self, uri: &Uri) -> Result<Resolved, Error> {
        let path = uri.path();
        let (target, api_path, route) = self
            .routes
            .iter()
            .enumerate()
            .find_map(|(i, r)| {
                let rest = path.strip_prefix(r.prefix.as_str())?;
                if !(rest.is_empty() || rest.starts_with('/')) {
                    return None;
                }
                let api = if r.strip_prefix { rest } else { path };
                Some((&r.target, api, Some(i)))
            })
            .unwrap_or((&self.default, path, None));
        let api_path = if api_path.is_empty() { "/" } else { api_path };
        let mut full = String::with_capacity(target.base_path.len() + api_path.len() + 32);
        full.push_str(&target.base_path);
        full.push_str(api_path);
        if let Some(q) = uri.query() {
            full.push('?');
            full.push_str(q);
        }
        let path_and_query =
            PathAndQuery::try_from(full).map_err(|e| Error::BadTarget(e.to_string()))?;
        let uri = Uri::builder()
            .scheme(target.scheme.clone())
            .authority(target.authority.clone())
            .path_and_query(path_and_query)
            .build()
            .map_err(|e| Error::BadTarget(e.to_string()))?;
        Ok(Resolved {
            uri,
            host: target.host.clone(),
            api_path: api_path.to_string(),
            base_url: target.base_url.clone(),
            route,
        })
    }

    /// Sends a prepared request; waits at most `upstream.response_timeout_secs` for the head.
    pub async fn send(&self, request: Request<ProxyBody>) -> Result<Response<Incoming>, SendError> {
        self.send_with(&self.client, request).await
    }

    /// [`Upstream::send`] for an upgrade: over HTTP/1.1, whatever the upstream offers.
    pub async fn send_upgrade(
        &self,
        request: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, SendError> {
        self.send_with(&self.upgrades, request).await
    }

    async fn send_with(
        &self,
        client: &Pooled,
        mut request: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, SendError> {
        // The pool picks HTTP/1.1 or HTTP/2 per connection (ALPN); an HTTP/2 version left over
        // from the client side would make an HTTP/1.1 upstream connection refuse the request.
        *request.version_mut() = Version::HTTP_11;
        match tokio::time::timeout(self.response_timeout, client.request(request)).await {
            Err(_) => Err(SendError::Timeout),
            Ok(Ok(response)) => Ok(response),
            Ok(Err(e)) if e.is_connect() => Err(SendError::Connect(error_chain(&e))),
            Ok(Err(e)) => match client_body_limit(&e) {
                Some(limit) => Err(SendError::BodyTooLarge(limit)),
                None => Err(SendError::Protocol(error_chain(&e))),
            },
        }
    }
}

/// Why a request got no response head.
#[derive(Debug)]
pub enum SendError {
    /// Could not connect (refused, DNS, TLS handshake, connect timeout).
    Connect(String),
    /// No response head in time.
    Timeout,
    /// Connected, but the exchange failed (reset, malformed response).
    Protocol(String),
    /// The client's body, streamed through, went past `server.max_body_bytes`: the client's
    /// fault, answered 413 as a body read whole would be.
    BodyTooLarge(usize),
}

impl SendError {
    /// Its kind, the label of `compactor_upstream_errors_total` (none: not the upstream's).
    pub fn kind(&self) -> Option<UpstreamErrorKind> {
        match self {
            SendError::Connect(_) => Some(UpstreamErrorKind::Connect),
            SendError::Timeout => Some(UpstreamErrorKind::Timeout),
            SendError::Protocol(_) => Some(UpstreamErrorKind::Protocol),
            SendError::BodyTooLarge(_) => None,
        }
    }
}

/// The limit the body streamed from the client went past, when that ended the exchange
/// (`client_body`'s error, carried as the cause of the client's).
fn client_body_limit(e: &(dyn std::error::Error + 'static)) -> Option<usize> {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if let Some(Error::BodyTooLarge { limit }) = e.downcast_ref::<Error>() {
            return Some(*limit);
        }
        cause = e.source();
    }
    None
}

impl From<SendError> for Error {
    fn from(e: SendError) -> Error {
        match e {
            SendError::Timeout => Error::UpstreamTimeout,
            SendError::BodyTooLarge(limit) => Error::BodyTooLarge { limit },
            SendError::Connect(cause) | SendError::Protocol(cause) => Error::UpstreamUnavailable {
                upstream: None,
                cause,
            },
        }
    }
}

/// The origin of `uri` as a person would name the upstream: `scheme://host:port` (no user
/// information, path or query).
pub fn origin(uri: &http::Uri) -> Option<String> {
    let scheme = uri.scheme_str()?;
    let host = uri.host()?;
    Some(match uri.port_u16() {
        Some(port) => format!("{scheme}://{host}:{port}"),
        None => format!("{scheme}://{host}"),
    })
}

/// Cleans request or response headers for the other side of the proxy: removes the fixed
/// hop-by-hop set and every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    // Only the names present are removed: one look at each header is cheaper than a removal
    // (a hash and a probe) per hop-by-hop name, and most messages carry one or two of them.
    let present: Vec<HeaderName> = headers
        .keys()
        .filter(|name| HOP_BY_HOP.contains(name) || named.contains(name))
        .cloned()
        .collect();
    for name in present {
        headers.remove(name);
    }
}

/// Prepares request headers for the upstream: hop-by-hop removed, `Host` set to the target,
/// the client's address appended to `X-Forwarded-For`.
pub fn prepare_headers(headers: &mut HeaderMap, host: &HeaderValue, client_ip: IpAddr) {
    strip_hop_by_hop(headers);
    headers.insert(header::HOST, host.clone());
    let prior: Vec<&str> = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let value = if prior.is_empty() {
        client_ip.to_string()
    } else {
        format!("{}, {client_ip}", prior.join(", "))
    };
    // The string's buffer becomes the value's: no copy.
    if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(value)) {
        headers.insert(X_FORWARDED_FOR, v);
    }
}

fn tls_client_config(config: &Config) -> Result<rustls::ClientConfig, Error> {
    tls_config(config.upstream.ca_file.as_deref())
        .map_err(|e| Error::Tls(format!("upstream.ca_file: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(toml: &str) -> Upstream {
        let config = Config::from_toml(toml).expect("config");
        Upstream::new(&config).expect("upstream")
    }

    #[test]
    fn routes_match_whole_segments_and_strip_on_request() {
        let u = upstream(
            "[upstream]\nbase_url = \"http://default:1/base/\"\n\
             [[routes]]\nprefix = \"/anthropic\"\nbase_url = \"https://api.anthropic.com\"\n\
             [[routes]]\nprefix = \"/keep\"\nbase_url = \"http://k:2\"\nstrip_prefix = false\n",
        );
        let r = u
            .resolve(&"/anthropic/v1/messages?x=1".parse().expect("uri"))
            .expect("ok");
        assert_eq!(
            r.uri.to_string(),
            "https://api.anthropic.com/v1/messages?x=1"
        );
        assert_eq!(r.api_path, "/v1/messages");
        assert_eq!(r.host, "api.anthropic.com");
        let r = u.resolve(&"/keep/v1/x".parse().expect("uri")).expect("ok");
        assert_eq!(r.uri.to_string(), "http://k:2/keep/v1/x");
        let r = u
            .resolve(&"/anthropicx/v1".parse().expect("uri"))
            .expect("ok");
        assert_eq!(r.uri.to_string(), "http://default:1/base/anthropicx/v1");
        assert_eq!(r.host, "default:1");
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, x-private"),
        );
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        h.insert("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        prepare_headers(
            &mut h,
            &HeaderValue::from_static("up:1"),
            [127, 0, 0, 1].into(),
        );
        assert!(h.get("x-private").is_none() && h.get("keep-alive").is_none());
        assert!(h.get(header::CONNECTION).is_none());
        assert_eq!(h[header::AUTHORIZATION], "Bearer k");
        assert_eq!(h[header::HOST], "up:1");
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 127.0.0.1");
    }

    #[test]
    fn each_hop_by_hop_header_is_removed_alone() {
        for name in [
            "keep-alive",
            "proxy-connection",
            "te",
            "trailer",
            "transfer-encoding",
            "upgrade",
            "proxy-authorization",
            "proxy-authenticate",
        ] {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            h.insert(HeaderName::from_static(name), HeaderValue::from_static("x"));
            strip_hop_by_hop(&mut h);
            assert!(h.get(name).is_none(), "{name} is forwarded");
            assert_eq!(h.len(), 1, "{name}: the rest stays");
        }
    }
}
